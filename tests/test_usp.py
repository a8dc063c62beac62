"""USP (Ulysses inside a group of contiguous ranks x Ring across them) against the non-CP model."""

import itertools

import jobs
import jobs_ring
import pytest
from test_ring_parity import _check_ring

SPLITS = [(2, 2), (1, 4), (4, 1)]
FAMILIES = [
    ("llama-gqa", "llama", "sdpa", dict(num_attention_heads=8, num_key_value_heads=2)),
    ("gemma3-mixed", "gemma3_text", "sdpa", {}),
    ("gpt-oss-sinks", "gpt_oss", "eager", {}),
    ("qwen3-mqa", "qwen3", "sdpa", dict(num_attention_heads=4, num_key_value_heads=1)),
]


@pytest.mark.parametrize("split", SPLITS, ids=[f"u{u}xr{r}" for u, r in SPLITS])
@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_usp_matches_single_device(pool, family, split):
    _, model_type, attn, overrides = family
    u, r = split
    impls = ("math", "aten")
    # one job: the model built and its reference run once for both block kernels
    per_rank = pool.run(jobs.parity_variants, model_type, 4, attn, overrides, backend="usp",
                        variants=[dict(ulysses_size=u, ring_size=r, ring_impl=impl) for impl in impls])
    for i, impl in enumerate(impls):
        results = [rank_results[i] for rank_results in per_rank]
        assert {x["backend"] for x in results} == {"usp"}, impl
        _check_ring(results, 4)


@pytest.mark.parametrize("kernel, case", list(itertools.product(["aten", "hf_kernels"], ["window", "packed"])))
def test_usp_ring_kernel_providers(pool, kernel, case):
    """USP 2x2 with each fused provider (hf_kernels: the CPU flash stand-in, picked by AUTO) on sliding-window
    and packed rows, both rotations."""
    rotations = ("alltoall", "allgather")
    per_rank = pool.run(jobs_ring.kernel_parity_variants, 4, kernel, case, [(rotate, "none") for rotate in rotations],
                        backend="usp", ulysses_size=2, ring_size=2)   # one model, one reference
    for i, rotate in enumerate(rotations):
        results = [rank_results[i] for rank_results in per_rank]
        assert {x["backend"] for x in results} == {"usp"}
        for r in results:
            assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= 1e-4 and not r["missing_grads"], (rotate, r)
