"""aten's CUDA attention ops as a ring block kernel. **Not yet run on a GPU.**

Written against the op schemas (``torch.ops.aten.<op>.default._schema``) and checked for shapes
and arguments on ``meta`` tensors, which carry these ops' meta kernels (tests/test_ring_kernels.py);
no CUDA numerics have been compared yet. Every call here runs only for CUDA (or meta) tensors.

Which op runs a block:

* fp16/bf16, band blocks (unmasked, causal diagonal, sliding window): ``_flash_attention_forward``
  on the region the band reaches, the band expressed as ``window_size_left/right``. Flash aligns
  causal/window bottom-right; :func:`.masks.flash_window` converts.
* fp16/bf16, document blocks: the varlen form (``cu_seqlens``) of the same op on the gathered rows
  of each document, one call per distinct window (:mod:`.flash_blocks`).
* arbitrary masks and every fp32 block:
  ``_efficient_attention_forward``, unmasked/causal through ``custom_mask_type``, masked blocks
  per tile of query rows with that tile's additive bias. Its LSE is padded to a multiple of 32
  rows: sliced here, and padded again for the backward.

GQA: flash takes fewer K/V heads natively; memory-efficient attention gets expanded K/V.
fp64 has no fused CUDA op: refused with the fix (``ring_impl='math'``). MLA blocks arrive padded to one
head dim (:class:`.aten.AtenKernel`); softcap is refused there (no op here takes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import flash_blocks
from .common import NEG_INF, empty_result, expand_heads, finite_lse, reduce_groups
from .masks import BlockMask
from .merge import acc_dtype
from .tiles import additive, rows_seen, tiles

DEVICES = ("cuda", "meta")  # meta: shape/argument tracing in CPU tests
FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LSE_ALIGN = 32   # memory-efficient attention pads its LSE rows to this
_BIAS_ALIGN = 16  # and wants bias rows aligned to this many elements

_aten = torch.ops.aten


def refuse_dtype(dtype) -> None:
    if dtype not in EFFICIENT_DTYPES:
        raise ValueError(
            f"ring_impl='aten' on CUDA has no fused kernel for {dtype} (flash runs fp16/bf16, memory-efficient "
            f"attention fp16/bf16/fp32); use ring_impl='math' for {dtype} on GPU")


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, H, S, D] -> [B, S, H, D] (a view; the last dim stays contiguous)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """flash needs head_dim % 8 == 0; zero columns change neither scores nor the kept output."""
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x


def _rng(device):
    """Placeholders for the dropout RNG state (dropout is 0: the kernels never read them)."""
    return (torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device))


# ---------------------------------------------------------------- flash (fp16 / bf16)

def _flash_args(left, right):
    causal = left is None and right == 0
    return causal, dict(window_size_left=None if causal else left, window_size_right=None if causal else right)


class _AtenFlash:
    """aten's flash op in :class:`.flash_blocks.FlashOps` form (dense and varlen share one op)."""

    @staticmethod
    def dense_fwd(q, k, v, scale, left, right):
        return _AtenFlash.varlen_fwd(q, k, v, None, None, q.shape[1], k.shape[1], scale, left, right)

    @staticmethod
    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):
        causal, win = _flash_args(left, right)
        out, lse, *_ = _aten._flash_attention_forward(_pad8(q), _pad8(k), _pad8(v), cu_q, cu_k, max_q, max_k, 0.0,
                                                      causal, False, scale=scale, **win)
        return out[..., :q.shape[-1]], lse

    @staticmethod
    def dense_bwd(dout, q, k, v, out, lse, scale, left, right):
        return _AtenFlash.varlen_bwd(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], scale, left, right)

    @staticmethod
    def varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right):
        causal, win = _flash_args(left, right)
        seed, offset = _rng(q.device)
        D = q.shape[-1]
        dq, dk, dv = _aten._flash_attention_backward(_pad8(dout), _pad8(q), _pad8(k), _pad8(v), _pad8(out),
                                                     lse.float().contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                     seed, offset, scale=scale, **win)
        return dq[..., :D], dk[..., :D], dv[..., :D]


# ---------------------------------------------------------------- memory-efficient attention

_NO_MASK, _CAUSAL_TOP_LEFT = 0, 1  # custom_mask_type


