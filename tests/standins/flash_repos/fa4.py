"""The flash-attn 4 (CuTe DSL, ``flash_attn.cute``) Python interface on CPU:
``kernels-community/flash-attn4``.

Where FA4 differs from FA2/FA3 (and the stand-in follows it):
- low level ``_flash_attn_fwd(q, k, v, ..., cu_seqlens_q, cu_seqlens_k, ..., softmax_scale, causal,
  softcap, window_size_left, window_size_right, learnable_sink, ..., return_lse, out, lse, ...)``
  -> ``(out, lse, None, None)`` and ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal,
  softcap, window_size_left, window_size_right, ..., cu_seqlens_q, cu_seqlens_k, ..., dq, dk, dv,
  ..., dlse, learnable_sink)`` -> ``(dq, dk, dv)``, or ``(dq, dk, dv, dsink)`` with a sink;
- windows use ``None`` (not -1) for unbounded; sinks are ``learnable_sink`` and get a gradient;
- ``flash_attn_func`` / ``flash_attn_varlen_func`` return ``(out, lse)``; with ``return_lse`` the
  LSE is differentiable (``dlse`` enters the backward);
- a row that sees nothing has LSE ``-inf`` (FA2/FA3 write ``+inf``); its output is 0.
Unsupported (refused): ``qv``, paged KV, score/mask mods, block sparsity, fp8 scales.
"""

from __future__ import annotations

import math

import torch

from ringmaster_tools.flash_standin import core

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "_flash_attn_fwd", "_flash_attn_bwd"]

EMPTY_LSE = -math.inf


def _empty_to(lse):
    return torch.where(lse == math.inf, torch.full_like(lse, EMPTY_LSE), lse)


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, softcap=None, window_size_left=None, window_size_right=None,
                    learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None,
                    num_threads=384, num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                    block_sparse_tensors=None, return_lse=False, out=None, lse=None, aux_tensors=None,
                    aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
                    scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """-> (out, lse ``[B,H,Sq]`` / ``[H,Tq]`` fp32, None, None)."""
    core.refuse_set(qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, score_mod=score_mod,
            mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors, q_descale=q_descale,
            gather_kv_indices=gather_kv_indices)
    scale = core.default_scale(q, softmax_scale)
    m = core.flash_mask(causal, window_size_left, window_size_right, softcap)
    if cu_seqlens_q is None:
        o, l = core.forward_batched(q, k, v, scale, m, None, learnable_sink)
    else:
        o, l = core.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, m, None, learnable_sink)
    l = _empty_to(l)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return o, l, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                    window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                    num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                    dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                    V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                    score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                    block_sparse_tensors=None, dlse=None, learnable_sink=None):
    """-> (dq, dk, dv), or (dq, dk, dv, dsink) with ``learnable_sink``."""
    core.refuse_set(seqused_q=seqused_q, seqused_k=seqused_k, score_mod=score_mod, mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors)
    scale = core.default_scale(q, softmax_scale)
    m = core.flash_mask(causal, window_size_left, window_size_right, softcap)
    if cu_seqlens_q is None:
        gq, gk, gv, ds = core.backward_batched(dout, q, k, v, out, lse, scale, m, None, learnable_sink, dlse)
    else:
        gq, gk, gv, ds = core.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, m,
                                              None, learnable_sink, dlse)
    res = [src.to(ref.dtype) if dst is None else dst.copy_(src)
           for dst, src, ref in ((dq, gq, q), (dk, gk, k), (dv, gv, v))]
    if learnable_sink is None:
        return tuple(res)
    return (*res, ds.to(learnable_sink.dtype))


def _apply(q, k, v, cu_q, cu_k, softmax_scale, causal, window_size, learnable_sink, softcap, return_lse):
    left, right = (None, None) if window_size is None else window_size
    return core.Attention.apply(q, k, v, learnable_sink, cu_q, cu_k, core.default_scale(q, softmax_scale),
                                core.flash_mask(causal, left, right, softcap), None, True, bool(return_lse), EMPTY_LSE)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None,
                    return_lse=False):
    """q ``[B,Sq,H,D]`` -> (out, lse ``[B,H,Sq]``)."""
    core.refuse_set(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors)
    return _apply(q, k, v, None, None, softmax_scale, causal, window_size, learnable_sink, softcap, return_lse)


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """Packed q ``[Tq,H,D]`` -> (out, lse ``[H,Tq]``)."""
    core.refuse_set(qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, gather_kv_indices=gather_kv_indices,
            page_table=page_table, score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors)
    if cu_seqlens_q is None:
        core.refuse("cu_seqlens_q", None, "flash_attn_varlen_func needs cu_seqlens_q/k")
    return _apply(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, learnable_sink,
                  softcap, return_lse)
