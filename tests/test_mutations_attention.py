"""Mutation tests for the attention CP mechanisms: each mutation (patched inside the pool
workers, undone afterwards; see jobs_mutations_attention.py) must make the model-level parity
check fail, while the same case unmutated passes it in the same job.

Wrong numbers must be far above the parity tolerance (``TOL`` 1e-4): logits and the worst
gradient off by more than ``DETECT`` (1e-2). A mutation that raises is asserted on its
exception type and message, so it cannot pass for an unrelated failure.
"""

import jobs_mutations_attention as jm
import pytest

TOL = 1e-4
DETECT = 1e-2
LLAMA_GQA = dict(num_attention_heads=8, num_key_value_heads=2)


def _run(pool, mutation, model_type, P, overrides, backend="ring", seq_len=64, **cfg_kwargs):
    return pool.run(jm.mutated_parity, mutation, model_type, P, overrides, backend=backend, cfg_kwargs=cfg_kwargs,
                    seq_len=seq_len)


def _assert_clean(results, backend, layout=None):
    for rank, r in enumerate(results):
        clean = r["clean"]
        assert clean["backend"] == backend and clean["attention_layers"] == 2, (rank, clean)
        if layout is not None:
            assert clean["layout"] == layout, (rank, clean)
        assert clean["n_grads"] == clean["n_params"], (rank, clean)
        for key in ("loss_err", "logits_err", "grad_err"):
            assert clean[key] <= TOL, (rank, key, clean)


def _assert_wrong_numbers(results):
    for rank, r in enumerate(results):
        mutated = r["mutated"]
        assert "raised" not in mutated, (rank, mutated)  # a silently wrong number, not a crash
        assert mutated["logits_err"] > DETECT, (rank, mutated)
        assert mutated["grad_err"] > DETECT, (rank, mutated)
        assert mutated["loss_err"] > TOL, (rank, mutated)


@pytest.mark.parametrize("rotate", ["alltoall", "allgather"])
@pytest.mark.parametrize("P", [2, 4])
def test_ring_merge_without_lse_rescaling_is_caught(pool, P, rotate):
    results = _run(pool, "ring_merge_without_lse_weights", "llama", P, LLAMA_GQA, rotate_method=rotate)
    _assert_clean(results, "ring", "head_tail")
    _assert_wrong_numbers(results)


@pytest.mark.parametrize("model_type, P, overrides", [
    ("llama", 4, LLAMA_GQA),                                              # 2 KV heads over 4 ranks
    ("qwen3", 2, dict(num_attention_heads=4, num_key_value_heads=1)),   # 1 KV head over 2 ranks
], ids=["llama-kv2-P4", "qwen3-kv1-P2"])
def test_ulysses_without_kv_replication_is_caught(pool, model_type, P, overrides):
    """Without replication each rank's share of the KV heads is kv_heads // P == 0: the fused
    all-to-all cannot cut the heads and every rank raises (loudly, before any collective)."""
    results = _run(pool, "ulysses_without_kv_replication", model_type, P, overrides, backend="ulysses")
    _assert_clean(results, "ulysses")
    for rank, r in enumerate(results):
        assert "raised" in r["mutated"], (rank, r["mutated"])
        kind, message = r["mutated"]["raised"]
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"shape '[1, {P}, 0," in message and "is invalid for input of size" in message, (rank, message)


@pytest.mark.parametrize("mutation", ["ring_plans_contiguous_layout", "ring_plans_swapped_head_tail_chunks"])
def test_ring_head_tail_plan_mismatch_is_caught(pool, mutation):
    """The batch is cut head_tail; the ring plans its blocks with another layout."""
    results = _run(pool, mutation, "llama", 2, LLAMA_GQA, load_balance="head_tail")
    _assert_clean(results, "ring", "head_tail")
    _assert_wrong_numbers(results)


@pytest.mark.parametrize("mutation", ["tiled_window_keys_start_one_late", "tiled_calls_without_masks"])
def test_ulysses_sdpa_tile_key_ranges_are_checked(pool, mutation):
    """Ulysses over sdpa with a sliding window at S=640: three 256-query tiles per row, each against
    the keys its window reaches (attention/tiled.py). A tile's key range one key short, or a tile
    left to SDPA's top-left is_causal, must break parity."""
    results = _run(pool, mutation, "mistral", 2, dict(sliding_window=48), backend="ulysses", seq_len=640)
    _assert_clean(results, "ulysses")
    if mutation == "tiled_calls_without_masks":
        _assert_wrong_numbers(results)
        return
    # one key missing for one query per tile (2 of 640 positions): the loss, an average over every
    # position, barely moves (~5e-7), but those positions' logits and the gradients are far off
    for rank, r in enumerate(results):
        mutated = r["mutated"]
        assert "raised" not in mutated, (rank, mutated)
        assert mutated["logits_err"] > DETECT and mutated["grad_err"] > DETECT, (rank, mutated)