def _eff_fwd(q, k, v, scale, bias, mask_type):
    """q/k/v ``[B, S, H, D]`` (same heads) -> out ``[B, Sq, H, D]``, lse ``[B, H, Sq]`` (the padding sliced)."""
    out, lse, *_ = _aten._efficient_attention_forward(q, k, v, bias, None, None, None, None, 0.0, mask_type, True,
                                                      scale=scale)
    return out, lse[..., :q.shape[1]]


def _eff_bwd(dout, q, k, v, out, lse, scale, bias, mask_type):
    B, Sq, H, _ = q.shape
    rows = -(-Sq // _LSE_ALIGN) * _LSE_ALIGN
    lse_p = torch.zeros(B, H, rows, dtype=torch.float32, device=q.device)
    lse_p[..., :Sq] = lse
    seed = offset = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._efficient_attention_backward(dout.contiguous(), q, k, v, bias, out.contiguous(), None, None,
                                                         Sq, k.shape[1], lse_p, 0.0, seed, offset, mask_type, False,
                                                         scale=scale)
    return dq, dk, dv


def _bias(tm, q, B, H):
    return None if tm is None else additive(tm, q.dtype, _BIAS_ALIGN).expand(B, H, *tm.shape[-2:])


def _eff_forward(q, k, v, scale, m: BlockMask):
    g = q.shape[1] // k.shape[1]
    qs, ks, vs = _bshd(q), _bshd(expand_heads(k, g)), _bshd(expand_heads(v, g))
    acc = acc_dtype(q)
    if m.full or m.causal_square:
        o, l = _eff_fwd(qs, ks, vs, scale, None, _CAUSAL_TOP_LEFT if m.causal_square else _NO_MASK)
        return o.transpose(1, 2).to(acc), l.to(acc)
    out, lse = empty_result(q)
    B, H = q.shape[:2]
    for r0, r1, k0, k1, tm in tiles(m, q.device):
        o, l = _eff_fwd(qs[:, r0:r1], ks[:, k0:k1], vs[:, k0:k1], scale, _bias(tm, q, B, H), _NO_MASK)
        seen = rows_seen(tm)
        if seen is not None:
            o = o.masked_fill(~seen.transpose(1, 2).unsqueeze(-1), 0.0)
            l = l.masked_fill(~seen, NEG_INF)
        out[..., r0:r1, :] = o.transpose(1, 2)
        lse[..., r0:r1] = l
    return out, lse


def _eff_backward(dout, q, k, v, out, lse, scale, m: BlockMask):
    g = q.shape[1] // k.shape[1]
    kx, vx = expand_heads(k, g), expand_heads(v, g)
    qs, ks, vs, ds, os_ = _bshd(q), _bshd(kx), _bshd(vx), _bshd(dout), _bshd(out)
    lse = finite_lse(lse)
    if m.full or m.causal_square:
        gq, gk, gv = _eff_bwd(ds, qs, ks, vs, os_, lse, scale, None, _CAUSAL_TOP_LEFT if m.causal_square else _NO_MASK)
        return gq.transpose(1, 2), reduce_groups(gk.transpose(1, 2), g), reduce_groups(gv.transpose(1, 2), g)
    acc = acc_dtype(q)
    B, H = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kx.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vx.shape, dtype=acc, device=q.device)
    for r0, r1, k0, k1, tm in tiles(m, q.device):
        gq, gk, gv = _eff_bwd(ds[:, r0:r1], qs[:, r0:r1], ks[:, k0:k1], vs[:, k0:k1], os_[:, r0:r1], lse[..., r0:r1],
                              scale, _bias(tm, q, B, H), _NO_MASK)
        dq[..., r0:r1, :] += gq.transpose(1, 2)
        dk[..., k0:k1, :] += gk.transpose(1, 2)
        dv[..., k0:k1, :] += gv.transpose(1, 2)
    return dq.to(q.dtype), reduce_groups(dk, g).to(k.dtype), reduce_groups(dv, g).to(v.dtype)


# ---------------------------------------------------------------- dispatch

def _use_flash(q, m: BlockMask) -> bool:
    return q.dtype in FLASH_DTYPES and m.dense is None


def forward(q, k, v, scale, m: BlockMask):
    refuse_dtype(q.dtype)
    if _use_flash(q, m):
        return flash_blocks.forward(_AtenFlash, q, k, v, scale, m)
    return _eff_forward(q, k, v, scale, m)


def backward(dout, q, k, v, out, lse, scale, m: BlockMask):
    refuse_dtype(q.dtype)
    if _use_flash(q, m):
        return flash_blocks.backward(_AtenFlash, dout, q, k, v, out, lse, scale, m)
    return _eff_backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, scale, m)
