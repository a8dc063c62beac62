"""Hybrid models with their attention layers under Ring (head_tail at model level) and USP:
the recurrent layers compose their 2P chunk maps in sequence order."""

import jobs_recurrent as jr
import pytest
from test_hybrid_parity import MODELS, PARAM_TOL, STRATEGIES, TOL, TOTAL_TOL


def _check(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P
        assert r["recurrent_layers"] >= 1 and r["attention_layers"] >= 1, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"]
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
        assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > PARAM_TOL}
        assert not worst, (rank, worst)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("model_type", MODELS)
def test_hybrid_under_ring_head_tail(pool, model_type, P, strategy):
    results = pool.run(jr.hybrid_parity, model_type, P, strategy, "ring")
    assert {r["layout"] for r in results} == {"head_tail"}
    _check(results, P)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_hybrid_under_usp(pool, model_type):
    _check(pool.run(_usp_job, model_type), 4)


def _usp_job(ctx, model_type):
    import ringmaster as rm
    from jobs_recurrent import slow_decay
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=4, backend="usp", ulysses_size=2, ring_size=2, recurrent="scan")
    return compare(model_type, cfg, seq_len=96, device_mesh=ctx.mesh(4), prepare=slow_decay)
