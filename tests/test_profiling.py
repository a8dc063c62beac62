"""rm.profile_comms / rm.profile_memory: bytes per collective kind, phase and layer kind against the
closed-form volumes; memory per rank."""

from __future__ import annotations

import sys

import pytest
import torch

from ringmaster_tools import profiling
from ringmaster_tools.profiling import CommProfile, CommRecord, count_collectives, layer_kind, profile_memory

# profiles gathered over the world: every rank of the pool
# (ringmaster_tools.pool.RankContext: this module's jobs are never solo)
ALL_GROUPS = True

F32 = 4


# --------------------------------------------------------------------------------------------
# jobs the pool runs on every rank (this module is importable by the spawned workers)


def attention_bytes_job(ctx, P, S, H, Hkv, D):
    """Ulysses, Ring p2p and Ring allgather on raw tensors: bytes per kind/phase/layer kind,
    from profile_comms and from count_collectives (every torch.distributed call)."""
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster_tools.bench import attention_system

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(r)
    q, k, v = (torch.randn(1, h, S // P, D, generator=g) for h in (H, Hkv, Hkv))
    methods = {key: attention_system(name, group, P, r, S, H, Hkv, D, None)[1]
               for key, name in (("ulysses", "ringmaster ulysses"), ("ring_alltoall", "ringmaster ring p2p"),
                                 ("ring_allgather", "ringmaster ring allgather"))}
    out = {}
    for name, fn in methods.items():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with count_collectives() as seen, rm.profile_comms() as comms:
            fn(*leaves).float().sum().backward()
        out[name] = {
            "by_kind": comms.by_kind(), "by_layer_kind": comms.by_layer_kind(),
            "total": comms.total_bytes(), "attention": comms.total_bytes(layer_kind="attention"),
            "seen": {(rec.kind, rec.phase): seen.total_bytes(rec.kind, rec.phase) for rec in seen.records},
            "seconds": comms.total_seconds(), "calls": comms.calls(), "table": comms.table(),
        }
    out["kv_local"] = 2 * k.numel() * k.element_size()
    return out


def hybrid_profile_job(ctx, P, seq):
    """A gated-DeltaNet hybrid under Ulysses: comms split by layer kind; memory per rank."""
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model("qwen3_5_text")
    batch = tiny_batch(model.config.vocab_size, seq)
    reference = tiny_model("qwen3_5_text")
    with rm.profile_memory() as ref_mem:
        reference(**batch, use_cache=False).loss.backward()
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        with rm.profile_comms() as comms, rm.profile_memory() as mem:
            with context_parallel_region(batch) as shard:
                model(**shard).loss.backward()
    finally:
        rm.unwire(model)
        rm.teardown()
    per_rank = profiling.gather_profiles(mem)            # over the world: every rank of the pool
    comm_ranks = comms.gather(ctx.mesh(P)["cp"].get_group())
    return {
        "rank": dist.get_rank(), "cp_rank": runtime.cp_rank,
        "by_layer_kind": comms.by_layer_kind(), "by_kind": comms.by_kind(),
        "attention_layers": len(runtime.report.attention), "recurrent_layers": len(runtime.report.recurrent),
        "a2a": {p: comms.total_bytes("all_to_all", p, layer_kind="attention") for p in ("forward", "backward")},
        "total": comms.total_bytes(),
        "mem_ranks": [m.rank for m in per_rank], "comm_ranks": [c.rank for c in comm_ranks],
        "saved": mem.peak_saved_bytes, "ref_saved": ref_mem.peak_saved_bytes, "rss_scope": mem.rss_scope,
        "rss_delta": mem.peak_rss_delta_bytes, "table": profiling.memory_table(per_rank),
        "config": (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim),
    }


# --------------------------------------------------------------------------------------------
# unit


def test_layer_kind_from_tags():
    assert layer_kind("ulysses_qkv") == "attention"
    assert layer_kind("ulysses_out") == "attention"
    assert layer_kind("ring_kv") == layer_kind("ring_dkv") == "attention"
    assert layer_kind("state_passing") == layer_kind("conv_halo") == "recurrent"
    assert layer_kind("gather_sequence") == layer_kind("") == layer_kind("something_else") == "other"
    assert layer_kind("recurrent:my_scan") == "recurrent" and layer_kind("attention:x") == "attention"
    assert layer_kind("ringside") == "other"                      # a prefix matches at a word boundary
    profiling.register_tag_prefix("bench_probe", "recurrent")
    try:
        assert layer_kind("bench_probe_x") == "recurrent"
    finally:
        profiling.TAG_LAYER_KINDS.pop("bench_probe")
    assert layer_kind("bench_probe_x") == "other"
    with pytest.raises(ValueError):
        profiling.register_tag_prefix("x", "mlp")


def test_summaries_by_kind_phase_and_layer_kind():
    prof = CommProfile(records=[
        CommRecord("all_to_all", "forward", 100, 0.5, "ulysses_qkv"),
        CommRecord("all_to_all", "forward", 50, 0.25, "ulysses_out"),
        CommRecord("all_to_all", "backward", 150, 1.0, "ulysses_qkv"),
        CommRecord("p2p", "forward", 30, 0.1, "ring_kv"),
        CommRecord("all_gather", "forward", 7, 0.01, "state_passing"),
        CommRecord("reduce_scatter", "backward", 7, 0.02, "state_passing"),
        CommRecord("send", "forward", 3, 0.0, "state_passing"),
        CommRecord("all_gather", "forward", 11, 0.0, "gather_sequence"),
    ])
    assert prof.total_bytes() == 358
    assert prof.total_bytes("all_to_all", "forward") == 150                     # the historical signature
    assert prof.total_bytes(layer_kind="attention") == 330
    assert prof.total_bytes(layer_kind="recurrent", phase="forward") == 10
    assert prof.total_seconds("all_to_all") == pytest.approx(1.75)
    assert prof.calls(tag="ulysses_qkv") == 2
    assert prof.summary()[("all_to_all", "forward")] == {"calls": 2, "bytes": 150, "seconds": 0.75}
    kinds = prof.by_kind()
    assert kinds["all_to_all"]["backward"]["bytes"] == 150 and kinds["p2p"]["backward"]["calls"] == 0
    layers = prof.by_layer_kind()
    assert set(layers) == {"attention", "recurrent", "other"}
    assert layers["attention"]["forward"]["bytes"] == 180 and layers["attention"]["backward"]["bytes"] == 150
    assert layers["recurrent"]["backward"]["bytes"] == 7 and layers["other"]["forward"]["bytes"] == 11
    rows = prof.rows()
    assert [r["layer_kind"] for r in rows] == ["attention", "attention", "recurrent", "recurrent", "recurrent",
                                               "other"]
    table = prof.table("comms")
    assert "all-to-all" in table and "reduce-scatter" in table and table.splitlines()[-1].startswith("total")


def test_profile_memory_counts_saved_tensors_and_rss():
    x = torch.randn(1000, requires_grad=True)
    w = torch.randn(1000, requires_grad=True)
    with profile_memory() as mem:
        y = x * w          # saves x and w
        z = y.view(10, 100).exp()   # saves its output (a new 4000-byte storage)
        big = torch.ones(16 * 2**20)   # 64 MiB touched inside the block
        z.sum().backward()
        del big
    assert mem.saved_tensors == 3 and mem.peak_saved_bytes == 3 * 4000
    assert mem.rank is None and mem.peak_bytes == (mem.cuda_peak_bytes or mem.peak_rss_bytes)
    if sys.platform.startswith("linux") and mem.rss_scope == "block":
        assert mem.peak_rss_delta_bytes >= 60 * 2**20, mem
        with profile_memory() as outer:
            torch.ones(16 * 2**20).sum()
            with profile_memory() as inner:       # nested: does not reset the outer high-water mark
                pass
        assert outer.peak_rss_delta_bytes >= 60 * 2**20 and inner.rss_scope == "process"
    assert "saved for bwd" in profiling.memory_table([mem])


def test_track_tensor_memory_counts_live_storages_once():
    """Known sizes: views and in-place ops add nothing, freed storages leave the count, tensors from
    before the block are not counted, backward's temporaries are."""
    before = torch.zeros(1000)  # not counted: made before the block
    with profiling.track_tensor_memory() as t:
        a = torch.ones(1000)                     # 4000 B
        view = a[:10]                            # a view: no new storage
        a.add_(1)                                # in place: no new storage
        b = torch.zeros(500, dtype=torch.bool)   # 500 B
        assert t.live_bytes == 4500 and t.peak_bytes == 4500
        del b
        assert t.live_bytes == 4000
        c = before * 2                           # 4000 B
        assert t.peak_bytes == 8000 and t.live_bytes == 8000
        del a, view, c
        assert t.live_bytes == 0
        x = torch.randn(100, 100).requires_grad_()  # 40000 B
        (x @ x).sum().backward()                    # backward runs under the mode too: mm, its grads
        assert t.live_bytes == 80000                # x and x.grad
    assert t.peak_bytes > 3 * 40000                 # x, x @ x and the two backward products at once
    assert t.largest_bytes == 40000 and "randn" in t.largest_op
    assert t.largest_wide_bytes == t.largest_bytes


def test_track_tensor_memory_skip_aliases():
    """A view or an in-place update of a storage from before the block (a weight's t() in linear, the
    optimizer's param.mul_) is counted as new by default and not with skip_aliases=True."""
    before = torch.zeros(1000)
    for skip, expected in ((False, 4000), (True, 0)):
        with profiling.track_tensor_memory(skip_aliases=skip) as t:
            view = before.t()
            before.mul_(2)
        assert t.peak_bytes == expected, (skip, t.peak_bytes)
        del view
    with profiling.track_tensor_memory(skip_aliases=True) as t:
        c = before * 2                           # a new storage still counts
    assert t.peak_bytes == 4000 and c.numel() == 1000


def test_count_collectives_outside_distributed_is_harmless():
    with count_collectives() as seen:
        torch.ones(3).sum()
    assert seen.records == [] and seen.total_bytes() == 0


# --------------------------------------------------------------------------------------------
# on the gloo pool

S, H, HKV, D = 256, 8, 4, 16


@pytest.mark.parametrize("P", [2, 4])
def test_attention_bytes_per_kind_and_phase(pool, P):
    results = pool.run(attention_bytes_job, P, S, H, HKV, D)
    n = S // P
    kv = 2 * HKV * n * D * F32                                  # |KV_local| (fp32 here)
    a2a = (2 * H + 2 * HKV) * D * n * F32 * (P - 1) // P        # Ulysses, per direction, one layer
    for res in results:
        assert res["kv_local"] == kv
        uly, p2p, ag = res["ulysses"], res["ring_alltoall"], res["ring_allgather"]
        # Ulysses: the all-to-all volume formula, forward and backward, all of it attention
        assert uly["by_kind"]["all_to_all"]["forward"]["bytes"] == pytest.approx(a2a, rel=0.01)
        assert uly["by_kind"]["all_to_all"]["backward"]["bytes"] == pytest.approx(a2a, rel=0.01)
        assert uly["by_kind"]["all_to_all"]["forward"]["calls"] == 2          # fused q/k/v + output
        assert uly["attention"] == uly["total"] == 2 * a2a
        # Ring p2p: (P-1)*|KV_local| forward; the blocks again plus P-1 hops of fp32 dK/dV backward (the
        # owner's own share never leaves it)
        assert p2p["by_kind"]["p2p"]["forward"]["bytes"] == pytest.approx((P - 1) * kv, rel=0.01)
        assert p2p["by_kind"]["p2p"]["backward"]["bytes"] == pytest.approx(2 * (P - 1) * kv, rel=0.01)
        assert p2p["by_layer_kind"]["attention"]["forward"]["bytes"] == (P - 1) * kv
        # Ring allgather: one all-gather forward, one reduce-scatter of fp32 dK/dV backward
        assert ag["by_kind"]["all_gather"]["forward"]["bytes"] == (P - 1) * kv
        assert ag["by_kind"]["reduce_scatter"]["backward"]["bytes"] == (P - 1) * kv
        assert set(ag["by_kind"]) == {"all_gather", "reduce_scatter"}
        for r in (uly, p2p, ag):
            assert r["seconds"] > 0 and set(r["by_layer_kind"]) == {"attention"}
            assert "attention" in r["table"]
        # the independent count at the c10d op level agrees with every record
        assert uly["seen"] == {("all_to_all", "forward"): a2a, ("all_to_all", "backward"): a2a}
        assert p2p["seen"] == {("send", "forward"): (P - 1) * kv, ("send", "backward"): 2 * (P - 1) * kv}
        # gloo has no reduce-scatter: ringmaster's fallback is an all-to-all of the slices, (P-1)/P of the
        # gathered dK/dV, what the record says (an all-reduce, the former fallback, sent twice that)
        assert ag["seen"] == {("all_gather", "forward"): (P - 1) * kv, ("all_to_all", "backward"): (P - 1) * kv}
        for r in (uly, p2p, ag):
            assert sum(r["seen"].values()) == r["total"]


@pytest.mark.parametrize("P", [2, 4])
def test_hybrid_model_comms_by_layer_kind_and_memory_per_rank(pool, P):
    results = pool.run(hybrid_profile_job, P, 64)
    heads, kv_heads, head_dim = results[0]["config"]
    kv_eff = kv_heads if kv_heads % P == 0 else P                # replicated KV heads when fewer than P
    a2a = (2 * heads + 2 * kv_eff) * head_dim * (64 // P) * F32 * (P - 1) // P
    for res in results:
        assert res["attention_layers"] == 1 and res["recurrent_layers"] == 2
        layers = res["by_layer_kind"]
        assert set(layers) == {"attention", "recurrent"}
        # Ulysses bytes per rank per attention layer: the all-to-all volume formula
        assert res["a2a"]["forward"] == pytest.approx(a2a * res["attention_layers"], rel=0.01)
        assert res["a2a"]["backward"] == pytest.approx(a2a * res["attention_layers"], rel=0.01)
        assert layers["attention"]["forward"]["bytes"] == res["a2a"]["forward"]
        # recurrent state passing and conv halos move bytes both ways (first rank may only send)
        assert layers["recurrent"]["forward"]["calls"] > 0 and layers["recurrent"]["backward"]["calls"] > 0
        assert layers["recurrent"]["forward"]["bytes"] + layers["recurrent"]["backward"]["bytes"] > 0
        assert res["total"] == sum(st["bytes"] for lk in layers.values() for st in lk.values())
        # memory per rank: every rank's profile, and CP saves less for backward than the full sequence
        assert res["mem_ranks"] == [0, 1, 2, 3]
        assert res["comm_ranks"] == sorted(res["comm_ranks"]) and len(res["comm_ranks"]) == P
        assert 0 < res["saved"] < res["ref_saved"]
        assert len(res["table"].splitlines()) == 2 + 4
    # conv halos all-gather (reduce-scatter back); the scan state travels by send/recv at P=2
    # ("sequential", auto for P <= 2) and in the same all-gather of maps at P=4 ("scan")
    recurrent_kinds = set().union(*(r["by_kind"] for r in results)) - {"all_to_all"}
    assert {"all_gather", "reduce_scatter"} <= recurrent_kinds, recurrent_kinds
    assert ({"send", "recv"} <= recurrent_kinds) == (P == 2), recurrent_kinds
