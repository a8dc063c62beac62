"""``ring_impl='aten'``: torch's own fused attention ops, which return the LSE and take the merged
output and LSE back in backward.

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``). Unmasked and causal
  diagonal blocks are one call; any other block runs per tile of query rows with that tile's
  additive mask (:mod:`.tiles`), so temporaries are O(tile * Sk).
* CUDA: :mod:`.aten_cuda` (flash for bands and documents, memory-efficient attention for arbitrary
  masks and fp32). **Not yet run on a GPU**; its calls are checked against the op schemas on
  ``meta`` tensors (tests/test_ring_kernels.py).

MLA (value heads narrower than query/key heads): the fused ops want one head dim, so q/k/v are
zero-padded to the wider one and the results sliced (:class:`.common.EqualHeadDims`; exact).

Logit soft-capping (Gemma-2 ``softcap``): no fused op here takes it. On CPU a softcap block runs the
math kernel (:mod:`.math_kernel`) per tile of query rows (O(tile * Sk) temporaries, exact); on CUDA
it is refused before any collective (:meth:`AtenKernel.check`). No other block falls back to the
math kernel.
"""

from __future__ import annotations

import functools

import torch

from ...config import RingImpl
from . import aten_cuda
from .common import EqualHeadDims, empty_result, expand_heads, finite_lse, reduce_groups
from .masks import as_block_mask
from .math_kernel import MathKernel
from .merge import acc_dtype
from .tiles import TILE_ROWS, additive, rows_seen, tiles

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@functools.lru_cache(maxsize=None)
def _cpu_gqa_native() -> bool:
    """Does the CPU flash op take fewer K/V heads than query heads (GQA) itself? torch 2.13's does,
    and returns dK/dV per K/V head. Then an unmasked or causal block passes K/V as they are:
    expanding them to the query heads copied both, forward and backward, every block (about 9% of
    a ring step at S=4096, 8/4 heads, P=2 on CPU). A capability of the installed torch, probed once
    on tiny tensors; not per-step state."""
    q = torch.zeros(1, 2, 2, 8)
    kv = torch.zeros(1, 1, 2, 8)
    try:
        out, lse = _CPU_FWD(q, kv, kv, 0.0, True, scale=1.0)
        grads = _CPU_BWD(torch.ones_like(out), q, kv, kv, out, lse, 0.0, True, scale=1.0)
    except RuntimeError:
        return False
    return tuple(grads[1].shape) == tuple(kv.shape)


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

    def check(self, q, v, softcap=None) -> None:
        """Refuse, before any collective, what no aten op here runs: softcap on CUDA."""
        if softcap and q.device.type != "cpu":
            raise NotImplementedError(
                f"ring_impl='aten' on {q.device.type}: torch's fused attention ops have no logit soft-capping (the "
                f"model caps at softcap={softcap}); use ring_impl='hf_kernels' (flash kernels take softcap), "
                "ring_impl='math', or backend='ulysses' with attn_implementation='eager'")

    def forward(self, q, k, v, scale, mask, softcap=None):
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if softcap:
            self.check(q, v, softcap)
            return _math_tiles_forward(q, k, v, scale, m, softcap, self.tile_rows)
        dims = EqualHeadDims(q, v)
        q, k, v = dims.inputs(q, k, v)
        if q.device.type == "cpu":
            out, lse = _cpu_forward(q, k, v, scale, m, self.tile_rows)
        elif q.device.type in aten_cuda.DEVICES:
            out, lse = aten_cuda.forward(q, k, v, scale, m)
        else:
            raise _unsupported(q.device)
        return dims.outputs(out), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask, softcap=None):
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if softcap:
            self.check(q, v, softcap)
            return _math_tiles_backward(dout, q, k, v, out, lse, scale, m, softcap, self.tile_rows)
        dims = EqualHeadDims(q, v)
        q, k, v = dims.inputs(q, k, v)
        dout, out = dims.pad(dout), dims.pad(out)
        if q.device.type == "cpu":
            grads = _cpu_backward(dout, q, k, v, out, lse, scale, m, self.tile_rows)
        elif q.device.type in aten_cuda.DEVICES:
            grads = aten_cuda.backward(dout, q, k, v, out, lse, scale, m)
        else:
            raise _unsupported(q.device)
        return dims.grads(*grads)


