"""trl: CPSFTTrainer against SFTTrainer without CP (3 SGD steps, fp32), eval-loss reduction,
and ringmaster.sharding.loss.chunked_nll."""

import jobs_adapters
import pytest
import torch

TOL = 1e-4


def test_chunked_nll_matches_cross_entropy():
    import torch.nn.functional as F

    from ringmaster.sharding.loss import chunked_nll

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100
    n = labels.ne(-100).sum()
    ref = F.cross_entropy((hidden @ weight.T).reshape(-1, 50), labels.reshape(-1), ignore_index=-100,
                          reduction="sum") / n
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    for chunk in (1, 7, 74, 1000):  # one token, uneven chunks, exactly all, more than all
        loss = chunked_nll(hidden, weight, labels, n, chunk_size=chunk)
        grads = torch.autograd.grad(loss, (hidden, weight))
        assert torch.allclose(loss.double(), ref, rtol=1e-6), chunk
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), chunk
    # a CP shard divides by the global count / P: the CP-group sum of shard losses is the global mean
    half = [chunked_nll(hidden[:, s], weight, labels[:, s], n.float() / 2, chunk_size=8)
            for s in (slice(0, 20), slice(20, 37))]
    assert torch.allclose((half[0] + half[1]).double() / 2, ref, rtol=1e-6)


def test_chunked_nll_never_builds_full_logits():
    """Peak saved activations stay at one chunk of logits, not the whole shard's."""
    import ringmaster as rm
    from ringmaster.sharding.loss import chunked_nll

    hidden = torch.randn(1, 512, 32, requires_grad=True)
    weight = torch.randn(4000, 32, requires_grad=True)
    labels = torch.randint(0, 4000, (1, 512))
    with rm.profile_memory() as mem:
        chunked_nll(hidden, weight, labels, 512, chunk_size=64)
    full_logits = 512 * 4000 * 4
    assert mem.peak_saved_bytes < full_logits / 4, (mem.peak_saved_bytes, full_logits)


pytest.importorskip("trl", reason="trl is not installed (pip install trl)")


@pytest.mark.parametrize("model_type,cp_loss", [
    ("llama", "chunked_nll"),
    ("llama", "trl"),
    ("qwen3_5_text", "chunked_nll"),
], ids=["llama-chunked_nll", "llama-trl-fused-head", "qwen3.5-hybrid"])
def test_cpsfttrainer_three_steps_match(pool, model_type, cp_loss):
    results = pool.run(jobs_adapters.sft_steps, 2, model_type, cp_loss)
    for rank, r in enumerate(results):
        assert len(r["losses"]) == 3 and len(r["ref_losses"]) == 3, r
        assert r["weights_moved"] > 1e-3, "the reference did not train"
        assert r["loss_err"] <= TOL, (rank, r)
        assert r["weight_err"] <= TOL, (rank, r)
        assert r["restored"], r


def test_cpsfttrainer_packing_padding_free(pool):
    """packing (bfd, padding-free): ringmaster keeps the packed documents apart under CP."""
    for rank, r in enumerate(pool.run(jobs_adapters.sft_steps, 2, "llama", "chunked_nll", 3, True)):
        assert r["loss_err"] <= TOL and r["weight_err"] <= TOL, (rank, r)


def test_cpsfttrainer_eval_loss_is_reduced_over_cp(pool):
    for r in pool.run(jobs_adapters.sft_eval_loss, 2):
        assert r["err"] <= TOL, r


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"], ids=["llama", "qwen3.5-hybrid"])
def test_cpsfttrainer_fsdp2_dp_shard_x_cp_three_steps_match(pool, model_type):
    """dp_shard=2 x cp=2 on 4 ranks: accelerate's mesh, FSDP2 over dp_shard_cp, a different batch
    per dp group; 3 steps match one non-CP SFTTrainer accumulating both dp batches per step."""
    results = pool.run(jobs_adapters.sft_steps_fsdp2, model_type)
    for rank, r in enumerate(results):
        assert r["dims"][:2] == ("dp_shard", "cp"), r
        assert r["sharded"] > 0, "FSDP2 did not shard the parameters"
        assert len(r["losses"]) == 3 and len(r["ref_losses"]) == 3, r
        assert r["weights_moved"] > 1e-3, "the reference did not train"
        assert r["loss_err"] <= TOL, (rank, r)
        assert r["weight_err"] <= TOL, (rank, r)
        assert r["restored"], r


def test_data_is_sharded_per_cp_group_where_accelerate_shards_over_every_rank(pool):
    """Where accelerate counts the CP ranks as data-parallel (DeepSpeed on a GPU host; a launch without
    ParallelismConfig(cp_size)) it gives every rank its own batches, which the CP group's ranks must share. CPSFTTrainer
    re-shards accelerate's loader per CP group: at dp 2 x cp 2, the two ranks of a CP group get the same batches, the
    two groups disjoint ones covering the data; accelerate's own ParallelismConfig(cp_size) path is left alone."""
    results = pool.run(jobs_adapters.data_shards_per_cp_group)
    by_group: dict = {}
    for r in results:
        assert r["shards"] == (2, r["dp_rank"]) and r["replicated_pc"] is None, r
        by_group.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_group) == [0, 1] and all(len(g) == 2 for g in by_group.values()), by_group
    for group in by_group.values():
        assert group[0]["before"] != group[1]["before"], group   # what accelerate alone hands a CP group
        assert group[0]["after"] == group[1]["after"], group
    seen = sorted(x for g in by_group.values() for b in g[0]["after"] for x in b)
    assert seen == list(range(16)), seen
