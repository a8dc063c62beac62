"""load_balance='distflash': contiguous shards, causal work balanced by DistFlashAttn's schedule.

The schedule itself (no ranks): every causal block pair and every query row computed exactly
once, one task per rank per step, and the work figure (max/mean <= 1.05 at P=4 and P=8, where
contiguous is 1.75 / 1.875). Pool: the attention function against dense attention (GQA, packed
documents, sinks, forward and backward), then whole models against the same model without CP
(loss, gathered logits, every parameter's gradient against its own norm): llama on plain,
packed and padded rows, hybrids (Qwen3.5, Nemotron-H) whose recurrent layers need the
contiguous layout, mutations that the model-level check must catch, and the refusals.
"""

import importlib.util

import jobs_distflash as jd
import pytest
from test_hybrid_parity import FP64_SEQ, check_fp64
from test_hybrid_ring import _check as check_hybrid
from test_ulysses_parity import TOL

from ringmaster.sharding import balancers

DETECT = 1e-2
GQA = dict(num_attention_heads=8, num_key_value_heads=2)
PACKED = {"spans-three-shards": [5, 67, 10, 14], "edge-aligned": [10, 38, 30, 18]}  # S=96 (as test_packing)


# -- the schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 6, 8, 16])
def test_schedule_covers_every_causal_row_exactly_once(P):
    c = 6
    seen = {}
    steps = balancers.distflash_schedule(P)
    assert len(steps) == 1 + P // 2
    for step in steps:
        assert len(step) == P, "every rank has exactly one task per step"
        for task in step:
            assert task.kv <= task.q, task
            a, b = task.rows(c)
            for row in range(a, b):
                key = (task.q, row, task.kv)
                assert key not in seen, f"{key} computed twice"
                seen[key] = True
    expected = {(i, row, j) for i in range(P) for j in range(i + 1) for row in range(c)}
    assert set(seen) == expected


@pytest.mark.parametrize("P", [4, 8])
@pytest.mark.parametrize("diagonal", ["half", "full"])
def test_work_figure_distflash_is_balanced(P, diagonal):
    work = balancers.schedule_work(P, "distflash", diagonal)
    assert work.max_over_mean <= 1.05, work
    assert work.max_over_mean == pytest.approx(1.0), work
    assert sum(work.per_rank) == pytest.approx(P * (P - 1) / 2 + P * (0.5 if diagonal == "half" else 1.0))
    assert balancers.work_figure(4096, P, "distflash") <= 1.05  # token level, diagonal triangles counted


def test_work_figure_other_layouts():
    assert balancers.schedule_work(4, "contiguous").max_over_mean == pytest.approx(1.75)
    assert balancers.schedule_work(8, "contiguous").max_over_mean == pytest.approx(1.875)
    assert balancers.schedule_work(4, "none", "full").max_over_mean == pytest.approx(1.6)
    for P in (4, 8):
        assert balancers.schedule_work(P, "head_tail").max_over_mean == pytest.approx(1.0)
        # every layout computes the same total: the causal triangle
        totals = {lb: sum(balancers.schedule_work(P, lb).per_rank) for lb in balancers.SCHEDULES}
        assert max(totals.values()) == pytest.approx(min(totals.values())), totals
    assert balancers.work_figure(4096, 4, "contiguous") > 1.7


def test_per_call_guard():
    """For runtimes set up without rm.wire: the attention call refuses what the schedule cannot run,
    before any collective; a window no shorter than the sequence masks nothing and runs."""
    from ringmaster.attention.ring.distflash import check_call

    with pytest.raises(NotImplementedError, match="causal attention only.*load_balance='none'"):
        check_call(False, None, 64)
    with pytest.raises(NotImplementedError, match="sliding_window=16 < sequence length 64.*load_balance='none'"):
        check_call(True, 16, 64)
    check_call(True, 64, 64)
    check_call(True, None, 64)


def test_schedule_plans_blocks_without_dense_masks():
    """Every task's mask is structured (views of the document ids), and planning a step builds
    nothing block-sized: the kernels mask tile by tile."""
    import torch
    from test_ring_kernels import _Largest

    from ringmaster.attention.ring.distflash import DistFlashPlan, active_tasks, task_mask
    from ringmaster.attention.ring.masks import BlockMask
    from ringmaster.sharding.documents import Runs

    S, P = 2048, 4
    c = S // P
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([700, 500, 848]))[None]
    for rank in range(P):
        plan = DistFlashPlan(P, rank, c, docs, runs=Runs.from_doc_ids(docs))
        with _Largest() as seen:
            active = active_tasks(plan)
            masks = [task_mask(plan, step[rank]) for s, step in enumerate(plan.steps()) if active[s][rank]]
        assert masks and all(isinstance(m, BlockMask) and m.dense is None for m in masks)
        assert seen.largest < c * c // 4, seen.largest