_MATH = MathKernel()


def _math_tiles_forward(q, k, v, scale, m, softcap, tile_rows):
    """A softcap block through the math kernel, one tile of query rows at a time (O(tile * Sk))."""
    out, lse = empty_result(q, v.shape[-1])
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        o, l = _MATH.forward(q[..., r0:r1, :], k[..., k0:k1, :], v[..., k0:k1, :], scale, tm, softcap=softcap)
        out[..., r0:r1, :] = o
        lse[..., r0:r1] = l
    return out, lse


def _math_tiles_backward(dout, q, k, v, out, lse, scale, m, softcap, tile_rows):
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        rows, keys = slice(r0, r1), slice(k0, k1)
        gq, gk, gv = _MATH.backward(dout[..., rows, :], q[..., rows, :], k[..., keys, :], v[..., keys, :],
                                    out[..., rows, :], lse[..., rows], scale, tm, softcap=softcap)
        dq[..., rows, :] += gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tile_bias(m, tm, r0, r1, k0, k1, q):
    """A tile's additive mask: 0 / -inf from its bool mask, plus the ALiBi bias ``[1, H, t, k]`` if any."""
    bias = None if tm is None else additive(tm, q.dtype)
    alibi = m.bias(r0, r1, k0, k1, q.device, q.dtype)
    if alibi is None:
        return bias
    return alibi if bias is None else (bias + alibi).contiguous()


def _cpu_forward(q, k, v, scale, m, tile_rows):
    g = q.shape[1] // k.shape[1]
    acc = acc_dtype(q)
    if (m.full or m.causal_square) and m.alibi_slopes is None:
        if g > 1 and not _cpu_gqa_native():
            k, v = expand_heads(k, g), expand_heads(v, g)
        out, lse = _CPU_FWD(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, m.causal_square, scale=scale)
        return out.to(acc), lse.to(acc)
    kx, vx = expand_heads(k, g).contiguous(), expand_heads(v, g).contiguous()
    out, lse = empty_result(q)
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        bias = _tile_bias(m, tm, r0, r1, k0, k1, q)
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
    dout, out, lse = dout.to(q.dtype), out.to(q.dtype), finite_lse(lse, acc_dtype(q))
    if (m.full or m.causal_square) and m.alibi_slopes is None:
        if g > 1 and _cpu_gqa_native():   # dK/dV come back per K/V head
            return _CPU_BWD(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                            lse, 0.0, m.causal_square, scale=scale)
        kx, vx = expand_heads(k, g).contiguous(), expand_heads(v, g).contiguous()
        dq, dk, dv = _CPU_BWD(dout.contiguous(), q.contiguous(), kx, vx, out.contiguous(), lse, 0.0,
                              m.causal_square, scale=scale)
        return dq, reduce_groups(dk, g), reduce_groups(dv, g)
    kx, vx = expand_heads(k, g).contiguous(), expand_heads(v, g).contiguous()
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kx.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vx.shape, dtype=acc, device=q.device)
    for r0, r1, k0, k1, tm in tiles(m, q.device, tile_rows):
        bias = _tile_bias(m, tm, r0, r1, k0, k1, q)
        rows = slice(r0, r1)
        gq, gk, gv = _CPU_BWD(dout[..., rows, :].contiguous(), q[..., rows, :].contiguous(), kx[..., k0:k1, :],
                              vx[..., k0:k1, :], out[..., rows, :].contiguous(), lse[..., rows].contiguous(), 0.0,
                              False, attn_mask=bias, scale=scale)
        dq[..., rows, :] += gq
        dk[..., k0:k1, :] += gk
        dv[..., k0:k1, :] += gv
    return dq.to(q.dtype), reduce_groups(dk, g).to(k.dtype), reduce_groups(dv, g).to(v.dtype)
