"""rm.token_logprobs (per-token log-probs and entropies under CP, chunked through the LM head, [S]
values gathered in global order) and CPGRPOTrainer (trl's GRPO loss with the policy and the reference
model both wired), each against the same float64 model without CP: values, and every parameter's
CP-group-mean gradient against its own norm. A mutation of the gather (contiguous order for a head_tail
shard, or no gather at all) must fail. Memory: the path's peak grows with the chunk, not S x vocab."""

import jobs_logprobs
import pytest
import torch

import ringmaster as rm

# float64 (keep_fp64). Measured: values <= 7.4e-16; gradients <= 3.6e-15 for attention and Mamba2 parameters,
# 7.4e-11 / 2.3e-10 for qwen3.5's A_log / dt_bias (sums that cancel, as in test_hybrid_parity); mutations: O(1)
TOL = 1e-10
GRAD_TOL = 1e-7


def _check(results):
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            for key in ("lp_err", "ent_err"):
                assert r[key] <= TOL, (rank, case, key, r)
            assert r["grad_err"] <= GRAD_TOL, (rank, case, r)
            assert not r["missing"], (rank, case, r)


def test_token_logprobs_matches_full_logits_single_process():
    """No CP: chunked values, entropies and gradients (hidden, weight, bias) equal the full-logit ones,
    with the model's soft-capping and logit scale, a temperature, ignored labels and uneven chunks."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 9), generator=g)
    labels[0, :3] = -100
    w1, w2 = torch.randn(2, 9, generator=g, dtype=torch.float64), torch.randn(2, 9, generator=g, dtype=torch.float64)
    y = 3.0 * torch.tanh((h @ W.T + b) * 0.7 / 3.0) / 0.9
    logp = torch.log_softmax(y, -1)
    keep = labels != -100
    ref_lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    ref_ent = -(logp.exp() * logp).sum(-1) * keep
    ref_g = torch.autograd.grad((ref_lp * w1).sum() + (ref_ent * w2).sum(), (h, W, b))
    for chunk in (1, 4, 15, 100):
        lp, ent = rm.token_logprobs(h, labels, weight=W, bias=b, logit_scale=0.7, softcap=3.0, temperature=0.9,
                                   chunk_size=chunk, entropy=True)
        grads = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), (h, W, b))
        assert (lp - ref_lp).abs().max() < 1e-13 and (ent - ref_ent).abs().max() < 1e-13, chunk
        for a, r in zip(grads, ref_g):
            assert (a - r).abs().max() / r.abs().max() < 1e-13, chunk
        assert float(lp.detach()[~keep].abs().max()) == 0.0 and float(ent.detach()[~keep].abs().max()) == 0.0


def test_token_logprobs_mixed_precision_under_autocast():
    """bf16 activations with fp32 head weights under autocast (trl's GRPO runs in accelerator.autocast()):
    the head runs in fp32 in the forward and in the recomputing backward, so values and the weight's
    gradient are the fp32 ones of the bf16 hidden states."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 12, 8, generator=g).bfloat16().requires_grad_()
    W = torch.randn(50, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (1, 12), generator=g)
    ref = torch.log_softmax(h.detach().float() @ W.T, -1).gather(-1, labels[..., None]).squeeze(-1)
    (ref_gw,) = torch.autograd.grad(ref.sum(), W)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = rm.token_logprobs(h, labels, weight=W, chunk_size=5)
    lp.sum().backward()
    assert lp.dtype == torch.float32 and h.grad.dtype == torch.bfloat16 and W.grad.dtype == torch.float32
    assert (lp - ref).abs().max() < 1e-5 and (W.grad - ref_gw).abs().max() / ref_gw.abs().max() < 1e-5


def test_token_logprobs_reads_the_models_head_transform():
    """Gemma 2's final-logit soft-capping comes from the model: the values equal the model's own logits'
    log-softmax; the logit scales of Cohere, Falcon-H1 and Granite are read from their config fields."""
    from types import SimpleNamespace

    from ringmaster.sharding.batch import shift_labels
    from ringmaster.sharding.logprobs import head_transform
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model("gemma2", dtype=torch.float64, final_logit_softcapping=2.0, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16).eval()
    batch = tiny_batch(model.config.vocab_size, 16, seed=2)
    labels = shift_labels(batch["labels"])
    out = model(input_ids=batch["input_ids"], output_hidden_states=True)
    ref = torch.log_softmax(out.logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    lp = rm.token_logprobs(out, labels, model=model, chunk_size=5)
    assert (lp - ref * (labels != -100)).abs().max() < 1e-12
    assert head_transform(model.config) == (1.0, 2.0)
    assert head_transform(SimpleNamespace(logit_scale=0.5)) == (0.5, None)             # cohere
    assert head_transform(SimpleNamespace(lm_head_multiplier=3.0)) == (3.0, None)      # falcon_h1
    assert head_transform(SimpleNamespace(logits_scaling=4.0)) == (0.25, None)         # granite divides


def test_token_logprobs_memory_grows_with_the_chunk_not_s_times_vocab():
    """vocab 32k: the peak of tensor bytes the path creates (forward + backward, track_tensor_memory) is the
    same at S=32 and S=128 for one chunk size, grows with the chunk size, and stays far under the
    S x vocab fp32 logits the plain path builds."""
    from ringmaster_tools.profiling import track_tensor_memory

    V, H = 32768, 16
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, H, generator=g, requires_grad=True)
    peaks = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # many small ops: one thread (measured 0.2 s CPU; 2 threads on a busy machine: 100x)
    try:
        for S, chunk in ((32, 2), (128, 2), (128, 8)):
            h = torch.randn(1, S, H, generator=g, requires_grad=True)
            labels = torch.randint(0, V, (1, S), generator=g)
            with track_tensor_memory() as mem:
                lp, ent = rm.token_logprobs(h, labels, weight=W, chunk_size=chunk, entropy=True)
                (lp.sum() + ent.sum()).backward()
            peaks[(S, chunk)] = mem.peak_bytes - 2 * W.numel() * 4   # W's gradient and its fp32 accumulator
            W.grad = None
    finally:
        torch.set_num_threads(threads)
    assert peaks[(128, 2)] < 1.25 * peaks[(32, 2)], peaks        # not with S
    assert peaks[(128, 8)] > 2.5 * peaks[(128, 2)], peaks        # with the chunk
    assert peaks[(128, 8)] < 128 * V * 4 / 2, peaks              # under S x vocab


@pytest.mark.parametrize("P,cases", [
    (2, [("llama", "ulysses"), ("llama", "ring"), ("qwen3_5_text", "ring")]),
    (4, [("llama", "ulysses"), ("nemotron_h", "ring")]),
], ids=["P2-ulysses-ring-qwen3.5", "P4-ulysses-nemotron_h-ring"])
def test_token_logprobs_parity(pool, P, cases):
    results = pool.run(jobs_logprobs.logprob_parity, P, cases)
    _check(results)
    for r in results[0].values():
        assert r["n_grads"] == r["n_params"], r
    for case, r in results[0].items():
        assert r["layout"] == ("head_tail" if case.endswith("/ring") else "contiguous"), (case, r)
        assert (r["recurrent"] > 0) == (not case.startswith("llama")), (case, r)   # the hybrids' layers wired


@pytest.mark.parametrize("mutation", ["order", "local"])
def test_token_logprobs_mutations_fail(pool, mutation):
    """The gather in contiguous order on head_tail shards, or no gather: the values no longer match."""
    results = pool.run(jobs_logprobs.logprob_parity, 2, [("llama", "ring")], mutation=mutation)
    assert all(r["llama/ring"]["lp_err"] > 1e-2 for r in results), results


pytest.importorskip("trl", reason="trl is not installed (pip install trl)")


@pytest.mark.parametrize("P,cases", [
    (2, [("llama", "ulysses"), ("qwen3_5_text", "ring")]),
    (4, [("llama", "ring")]),
], ids=["P2-ulysses-llama-ring-qwen3.5", "P4-ring-llama"])
def test_cpgrpotrainer_loss_and_gradient_match(pool, P, cases):
    results = pool.run(jobs_logprobs.grpo_loss_parity, P, cases)
    for rank, per_case in enumerate(results):
        for case, r in per_case.items():
            assert r["wired_models"] == 2, (rank, case, r)   # policy and reference
            for key in ("loss_err", "ref_lp_err", "old_lp_err", "lp_err", "ent_err"):
                assert r[key] <= TOL, (rank, case, key, r)
            assert r["grad_err"] <= GRAD_TOL, (rank, case, r)
            assert r["trl_head_err"] <= 1e-5, (rank, case, r)   # trl's float32 fused head vs the definition
            assert not r["missing"] and r["restored"], (rank, case, r)