def test_distflash_cuts_batches_contiguously():
    assert balancers.check_layout("distflash") == "contiguous"
    assert balancers.chunks_per_rank("distflash") == 1


# -- the attention function -------------------------------------------------------------------

FUNCTION_CASES = [
    ("causal", {}),
    ("packed", dict(doc_lens=[5, 20, 23])),      # 24-token shards at P=2: doc 2 never meets chunk 0
    ("packed-edges", dict(doc_lens=[12, 12, 24], impl="math")),
    ("sinks", dict(sinks=True, impl="math")),
    ("odd-rows", dict(S=36)),                    # 9 tokens a rank at P=4: the P/2 halves are 4 and 5 rows
    ("hub", dict(impl="hf_kernels")),            # the CPU flash stand-in through the hub provider
    ("hub-packed", dict(impl="hf_kernels", doc_lens=[5, 20, 23])),
]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_attention_matches_dense(pool, case, P):
    kwargs = dict(case[1])
    if kwargs.get("S") and kwargs["S"] % P:
        pytest.skip("S not divisible")
    for rank, r in enumerate(pool.run(jd.attention_parity, P, **kwargs)):
        assert max(r["errs"].values()) <= 1e-5, (rank, r["errs"])
        assert all(t.startswith("ring_distflash") for t in r["tags"]), r["tags"]
        # blocks whose rows share no document are skipped (by their computer and their owners alike)
        assert (r["active"] < r["tasks"]) == ("doc_lens" in kwargs), r


def test_saved_activations_shrink_with_P(pool):
    """Exactly this rank's q, k, v, output and LSE are kept for backward (no foreign block): O(S/P)."""
    saved = {P: pool.run(jd.saved_bytes, P)[0] for P in (2, 4)}
    for r in saved.values():
        assert r["saved"] == r["own"], saved
    assert saved[4]["saved"] * 2 == saved[2]["saved"], saved


# -- whole models -----------------------------------------------------------------------------


def _ran_distflash(results):
    """The schedule's p2p messages ran (a rank whose documents never leave its span may send none),
    and the plain ring loop's never did."""
    assert sum(r["distflash_msgs"] for r in results) > 0, [r["tags"] for r in results]
    assert all(r["ring_loop_msgs"] == 0 for r in results), [r["tags"] for r in results]


def _check(results, P, layout="contiguous"):
    _ran_distflash(results)
    for rank, r in enumerate(results):
        assert r.get("layout", layout) == layout, r
        assert not r["missing_grads"], r["missing_grads"]
        assert r["loss_err"] <= TOL, (rank, r)
        assert r["logits_err"] <= TOL, (rank, r)
        assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"])


@pytest.mark.parametrize("P, ring_impl, via", [(2, "auto", "region"), (2, "math", "region"), (4, "auto", "region"),
                                               (4, "auto", "hooks")])
def test_llama_matches_single_device(pool, P, ring_impl, via):
    """``via="hooks"``: the trainers' path (ContextParallelContextManager cuts with the runtime's layout)."""
    results = pool.run(jd.llama_parity, P, ring_impl, via=via)
    for r in results:
        assert r["cp_size"] == P and r["backend"] == "ring" and r["n_grads"] == r["n_params"]
    _check(results, P)


@pytest.mark.parametrize("P, case", [(2, "causal"), (4, "causal"), (2, "packed"), (4, "packed")])
def test_flash_model_through_the_hub_kernel(pool, P, case):
    """flash_attention_2 models pick ring_impl='hf_kernels' (the CPU stand-in in CI): exact under the
    schedule, documents through the kernel's varlen path."""
    results = pool.run(jd.hub_kernel, P, case)
    for r in results:
        assert r["backend"] == "ring" and r["n_grads"] == r["n_params"], r
        assert r["hub_calls"]["forward"] > 0 and r["hub_calls"]["backward"] > 0, r["hub_calls"]
    _check(results, P)


