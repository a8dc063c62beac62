"""Ring CP against the same model without CP: loss, gathered logits, every gradient (fp32),
for both rotations, both layouts and every CPU block-kernel provider (math, aten, hf_kernels on the
CPU flash stand-in)."""

import itertools

import jobs
import jobs_ring
import pytest
from test_ulysses_parity import TOL, check

FAMILIES = [
    ("llama-gqa", "llama", "sdpa", dict(num_attention_heads=8, num_key_value_heads=2)),
    ("qwen3-mqa", "qwen3", "sdpa", dict(num_attention_heads=4, num_key_value_heads=1)),
    ("mistral-sliding", "mistral", "sdpa", dict(sliding_window=16)),
    ("gemma3-mixed", "gemma3_text", "sdpa", {}),
    ("gpt-oss-sinks", "gpt_oss", "eager", {}),
]
VARIANTS = list(itertools.product(["alltoall", "allgather"], ["head_tail", "none"], ["math", "aten"]))


def _check_ring(results, P):
    for r in results:
        r["a2a_bytes"] = r["bytes_sent"]  # ring sends p2p/all-gather, not all-to-all
    check(results, P)


# every pair of values of two of the three axes (rotation, layout, block kernel) in four variants (an orthogonal
# array): each mask family meets every rotation x layout, rotation x kernel and layout x kernel combination
PAIRWISE = [("alltoall", "head_tail", "math"), ("alltoall", "none", "aten"), ("allgather", "head_tail", "aten"),
            ("allgather", "none", "math")]
# every family at P=4 (middle ranks that both send and receive), the first one also at P=2. The first family runs
# the full 2 x 2 x 2 grid at both sizes; the others (MQA, sliding window, mixed layers, sinks) the pairwise four: the
# axes are independent code (KV transport, chunk positions, the block kernel), and the aten kernel's every rotation
# x layout with the window and sinks masks at P=4 is test_ring_kernel_provider_matches_single_device's
RING_CASES = [(FAMILIES[0], 2, VARIANTS), (FAMILIES[0], 4, VARIANTS)] + [(f, 4, PAIRWISE) for f in FAMILIES[1:]]


@pytest.mark.parametrize("family, P, grid", RING_CASES, ids=[f"{f[0]}-{P}" for f, P, _ in RING_CASES])
def test_ring_matches_single_device(pool, family, P, grid):
    _, model_type, attn, overrides = family
    variants = [dict(rotate_method=rotate, load_balance=balance, ring_impl=impl) for rotate, balance, impl in grid]
    # one job: the model built and its reference run once for every variant
    per_rank = pool.run(jobs.parity_variants, model_type, P, attn, overrides, backend="ring", variants=variants)
    for i, (rotate, balance, impl) in enumerate(grid):
        try:
            _check_ring([results[i] for results in per_rank], P)
        except AssertionError as exc:
            raise AssertionError(f"rotate={rotate} load_balance={balance} ring_impl={impl}: {exc}") from exc


def test_p2p_alias_and_auto_layout(pool):
    results = pool.run(jobs.parity, "llama", 4, "sdpa", dict(num_attention_heads=8, num_key_value_heads=2),
                       backend="ring", cfg_kwargs=dict(rotate_method="p2p"))
    _check_ring(results, 4)


def test_ring_memory_p2p_is_o_s_over_p_allgather_is_o_s(pool):
    """p2p keeps only this rank's K/V for backward (O(S/P)); allgather keeps the whole gathered K/V (O(S))."""
    seen = {}
    for P in (2, 4):
        for rotate in ("alltoall", "allgather"):
            r = pool.run(jobs.ring_memory, P, rotate)[0]
            assert r["err"] <= 1e-5, r
            seen[(P, rotate)] = r
    for P in (2, 4):
        p2p, ag = seen[(P, "alltoall")], seen[(P, "allgather")]
        assert ag["saved"] - p2p["saved"] == ag["kv_full"], (P, p2p, ag)  # exactly the gathered K/V more
    # p2p: everything saved scales with the shard; halving the shard halves it
    assert seen[(4, "alltoall")]["saved"] * 2 == pytest.approx(seen[(2, "alltoall")]["saved"], rel=0.02)
    # allgather: the gathered K/V does not shrink with P
    assert seen[(4, "allgather")]["saved"] > 0.6 * seen[(2, "allgather")]["saved"]


