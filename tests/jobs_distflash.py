"""Jobs for tests/test_distflash.py (run on every rank of the gloo pool)."""

from __future__ import annotations

import torch

import ringmaster as rm


def attention_parity(ctx, P, doc_lens=None, sinks=False, impl="aten", B=2, S=48, H=4, Hkv=2, D=8,
                     dtype=torch.float32):
    """distflash_attention against dense causal attention over the whole sequence (forward, dQ/dK/dV,
    dsinks), on this rank's contiguous span. ``doc_lens``: every row packed with these documents."""
    import torch.distributed as dist

    from ringmaster.attention.ring.distflash import DistFlashPlan, active_tasks, distflash_attention
    from ringmaster.attention.ring.kernels import get_kernel
    from ringmaster.attention.ring.merge import reference_attention
    from ringmaster.config import RingImpl
    from ringmaster.sharding.documents import Runs, doc_ids_from_cu_seqlens
    from ringmaster_tools.parity import rel_err

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, H, S, D, generator=g, dtype=dtype)
    sink = torch.randn(H, generator=g, dtype=dtype) if sinks else None
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    docs = None
    if doc_lens is not None:
        cu = torch.tensor([0] + list(doc_lens)).cumsum(0)
        docs = doc_ids_from_cu_seqlens(cu, S).expand(B, S).contiguous()
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v) + ((sink,) if sinks else ())]
    ref, _ = reference_attention(*leaves[:3], D ** -0.5, mask, sink=leaves[3] if sinks else None)
    (ref * dout).sum().backward()
    c = S // P
    span = slice(r * c, (r + 1) * c)
    local = [t[:, :, span].clone().requires_grad_(True) for t in (q, k, v)]
    sink_cp = sink.clone().requires_grad_(True) if sinks else None
    plan = DistFlashPlan(P, r, c, docs, runs=None if docs is None else Runs.from_doc_ids(docs))
    with rm.profile_comms() as comms:
        kernel = get_kernel(RingImpl(impl), "flash_attention_2" if impl == "hf_kernels" else None)
        out = distflash_attention(*local, group, plan, kernel, sinks=sink_cp)
        (out * dout[:, :, span]).sum().backward()
    errs = {"out": rel_err(out, ref[:, :, span]),
            "dq": rel_err(local[0].grad, leaves[0].grad[:, :, span]),
            "dk": rel_err(local[1].grad, leaves[1].grad[:, :, span]),
            "dv": rel_err(local[2].grad, leaves[2].grad[:, :, span])}
    if sinks:  # every rank holds the gradient of its own rows' share; their sum is the whole
        d = sink_cp.grad.clone()
        dist.all_reduce(d, group=group)
        errs["dsinks"] = rel_err(d, leaves[3].grad)
    active = active_tasks(plan)
    return {"errs": errs, "bytes": comms.total_bytes(), "tags": sorted({rec.tag for rec in comms.records}),
            "tasks": sum(len(row) for row in active), "active": sum(sum(row) for row in active)}


# -- model level ----------------------------------------------------------------------------------


def _with_tags(run):
    """Run ``run()`` (a parity job) under a comm profile; add which p2p schedules it used."""
    with rm.profile_comms() as comms:
        result = run()
    tags = {rec.tag for rec in comms.records}
    result = dict(result)
    result["distflash_msgs"] = sum(1 for rec in comms.records if rec.tag.startswith("ring_distflash"))
    result["ring_loop_msgs"] = sum(1 for rec in comms.records if rec.tag in ("ring_kv", "ring_dkv"))
    result["tags"] = sorted(tags)
    return result


def cfg_kwargs(**extra):
    return dict(load_balance="distflash", **extra)


def llama_parity(ctx, P, ring_impl="auto", seq_len=64, via="region"):
    from jobs import parity

    return _with_tags(lambda: parity(ctx, "llama", P, "sdpa", dict(num_attention_heads=8, num_key_value_heads=2),
                                     backend="ring", seq_len=seq_len, via=via,
                                     cfg_kwargs=cfg_kwargs(ring_impl=ring_impl)))