@pytest.mark.parametrize("P, layout", [(2, "spans-three-shards"), (4, "spans-three-shards"), (4, "edge-aligned")])
def test_llama_packed_row_matches_documents_alone(pool, P, layout):
    _check(pool.run(jd.llama_packed, P, PACKED[layout]), P)


def test_llama_padded_rows(pool):
    results = pool.run(jd.llama_padded, 4)
    _ran_distflash(results)
    for rank, r in enumerate(results):
        assert not r["nan"], rank
        for key in ("loss_err", "logits_err", "grad_err"):
            assert r[key] <= TOL, (rank, key, r)


@pytest.mark.parametrize("model_type, P", [("qwen3_5_text", 2), ("nemotron_h", 2), ("qwen3_5_text", 4)])
def test_hybrid_matches_single_device(pool, model_type, P):
    results = pool.run(jd.hybrid, model_type, P)
    _ran_distflash(results)
    check_hybrid(results, P)
    assert {r["layout"] for r in results} == {"contiguous"}


@pytest.mark.parametrize("model_type, P, strategy", [("qwen3_5_text", 2, "scan"), ("nemotron_h", 4, "sequential")])
def test_hybrid_fp64_every_parameter(pool, model_type, P, strategy):
    """fp64 end to end (keep_fp64): every parameter, A_log / dt_bias included, at 1e-5."""
    results = pool.run(jd.hybrid, model_type, P, strategy, fp64=True, seq_len=FP64_SEQ)
    _ran_distflash(results)
    check_fp64(results, P)


def test_hybrid_packed_row(pool):
    results = pool.run(jd.hybrid_packed, "qwen3_5_text", 2)
    _ran_distflash(results)
    check_hybrid(results, 2)


# -- mutations --------------------------------------------------------------------------------


@pytest.mark.parametrize("mutation, P", [("drop_lent_blocks", 4), ("half_rows_overlap", 2)])
def test_mutation_is_caught(pool, mutation, P):
    for rank, r in enumerate(pool.run(jd.mutated, mutation, P)):
        clean, bad = r["clean"], r["mutated"]
        assert clean["layout"] == "contiguous" and clean["n_grads"] == clean["n_params"], (rank, clean)
        for key in ("loss_err", "logits_err", "grad_err"):
            assert clean[key] <= TOL, (rank, key, clean)
        assert bad["logits_err"] > DETECT and bad["grad_err"] > DETECT, (rank, bad)
        assert bad["loss_err"] > TOL, (rank, bad)


# -- binding and refusals ---------------------------------------------------------------------


def test_setup_binds_the_schedule_and_cuts_contiguously(pool):
    for r in pool.run(jd.setup_binds_distflash):
        assert r == {"schedule": "distflash", "layouts": ("contiguous",), "shard": "contiguous",
                     "load_balance": "distflash"}, r


def test_refusals_name_the_fix(pool):
    for r in pool.run(jd.refusals):
        assert r["ulysses"] == ("ValueError", r["ulysses"][1]) and "only helps Ring" in r["ulysses"][1], r
        assert "load_balance='none'" in r["ulysses"][1]
        assert r["usp"][0] == "ValueError" and "pure Ring" in r["usp"][1] and "load_balance='none'" in r["usp"][1], r
        for case in ("sliding_window", "mixed_layers"):
            name, message = r[case]
            assert name == "ValueError" and "load_balance='distflash'" in message, (case, r[case])
            assert "sliding" in message and "load_balance='none'" in message, (case, message)


@pytest.mark.skipif(importlib.util.find_spec("axolotl") is None, reason="axolotl 0.21 is not installed")
@pytest.mark.parametrize("reason", ["packed sequences", "recurrent state passing"])
def test_axolotl_settings_resolve_to_the_distflash_schedule(pool, reason):
    """axolotl 0.21's unchanged settings accept distflash where they refuse head_tail, and pass
    rotate_method='allgather' (its default): the runtime still binds the p2p distflash schedule and
    its batches are cut contiguously. (A whole plugin training step with Ring is not run here: the
    plugin also demands flash_attention_2 for p2p schedules and a Ring kernel other than torch_native.)"""
    for r in pool.run(jd.axolotl_settings, reason):
        assert r == {"communication": "p2p", "load_balance": "distflash", "rotate_method": "allgather",
                     "schedule": "distflash", "shard": "contiguous"}, r