def test_auto_backend_picks_ring_for_mqa_and_trains_exactly(pool):
    """kv_heads=1 caps Ulysses at 1, so AUTO resolves to pure Ring (head_tail) and stays exact."""
    results = pool.run(jobs.parity, "qwen3", 4, "sdpa", dict(num_attention_heads=4, num_key_value_heads=1),
                       backend="auto")
    assert {(r["backend"], r["layout"]) for r in results} == {("ring", "head_tail")}
    _check_ring(results, 4)


# -- every block-kernel provider at model level --------------------------------------------------

KERNEL_CASES = list(itertools.product(["aten", "hf_kernels"], ["causal", "window", "packed", "sinks"]))


def _check_case(results, P, case):
    if case == "packed":  # against each document run alone (test_packing's check)
        for r in results:
            assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, r
            assert r["grad_err"] <= TOL and not r["missing_grads"], (r["worst_param"], r["grad_err"])
    else:
        _check_ring(results, P)


# every kernel x case at P=4, each kernel's packed row also at P=2; aten x causal at P=4 is
# test_ring_matches_single_device[llama-gqa-4] (the same llama GQA, batch and rotation x layout grid, aten among its
# kernels), so it is not run twice
PROVIDER_CASES = [(k, c, 4) for k, c in KERNEL_CASES if (k, c) != ("aten", "causal")] + \
    [(k, "packed", 2) for k in ("aten", "hf_kernels")]


@pytest.mark.parametrize("kernel, case, P", PROVIDER_CASES, ids=[f"{k}-{c}-{P}" for k, c, P in PROVIDER_CASES])
def test_ring_kernel_provider_matches_single_device(pool, kernel, case, P):
    """aten and the hub flash kernels (the CPU stand-in, picked by AUTO for a flash_attention_2 model)
    x causal / sliding window / packed / sinks (gpt_oss) x both rotations x both layouts."""
    variants = list(itertools.product(["alltoall", "allgather"], ["none", "head_tail"]))
    per_rank = pool.run(jobs_ring.kernel_parity_variants, P, kernel, case, variants)   # one model, one reference
    for i, (rotate, layout) in enumerate(variants):
        try:
            _check_case([results[i] for results in per_rank], P, case)
        except AssertionError as exc:
            raise AssertionError(f"rotate={rotate} load_balance={layout}: {exc}") from exc


@pytest.mark.parametrize("flash_name", ["flash_attention_3", "kernels-community/vllm-flash-attn3", "flash_attention_4"])
def test_ring_fa3_fa4_hub_kernels_match_single_device(pool, flash_name):
    """FA3's and FA4's low-level functions (``_flash_attn_forward``/``_flash_attn_fwd``, their backward) on
    the stand-ins: argument names, returns and LSE conventions differ from FA2's."""
    results = pool.run(jobs_ring.kernel_parity, 2, "hf_kernels", "window", "alltoall", "none", flash_name)
    _check_ring(results, 2)


def test_hub_kernel_ignoring_the_window_is_caught(pool):
    """Mutation: the hub provider drops the window's left bound -> the windowed model is wrong."""
    for rank, r in enumerate(pool.run(jobs_ring.hub_window_mutation, 2)):
        clean, mutated = r["clean"], r["mutated"]
        assert max(clean["loss_err"], clean["logits_err"], clean["grad_err"]) <= TOL, (rank, clean)
        assert "raised" not in mutated, (rank, mutated)
        assert mutated["logits_err"] > 1e-2 and mutated["grad_err"] > 1e-2, (rank, mutated)
