"""One wire format per passed tensor: the recurrent state a sequential pass sends has the shape and dtype both
ends derive from the segment's ``state_meta()`` (``ringmaster.recurrent.scan.wire_format``); the sender casts to
it, the receiver allocates it, and a state that cannot take it raises naming the layer before any collective.

The real case: an fp64 model whose recurrent kernel computes its state in float32 inside (transformers'
pure-torch Mamba2 and gated-delta kernels, without ``keep_fp64``). Before, the receiver allocated float64 while
the sender sent float32 and gloo aborted the process ("Received data size doesn't match expected size").
"""

import jobs_wire_format as jw
import pytest
import torch
from test_hybrid_parity import FP64_PARAM_TOL, FP64_TOL, PARAM_TOL, TOL

from ringmaster.errors import WireFormatError
from ringmaster.recurrent.scan import WireFormat, check_wire, to_wire
from ringmaster_tools.pool import RankError

NEEDED = ("A_log", "dt_bias", "conv1d.weight")


def _check(results, P, param_tol, tol):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], r["missing_grads"]
        for needed in NEEDED:
            assert any(needed in k for k in r["grad_errs"]), (needed, sorted(r["grad_errs"]))
        assert r["loss_err"] <= tol and r["logits_err"] <= tol, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > param_tol}
        assert not worst, (rank, worst)


def test_fp64_mamba2_hybrid_with_float32_kernel_state_matches_single_device(pool):
    """Nemotron-H (Mamba2 mixers) in float64, sequential at P=2: the kernel's float32 final state goes out as
    the float64 wire format; every parameter within the fp64 bound of tests/test_hybrid_parity.py."""
    _check(pool.run(jw.fp64_parity, "nemotron_h", 2, "sequential"), 2, FP64_PARAM_TOL, FP64_TOL)


def test_fp64_gated_delta_hybrid_with_float32_kernel_state_matches_single_device(pool):
    """Qwen3.5 (gated DeltaNet) in float64, sequential at P=2: crashed the same way. Its kernel computes in
    float32 inside (reference too), so the bounds are the fp32 ones of tests/test_hybrid_parity.py."""
    _check(pool.run(jw.fp64_parity, "qwen3_5_text", 2, "sequential"), 2, PARAM_TOL, TOL)


def test_mutation_sender_skips_the_cast_fails_at_wire_on_every_rank(pool):
    """Mutation: the sender sends the kernel's float32 state as it is. wire's probe checks the state the pass
    would send, so every rank raises at wire time, naming the layer and the fix (no collective issued)."""
    for rank, got in enumerate(pool.run(jw.sender_skips_cast_at_wire)):
        assert got is not None, f"rank {rank}: wiring with a sender that skips the cast did not raise"
        name, message = got
        assert name == "WireFormatError", (name, message)
        assert "model.layers.0.mixer" in message and "would send is float32" in message, message
        assert "wire format both ranks agreed on" in message and "float64" in message, message
        assert "to_wire" in message, message


def test_mutation_sender_skips_the_cast_fails_before_the_send():
    """The same mutation after wire (its probe passed): the sending rank's last check before ``dist.send``
    raises a clear error (its peer, left waiting in ``recv``, is stopped by the pool), not a gloo abort.

    On a pool of its own (two ranks): stopping the peer shuts that pool down, and restarting the session's four
    workers would cost more than starting two; the peer is known to be stuck, so the wait for it is short."""
    from ringmaster_tools.pool import LocalPool

    pool = LocalPool(2, timeout=120, grace=2)
    try:
        with pytest.raises(RankError) as info:
            pool.run(jw.sender_skips_cast_in_step)
    finally:
        pool.close(force=True)
    message = str(info.value)
    assert "WireFormatError" in message and "the state it sends is float32" in message, message
    assert "model.layers.0.mixer" in message and "float64" in message, message
    assert "Received data size" not in message, message


def test_a_state_of_another_shape_cannot_be_cast():
    fmt = WireFormat((2, 3), torch.float64)
    assert to_wire(torch.ones(2, 3), fmt).dtype == torch.float64
    with pytest.raises(WireFormatError, match=r"layers\.1\.mixer: the state it passes on is float32 \[3, 2\].*"
                                              r"float64 \[2, 3\].*state_meta\(\)"):
        to_wire(torch.ones(3, 2), fmt, "layers.1.mixer")
    with pytest.raises(WireFormatError, match="the state it sends is float32"):
        check_wire(torch.ones(2, 3), fmt, "layers.1.mixer", "sends")
