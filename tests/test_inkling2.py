"""Inkling2 / Inkling2-loop under CP against the same model without CP, float64 per parameter (bound 1e-6: every
path is exact up to rounding): per-token attention sinks carried with the queries (attention/token_sinks.py),
the attention residuals over layer depth run locally (attention/local.py), the full layers' dynamic short conv
with the conv halo (recurrent/dynamic_conv.py); and a mutation of each mechanism makes the model-level check
fail."""

import jobs_inkling2 as ji
import pytest

TOL = 1e-6


def check(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["attention_layers"] == 2, r
        assert not r["missing_grads"], r["missing_grads"]
        for part in ("sink_proj", "static_weight", "weight_proj", "attention_input.query"):
            assert any(part in k for k in r["grad_errs"]), (part, sorted(r["grad_errs"]))
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > TOL}
        assert not worst, (rank, worst)


@pytest.mark.parametrize("model_type,backend,P,load_balance,packed", [
    ("inkling2_text", "ulysses", 2, "auto", True),
    ("inkling2_text", "ring", 2, "head_tail", True),
    ("inkling2_loop_text", "ring", 4, "head_tail", False),
])
def test_inkling2_parity(pool, model_type, backend, P, load_balance, packed):
    check(pool.run(ji.parity, P, backend, load_balance, packed, model_type), P)


def test_inkling2_mutations_are_caught(pool):
    errs = pool.run(ji.mutated, sorted(ji.MUTATIONS))[0]
    for name, r in errs.items():
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) > 1e-4, (name, r)


def test_per_token_sink_merge_and_gradient():
    """The ring's per-token sink (``merge_sink`` / ``sink_grad``) against the model's eager formula (the sink as
    one extra zero-value column of each row's softmax) and its autograd gradient, float64."""
    import torch

    from ringmaster.attention.ring.merge import merge_sink, reference_attention, sink_grad

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    scores = torch.matmul(q, k.transpose(-1, -2)) * 0.5
    probs = torch.softmax(torch.cat([scores, sinks[..., None]], dim=-1), dim=-1)[..., :-1]
    want = torch.matmul(probs, v)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (want_grad,) = torch.autograd.grad(want, sinks, dout)
    out, lse = reference_attention(q, k, v, 0.5)
    got, total = merge_sink(out, lse, sinks.detach())
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.allclose(sink_grad(sinks.detach(), total, dout, got), want_grad, atol=1e-12)
