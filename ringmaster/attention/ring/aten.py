"""``ring_impl='aten'``: torch's own fused attention ops, which return the LSE and take the merged
output and LSE back in backward.

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``). Unmasked and causal
  diagonal blocks are one call; any other block runs per tile of query rows with that tile's
  additive mask (:mod:`.tiles`), so temporaries are O(tile * Sk).
* CUDA: :mod:`.aten_cuda` (flash for bands and documents, memory-efficient attention for arbitrary
  masks and fp32). **Not yet run on a GPU**; its calls are checked against the op schemas on
  ``meta`` tensors (tests/test_ring_kernels.py).

No block falls back to the math kernel.
"""

from __future__ import annotations

import torch

from ...config import RingImpl
from . import aten_cuda
from .common import empty_result, expand_heads, finite_lse, reduce_groups
from .masks import as_block_mask
from .merge import acc_dtype
from .tiles import TILE_ROWS, additive, rows_seen, tiles

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _unsupported(device) -> NotImplementedError:
    return NotImplementedError(
        f"ring_impl='aten' runs on cpu and cuda, the activations are on {device}; use ring_impl='math' there")


class AtenKernel:
    """The block-kernel interface (see :mod:`.kernels`) over aten's fused ops, CPU and CUDA."""

    name = RingImpl.ATEN

    def __init__(self, tile_rows: int = TILE_ROWS):
        self.tile_rows = tile_rows

    @staticmethod
    def available(device: torch.device) -> bool:
        return torch.device(device).type in ("cpu", "cuda")

    def forward(self, q, k, v, scale, mask):
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if q.device.type == "cpu":
            return _cpu_forward(q, k, v, scale, m, self.tile_rows)
        if q.device.type in aten_cuda.DEVICES:
            return aten_cuda.forward(q, k, v, scale, m)
        raise _unsupported(q.device)

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if q.device.type == "cpu":
            return _cpu_backward(dout, q, k, v, out, lse, scale, m, self.tile_rows)
        if q.device.type in aten_cuda.DEVICES:
            return aten_cuda.backward(dout, q, k, v, out, lse, scale, m)
        raise _unsupported(q.device)


def _cpu_forward(q, k, v, scale, m, tile_rows):
    g = q.shape[1] // k.shape[1]
    kx, vx = expand_heads(k, g).contiguous(), expand_heads(v, g).contiguous()
    acc = acc_dtype(q)
    if m.full or m.causal_square:
        out, lse = _CPU_FWD(q.contiguous(), kx, vx, 0.0, m.causal_square, scale=scale)
        return out.to(acc), lse.to(acc)
    out, lse = empty_result(q)
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        bias = None if tm is None else additive(tm, q.dtype)
        o, l = _CPU_FWD(q[..., r0:r1, :].contiguous(), kx[..., k0:k1, :], vx[..., k0:k1, :], 0.0, False,
                        attn_mask=bias, scale=scale)
        seen = rows_seen(tm)
        if seen is not None:  # aten reports lse=0 for a row with no visible key: make it -inf
            l = l.to(acc).masked_fill(~seen, float("-inf"))
        out[..., r0:r1, :] = o
        lse[..., r0:r1] = l
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, scale, m, tile_rows):
    g = q.shape[1] // k.shape[1]
    kx, vx = expand_heads(k, g).contiguous(), expand_heads(v, g).contiguous()
    dout, out, lse = dout.to(q.dtype), out.to(q.dtype), finite_lse(lse, acc_dtype(q))
    if m.full or m.causal_square:
        dq, dk, dv = _CPU_BWD(dout.contiguous(), q.contiguous(), kx, vx, out.contiguous(), lse, 0.0,
                              m.causal_square, scale=scale)
        return dq, reduce_groups(dk, g), reduce_groups(dv, g)
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kx.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vx.shape, dtype=acc, device=q.device)
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        bias = None if tm is None else additive(tm, q.dtype)
        rows = slice(r0, r1)
        gq, gk, gv = _CPU_BWD(dout[..., rows, :].contiguous(), q[..., rows, :].contiguous(), kx[..., k0:k1, :],
                              vx[..., k0:k1, :], out[..., rows, :].contiguous(), lse[..., rows].contiguous(), 0.0,
                              False, attn_mask=bias, scale=scale)
        dq[..., rows, :] += gq
        dk[..., k0:k1, :] += gk
        dv[..., k0:k1, :] += gv
    return dq.to(q.dtype), reduce_groups(dk, g).to(k.dtype), reduce_groups(dv, g).to(v.dtype)
