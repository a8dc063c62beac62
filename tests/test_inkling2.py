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
