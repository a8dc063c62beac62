"""Ulysses' flash call inside a compiled block: ``torch.ops.ringmaster.flash_varlen``.

Eagerly, :func:`ringmaster.attention.ulysses.flash_ulysses` calls the kernel's ``flash_attn_varlen_func`` with the
step's ``cu_seqlens`` and ``max_seqlen`` (``CPBatch.varlen_bounds``). Traced in a compiled block, that call is the
kernel's Python (its autograd function, host reads of the boundaries on the CPU stand-in), and ``max_seqlen`` is a
Python int of each packing: fullgraph fails, or every packing recompiles.

Here the call is a custom op taking the batch's opaque :class:`~ringmaster.sharding.handle.StepHandle`. The op reads
the boundaries on the host, from the step's runs, and calls the kernel's low-level varlen forward (the same
functions the ring's ``ring_impl="hf_kernels"`` blocks call: :func:`.ring.hub.hub_ops`) eagerly; its backward op
calls the varlen backward with the saved output and LSE. Dynamo sees two ops with fake kernels, whatever the
kernel's Python, and a new packing is new data, not a new graph.

Sinks and attention dropout stay on the eager path (:func:`compiles`); ``report.compile_notes`` names them.
CPU stand-in only so far: not yet run on a GPU.
"""

from __future__ import annotations

import torch

from ..sharding import handle
from ..sharding.handle import StepHandle
from .ring.hub import hub_ops


def compiles(sinks, dropout: float) -> bool:
    """Whether a Ulysses flash call with these features runs as the op (the kernels' low-level functions take
    no sinks and no dropout RNG here)."""
    return handle.AVAILABLE and sinks is None and not dropout


def _side(value: int):
    return None if value < 0 else value


def _forward(q, k, v, step: StepHandle, rows: int, kernel: str, left: int, right: int, softcap: float, scale: float):
    cu, longest = step.batch.varlen_bounds(rows, q.device)
    out, lse = hub_ops(kernel, softcap).varlen_fwd(q, k, v, cu, cu, longest, longest, scale, _side(left),
                                                   _side(right))
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise NotImplementedError(f"the flash kernel {kernel!r} returned an LSE of shape {tuple(lse.shape)}, not "
                                  f"[heads, tokens] {(q.shape[1], q.shape[0])}: run the blocks uncompiled")
    return out, lse.float()


def _backward(dout, q, k, v, out, lse, step: StepHandle, rows: int, kernel: str, left: int, right: int,
              softcap: float, scale: float):
    cu, longest = step.batch.varlen_bounds(rows, q.device)
    dq, dk, dv = hub_ops(kernel, softcap).varlen_bwd(dout, q, k, v, out, lse, cu, cu, longest, longest, scale,
                                                     _side(left), _side(right))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


if handle.AVAILABLE:
    @torch.library.custom_op("ringmaster::flash_varlen", mutates_args=())
    def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepHandle, rows: int, kernel: str,
                      left: int, right: int, softcap: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(q, k, v, step, rows, kernel, left, right, softcap, scale)

    @_flash_varlen.register_fake
    def _(q, k, v, step, rows, kernel, left, right, softcap, scale):
        T, H, _ = q.shape
        return q.new_empty(T, H, v.shape[-1]), q.new_empty(H, T, dtype=torch.float32)

    @torch.library.custom_op("ringmaster::flash_varlen_backward", mutates_args=())
    def _flash_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, step: StepHandle, rows: int, kernel: str,
                               left: int, right: int, softcap: float,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(dout, q, k, v, out, lse, step, rows, kernel, left, right, softcap, scale)

    @_flash_varlen_backward.register_fake
    def _(dout, q, k, v, out, lse, step, rows, kernel, left, right, softcap, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    handle.differentiable(_flash_varlen, _flash_varlen_backward)


def flash_varlen(q, k, v, cpb, rows: int, kernel: str, window, causal: bool, softcap, scale: float) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (``rows`` rows of ``cpb.seq_len`` tokens, flattened) through
    ``torch.ops.ringmaster.flash_varlen`` -> out ``[T, Hq, D]``. ``window``: flash's inclusive (left, right) or
    None; ``kernel``: the model's attn_implementation (the op loads it by name, cached)."""
    if window is not None:
        left, right = window
    else:
        left, right = -1, (0 if causal else -1)
    out, _ = torch.ops.ringmaster.flash_varlen(q, k, v, cpb.handle, rows, kernel, -1 if left is None else int(left),
                                               -1 if right is None else int(right), float(softcap or 0.0),
                                               float(scale))
    return out