def saved_bytes(ctx, P, S=256, H=4, Hkv=2, D=16):
    """Bytes autograd keeps for backward in one distflash call (O(S/P): nothing gathered)."""
    import torch.distributed as dist

    from ringmaster.attention.ring.distflash import DistFlashPlan, distflash_attention
    from ringmaster.attention.ring.kernels import get_kernel
    from ringmaster.config import RingImpl

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    c = S // P
    local = [torch.randn(1, h, c, D, generator=g).requires_grad_(True) for h in (H, Hkv, Hkv)]
    with rm.profile_memory() as mem:
        distflash_attention(*local, group, DistFlashPlan(P, r, c), get_kernel(RingImpl.ATEN))
    q, k, v = local
    own = 4 * (q.numel() + k.numel() + v.numel() + q.numel() + q[..., 0].numel())  # q, k, v, out, lse (fp32)
    return {"saved": mem.peak_saved_bytes, "own": own}


def hub_kernel(ctx, P, case):
    """A flash_attention_2 model (the CPU flash stand-in through the hub path) under distflash:
    the block kernel takes the schedule's structured masks (half-row blocks, documents)."""
    from jobs_ring import kernel_parity

    from ringmaster.attention.ring.hub import HfKernelsKernel

    calls = {"forward": 0, "backward": 0}
    originals = {name: getattr(HfKernelsKernel, name) for name in calls}

    def counted(name):
        def method(self, *args, **kwargs):
            calls[name] += 1
            return originals[name](self, *args, **kwargs)
        return method

    try:
        for name in calls:
            setattr(HfKernelsKernel, name, counted(name))
        result = _with_tags(lambda: kernel_parity(ctx, P, "hf_kernels", case, "alltoall", "distflash"))
    finally:
        for name, fn in originals.items():
            setattr(HfKernelsKernel, name, fn)
    result["hub_calls"] = calls
    return result


def llama_packed(ctx, P, doc_lens):
    from jobs import packed_parity

    return _with_tags(lambda: packed_parity(ctx, P, doc_lens, "ring", cfg_kwargs(),
                                            overrides=dict(num_attention_heads=8, num_key_value_heads=2)))


def llama_padded(ctx, P):
    from jobs import padded_parity

    return _with_tags(lambda: padded_parity(ctx, P, "ring", cfg_kwargs()))


def hybrid(ctx, model_type, P, strategy="scan", fp64=False, seq_len=96):
    from jobs_recurrent import slow_decay
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend="ring", recurrent=strategy, **cfg_kwargs())
    return _with_tags(lambda: compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=slow_decay,
                                      fp64=fp64))


def hybrid_packed(ctx, model_type, P, strategy="scan"):
    from jobs_recurrent import packed_hybrid_parity

    return _with_tags(lambda: packed_hybrid_parity(ctx, model_type, P, strategy, "ring", cfg_kwargs()))


# -- mutations ------------------------------------------------------------------------------------


def _drop_lent_blocks():
    """Blocks a rank computes for another rank's queries are dropped (never computed, never sent home),
    consistently on every rank. Target: ``active_tasks`` as read by ``DistFlashAttention``."""
    from ringmaster.attention.ring import distflash

    original = distflash.active_tasks

    def active_tasks(plan):
        return [[a and step[r].q == r for r, a in enumerate(row)]
                for row, step in zip(original(plan), plan.steps())]

    return [(distflash, "active_tasks", active_tasks)]


def _half_rows_overlap():
    """The P/2 step's split goes wrong: the K/V holder computes the *first* half of the rows too, so
    those rows get the block twice and the second half never. Target: the ``balancers`` global of the
    distflash module (the shard cut, which reads the real module, is untouched)."""
    import types

    from ringmaster.attention.ring import distflash
    from ringmaster.sharding import balancers

    def distflash_schedule(size):
        return tuple(tuple(balancers.Task(t.q, t.kv, balancers.HEAD) if t.part == balancers.TAIL else t
                           for t in step) for step in balancers.distflash_schedule(size))

    proxy = types.SimpleNamespace(**{k: getattr(balancers, k) for k in dir(balancers) if not k.startswith("__")})
    proxy.distflash_schedule = distflash_schedule
    return [(distflash, "balancers", proxy)]


