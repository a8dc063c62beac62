"""`ringmaster plan`: the closed-form bytes equal what rm.profile_comms measures on gloo."""

import jobs
import pytest

from ringmaster.cli import main
from ringmaster.planning import alternative

HEADS, KV, HIDDEN, SEQ, LAYERS = 8, 2, 64, 64, 2
OVERRIDES = dict(num_attention_heads=HEADS, num_key_value_heads=KV, hidden_size=HIDDEN, num_hidden_layers=LAYERS)
CASES = [
    ("ulysses", dict(backend="ulysses"), (4, 1, "alltoall")),
    ("ring-p2p", dict(backend="ring", rotate_method="alltoall"), (1, 4, "alltoall")),
    ("ring-allgather", dict(backend="ring", rotate_method="allgather"), (1, 4, "allgather")),
    ("usp-2x2", dict(backend="usp", ulysses_size=2, ring_size=2), (2, 2, "alltoall")),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_match_measured(pool, case):
    _, cfg_kwargs, (u, r, rotate) = case
    backend = cfg_kwargs.pop("backend")
    results = pool.run(jobs.parity, "llama", 4, "sdpa", OVERRIDES, backend=backend, seq_len=SEQ,
                       cfg_kwargs=cfg_kwargs)
    predicted = alternative(HEADS, KV, HIDDEN // HEADS, SEQ, u, r, rotate, batch=1, dtype_bytes=4)
    for res in results:
        assert res["grad_err"] <= 1e-4
        assert res["bytes_fwd"] / LAYERS == pytest.approx(predicted.fwd_bytes, rel=0.01), res
        assert res["bytes_bwd"] / LAYERS == pytest.approx(predicted.bwd_bytes, rel=0.01), res


def test_plan_cli_prints_the_choice(capsys):
    assert main(["plan", "--heads", "32", "--kv-heads", "8", "--world", "16", "--ranks-per-node", "8",
                 "--seq", "131072", "--hidden", "4096", "--layers", "32"]) == 0
    out = capsys.readouterr().out
    assert "auto_select -> ulysses_size=8 x ring_size=2" in out
    for name in ("ulysses", "ring p2p", "ring allgather", "usp 4x4"):
        assert name in out


def test_plan_marks_invalid_splits():
    alt = alternative(12, 6, 64, 4096, 4, 1)
    assert not alt.valid and "6 KV heads cannot split over 4" in alt.why
