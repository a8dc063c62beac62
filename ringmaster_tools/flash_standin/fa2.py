"""The flash-attn 2.x Python interface (``kernels-community/flash-attn2``, ``flash_attn``) on CPU.

Same names, argument order and return values as flash_attn's ``flash_attn_interface`` and the
hub build's ops (``fwd``/``varlen_fwd``/``bwd``/``varlen_bwd``), computed by
:mod:`ringmaster_tools.flash_standin.core`. Differences, each refused loudly: no dropout
(``dropout_p`` must be 0), no paged KV (``block_table``), no ``return_softmax`` matrix (None).
The low-level backward writes ``dq``/``dk``/``dv`` in place and returns ``softmax_d``, as the
real one does.
"""

from __future__ import annotations

import torch

from . import core

__all__ = [
    "flash_attn_func", "flash_attn_varlen_func",
    "_flash_attn_forward", "_flash_attn_backward",
    "_flash_attn_varlen_forward", "_flash_attn_varlen_backward",
    "fwd", "bwd", "varlen_fwd", "varlen_bwd",
]

STANDIN = "flash-attn2 (CPU stand-in)"


def _check(dropout_p, return_softmax=False, block_table=None, extra=()):
    if dropout_p:
        core.refuse("dropout_p", dropout_p, "the CPU flash stand-in has no dropout; pass 0.0")
    if block_table is not None:
        core.refuse("block_table", "<tensor>")
    for name, value in extra:
        if value is not None and value is not False and not (isinstance(value, int) and value == 0):
            core.refuse(name, "<set>")


def _rng_state(q):
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _mask(causal, left, right, softcap):
    return core.Mask(causal=bool(causal), left=left, right=right, softcap=softcap or 0.0)


# --- low-level interface (flash_attn.flash_attn_interface) -----------------------------------

def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """-> (out ``[B,Sq,H,D]``, softmax_lse ``[B,H,Sq]`` fp32, S_dmask None, rng_state)."""
    _check(dropout_p)
    out, lse = core.forward_batched(q, k, v, core.default_scale(q, softmax_scale),
                                    _mask(causal, window_size_left, window_size_right, softcap),
                                    alibi_slopes)
    return out, lse, None, _rng_state(q)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """-> (out ``[Tq,H,D]``, softmax_lse ``[H,Tq]`` fp32, S_dmask None, rng_state)."""
    _check(dropout_p, return_softmax, block_table, (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)))
    out, lse = core.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   core.default_scale(q, softmax_scale),
                                   _mask(causal, window_size_left, window_size_right, softcap),
                                   alibi_slopes)
    return out, lse, None, _rng_state(q)


def _write(dst, src):
    if dst is not None:
        dst.copy_(src)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """Writes dq/dk/dv in place; returns softmax_d ``[B,H,Sq]`` (rowsum(dout*out))."""
    _check(dropout_p)
    gq, gk, gv, _ = core.backward_batched(dout, q, k, v, out, softmax_lse,
                                          core.default_scale(q, softmax_scale),
                                          _mask(causal, window_size_left, window_size_right, softcap),
                                          alibi_slopes)
    _write(dq, gq), _write(dk, gk), _write(dv, gv)
    return core.softmax_d(dout, out)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                deterministic, rng_state=None, zero_tensors=False):
    """Writes dq/dk/dv in place; returns softmax_d ``[H,Tq]``."""
    _check(dropout_p)
    gq, gk, gv, _ = core.backward_varlen(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                         core.default_scale(q, softmax_scale),
                                         _mask(causal, window_size_left, window_size_right, softcap),
                                         alibi_slopes)
    _write(dq, gq), _write(dk, gk), _write(dv, gv)
    return core.softmax_d(dout, out)


# --- the hub build's op names (torch-ext ops: fwd / varlen_fwd / bwd / varlen_bwd) ------------

def fwd(q, k, v, out_=None, alibi_slopes_=None, p_dropout=0.0, softmax_scale=None, is_causal=False,
        window_size_left=-1, window_size_right=-1, softcap=0.0, return_softmax=False, gen_=None):
    out, lse, p, rng = _flash_attn_forward(q, k, v, p_dropout, softmax_scale, is_causal,
                                           window_size_left, window_size_right, softcap,
                                           alibi_slopes_, return_softmax)
    if out_ is not None:
        out_.copy_(out)
        out = out_
    return [out, lse, p, rng]


def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k_=None, leftpad_k_=None,
               block_table_=None, alibi_slopes_=None, max_seqlen_q=0, max_seqlen_k=0, p_dropout=0.0,
               softmax_scale=None, zero_tensors=False, is_causal=False, window_size_left=-1,
               window_size_right=-1, softcap=0.0, return_softmax=False, gen_=None):
    out, lse, p, rng = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
        is_causal, window_size_left, window_size_right, softcap, alibi_slopes_, return_softmax,
        block_table_, leftpad_k_, seqused_k_)
    if out_ is not None:
        out_.copy_(out)
        out = out_
    return [out, lse, p, rng]


def _alloc(t, like):
    return torch.empty_like(like) if t is None else t


def bwd(dout, q, k, v, out, softmax_lse, dq_=None, dk_=None, dv_=None, alibi_slopes_=None,
        p_dropout=0.0, softmax_scale=None, is_causal=False, window_size_left=-1,
        window_size_right=-1, softcap=0.0, deterministic=False, gen_=None, rng_state=None):
    dq, dk, dv = _alloc(dq_, q), _alloc(dk_, k), _alloc(dv_, v)
    d = _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale,
                             is_causal, window_size_left, window_size_right, softcap, alibi_slopes_,
                             deterministic, rng_state)
    return [dq, dk, dv, d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
               alibi_slopes_=None, max_seqlen_q=0, max_seqlen_k=0, p_dropout=0.0, softmax_scale=None,
               zero_tensors=False, is_causal=False, window_size_left=-1, window_size_right=-1,
               softcap=0.0, deterministic=False, gen_=None, rng_state=None):
    dq, dk, dv = _alloc(dq_, q), _alloc(dk_, k), _alloc(dv_, v)
    d = _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout,
                                    softmax_scale, is_causal, window_size_left, window_size_right,
                                    softcap, alibi_slopes_, deterministic, rng_state)
    return [dq, dk, dv, d]


# --- autograd entry points (flash_attn_func / flash_attn_varlen_func) ------------------------

def _window(window_size):
    left, right = (-1, -1) if window_size is None else window_size
    return (-1 if left is None else left), (-1 if right is None else right)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``[B,Sq,H,D]`` -> out; with ``return_attn_probs`` (out, softmax_lse, None)."""
    _check(dropout_p)
    left, right = _window(window_size)
    out, lse = core.Attention.apply(q, k, v, None, None, None, core.default_scale(q, softmax_scale),
                                    _mask(causal, left, right, softcap), alibi_slopes, True)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Packed q ``[Tq,H,D]`` with ``cu_seqlens`` -> out; with ``return_attn_probs``
    (out, softmax_lse ``[H,Tq]``, None)."""
    _check(dropout_p, block_table=block_table)
    left, right = _window(window_size)
    out, lse = core.Attention.apply(q, k, v, None, cu_seqlens_q, cu_seqlens_k,
                                    core.default_scale(q, softmax_scale),
                                    _mask(causal, left, right, softcap), alibi_slopes, True)
    return (out, lse, None) if return_attn_probs else out