MUTATIONS = {"drop_lent_blocks": _drop_lent_blocks, "half_rows_overlap": _half_rows_overlap}
_KEYS = ("loss_err", "logits_err", "grad_err", "worst_param", "n_grads", "n_params", "layout", "backend")


def mutated(ctx, mutation, P):
    """``{"clean": errors, "mutated": errors}`` for the llama parity case, unmutated then mutated."""
    clean = llama_parity(ctx, P)
    patches = MUTATIONS[mutation]()
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]
    try:
        for mod, attr, value in patches:
            setattr(mod, attr, value)
        bad = llama_parity(ctx, P)
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)
        rm.teardown()
    return {"clean": {k: clean[k] for k in _KEYS}, "mutated": {k: bad[k] for k in _KEYS}}


# -- refusals -------------------------------------------------------------------------------------


def refusals(ctx):
    """Every distflash combination ringmaster cannot run exactly: (type, message) per case."""
    ctx.mesh(2, all_groups=True)   # CP sizes 2 and 4 in one job: every rank stays
    from jobs import error_of
    from ringmaster_tools.parity import tiny_model

    cases = {
        "ulysses": lambda: rm.setup(rm.RingmasterConfig(size=2, backend="ulysses", load_balance="distflash"),
                                    num_kv_heads=4, device_mesh=ctx.mesh(2)),
        "usp": lambda: rm.setup(rm.RingmasterConfig(size=4, backend="usp", ulysses_size=2, ring_size=2,
                                                    load_balance="distflash"), num_kv_heads=4, device_mesh=ctx.mesh(4)),
        "sliding_window": lambda: rm.wire(tiny_model("mistral", sliding_window=16),
                                          rm.RingmasterConfig(size=2, backend="ring", load_balance="distflash"),
                                          device_mesh=ctx.mesh(2)),
        "mixed_layers": lambda: rm.wire(tiny_model("gemma3_text"),
                                        rm.RingmasterConfig(size=2, backend="ring", load_balance="distflash"),
                                        device_mesh=ctx.mesh(2)),
    }
    return {name: error_of(fn) for name, fn in cases.items()}


def setup_binds_distflash(ctx):
    """What setup binds for pure Ring + distflash: the schedule, and batches cut contiguously."""
    rt = rm.setup(rm.RingmasterConfig(size=2, backend="ring", load_balance="distflash", rotate_method="allgather"),
                  num_kv_heads=4, device_mesh=ctx.mesh(2))
    try:
        return {"schedule": rt.binding.schedule, "layouts": rt.binding.layouts(), "shard": rt.shard_load_balance,
                "load_balance": rt.config.load_balance.value}
    finally:
        rm.teardown()


def axolotl_settings(ctx, contiguous_reason):
    """axolotl 0.21's own settings resolution for ``load_balance: distflash`` (packed rows or recurrent
    layers: where it refuses head_tail), then rm.setup as its plugin calls it: the runtime binds the
    distflash schedule and cuts contiguously (what the plugin's collator and manager shard with)."""
    from axolotl.integrations.context_parallel.args import ContextParallelConfig
    from axolotl.integrations.context_parallel.settings import resolve_settings

    cp = ContextParallelConfig(size=2, backend="ring", load_balance="distflash", ring_impl="torch_native")
    rm_cfg = rm.RingmasterConfig(size=cp.size, backend=rm.Backend(cp.backend), ulysses_size=rm.AUTO,
                                 ring_size=rm.AUTO, rotate_method=rm.RotateMethod(cp.rotate_method),
                                 load_balance=rm.LoadBalance.NONE, ring_impl=rm.RingImpl(cp.ring_impl))
    rm_cfg.normalize(num_kv_heads=2, intra_node_size=2)
    communication = resolve_settings(cp, rm_cfg, num_kv_heads=2, contiguous_reason=contiguous_reason,
                                     inner_attn="flash_attention_2")
    rt = rm.setup(rm_cfg, num_kv_heads=2, device_mesh=ctx.mesh(2), cp_dim="cp", inner_attn="sdpa")
    try:
        return {"communication": communication, "load_balance": rm_cfg.load_balance.value,
                "rotate_method": rm_cfg.rotate_method.value, "schedule": rt.binding.schedule,
                "shard": rt.shard_load_balance}
    finally:
        rm.teardown()
