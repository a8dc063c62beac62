"""Rank-side jobs of tests/test_wire_format.py: one wire format per passed recurrent state.

An fp64 model whose recurrent kernel computes its state in float32 inside (transformers' pure-torch
``mamba2_chunk_scan`` and gated-delta rule, run *without* ``keep_fp64``): the receiver's buffer
(``state_meta()``: float64) and the sender's state (the kernel's: float32) used to differ, and gloo
aborted the process. Now both ends use the wire format and the run matches the model without CP.
"""

from __future__ import annotations

import torch

import ringmaster as rm
from ringmaster.recurrent import scan


def fp64_parity(ctx, model_type, P=2, strategy="sequential", seq_len=64):
    """The model in float64, transformers' kernels left as they are (their float32 casts inside): CP vs the
    model without CP, per parameter (``ringmaster_tools.parity.compare`` with ``dtype=float64`` and no
    ``keep_fp64``)."""
    from jobs_recurrent import slow_decay
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy)
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=slow_decay,
                   dtype=torch.float64)


def _skip_cast():
    """Mutation: the sender no longer casts its state to the wire format (``scan.to_wire`` returns it as the
    kernel made it). Returns the undo."""
    original = scan.to_wire
    scan.to_wire = lambda state, fmt, name=None: state
    return lambda: setattr(scan, "to_wire", original)


def sender_skips_cast_at_wire(ctx, model_type="nemotron_h", P=2):
    """The mutation in place while ``rm.wire`` probes the layers: the probe's check of the state the sequential
    pass would send raises on every rank, before any state-passing collective. Returns the error's type and
    message (None: nothing raised)."""
    from jobs_recurrent import slow_decay
    from ringmaster_tools.parity import tiny_model

    model = tiny_model(model_type, dtype=torch.float64)
    slow_decay(model)
    undo = _skip_cast()
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent="sequential"),
                device_mesh=ctx.mesh(P))
    except Exception as e:   # noqa: BLE001: the test reads the type and message
        return type(e).__name__, str(e)
    else:
        rm.unwire(model)
        return None
    finally:
        undo()
        rm.teardown()


def sender_skips_cast_in_step(ctx, model_type="nemotron_h", P=2, seq_len=64):
    """The mutation put in after ``rm.wire`` (its probe passed): the sending rank's last check before
    ``dist.send`` raises (its peer, waiting in ``recv``, is stopped by the pool), never a gloo abort."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model(model_type, dtype=torch.float64)
    batch = tiny_batch(model.config.vocab_size, seq_len)
    rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent="sequential"), device_mesh=ctx.mesh(P))
    undo = _skip_cast()
    try:
        with context_parallel_region(batch) as shard:
            model(**shard).loss.backward()
    finally:
        undo()
        rm.unwire(model)
        rm.teardown()
