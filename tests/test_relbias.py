"""Inkling under CP: the hidden-state-conditioned relative position bias (attention/relbias.py) and the full
layers' log scaling, against the same model without CP, float64 per parameter (bound 1e-6 here: every path is
exact up to rounding), under Ulysses and Ring, dense and packed, contiguous and head_tail; and the mutations of
the mechanism (the Ring's global block offset, the bias's gradient from the block kernel, the global-index log
scaling, the Ulysses bias) make the model-level check fail."""

import jobs_relbias as jr
import pytest

TOL = 1e-6


def check(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["attention_layers"] == 2 and r["recurrent_layers"] >= 8, r
        assert not r["missing_grads"], r["missing_grads"]
        assert any("rel_logits_proj.proj" in k for k in r["grad_errs"]), sorted(r["grad_errs"])
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > TOL}
        assert not worst, (rank, worst)


@pytest.mark.parametrize("backend,P,load_balance,packed", [
    ("ulysses", 2, "auto", False),
    ("ring", 2, "head_tail", True),
    ("ring", 4, "head_tail", False),
])
def test_inkling_parity(pool, backend, P, load_balance, packed):
    check(pool.run(jr.parity, P, backend, load_balance, packed), P)


def test_inkling_mutations_are_caught(pool):
    errs = pool.run(jr.mutated, sorted(jr.MUTATIONS))[0]
    for name, r in errs.items():
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) > 1e-4, (name, r)
