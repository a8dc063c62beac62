"""The flash-attn 3 (hopper) Python interface on CPU: ``kernels-community/flash-attn3``,
``flash_attn_interface``; and vllm's FA3 fork with sinks: ``kernels-community/vllm-flash-attn3``.

Where FA3 differs from FA2 (and the stand-in follows it):
- no dropout argument; one ``_flash_attn_forward`` for dense and varlen (``cu_seqlens_q/k``
  keyword arguments) returning ``(out, softmax_lse, out_accum, softmax_lse_accum)``;
- ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
  seqused_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left,
  window_size_right, softcap, deterministic, sm_margin)``;
- ``flash_attn_func`` returns ``out``, or ``(out, lse)`` with ``return_attn_probs``.

vllm's fork (:data:`VLLM`): ``window_size=(left, right)`` tuples in the low-level calls, an
``s_aux`` sink logit per head, and ``flash_attn_func``/``flash_attn_varlen_func`` that always
return ``(out, softmax_lse)``. Its backward returns **no gradient for s_aux** (it was written for
inference); the stand-in mirrors that, so a caller that trains sinks must add d s_aux itself
(``-sum_i exp(s_aux - lse_i) * rowsum(dout * out)_i``). The LSE includes the sink.
"""

from __future__ import annotations

import torch

from ringmaster_tools.flash_standin import core

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "_flash_attn_forward", "_flash_attn_backward"]


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, mask, s_aux=None):
    scale = core.default_scale(q, softmax_scale)
    if cu_seqlens_q is None:
        return core.forward_batched(q, k, v, scale, mask, None, s_aux)
    return core.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, mask, None, s_aux)


def _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, softmax_scale, mask, s_aux=None):
    scale = core.default_scale(q, softmax_scale)
    if cu_seqlens_q is None:
        gq, gk, gv, _ = core.backward_batched(dout, q, k, v, out, lse, scale, mask, None, s_aux)
    else:
        gq, gk, gv, _ = core.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             scale, mask, None, s_aux)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    dq.copy_(gq), dk.copy_(gk), dv.copy_(gv)
    return dq, dk, dv, core.softmax_d(dout, out)


def _empty(q):
    return torch.tensor([], device=q.device)


# --- Dao-AILab hopper interface --------------------------------------------------------------

def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                        leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
                        q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0,
                        softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                        pack_gqa=None, sm_margin=0):
    """-> (out, softmax_lse, out_accum, softmax_lse_accum); lse ``[B,H,Sq]`` or ``[H,Tq]``."""
    core.refuse_set(k_new=k_new, v_new=v_new, qv=qv, cu_seqlens_k_new=cu_seqlens_k_new,
                   seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table,
                   kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if attention_chunk:
        core.refuse("attention_chunk", attention_chunk)
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                    core.flash_mask(causal, window_size_left, window_size_right, softcap))
    if out_ is not None:
        out_.copy_(out)
        out = out_
    return out, lse, _empty(q), _empty(q)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None,
                         sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None,
                         dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
                         window_size_left=-1, window_size_right=-1, softcap=0.0,
                         deterministic=False, sm_margin=0):
    """Writes dq/dk/dv in place; returns softmax_d."""
    core.refuse_set(sequed_q=sequed_q, sequed_k=sequed_k)
    return _bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, softmax_scale,
                core.flash_mask(is_causal, window_size_left, window_size_right, softcap))[3]


def _apply(q, k, v, s_aux, cu_q, cu_k, softmax_scale, causal, window_size, softcap, sink_grad):
    left, right = (-1, -1) if window_size is None else window_size
    return core.Attention.apply(q, k, v, s_aux, cu_q, cu_k, core.default_scale(q, softmax_scale),
                                core.flash_mask(causal, left, right, softcap), None, sink_grad)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    core.refuse_set(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse = _apply(q, k, v, None, None, None, softmax_scale, causal, window_size, softcap, True)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None,
                           q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                           attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, sm_margin=0, return_attn_probs=False):
    core.refuse_set(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale)
    out, lse = _apply(q, k, v, None, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                      softcap, True)
    return (out, lse) if return_attn_probs else out


class VLLM:
    """vllm's FA3 fork (``kernels-community/vllm-flash-attn3``): sinks, tuple windows, (out, lse)."""

    @staticmethod
    def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out=None, cu_seqlens_q=None,
                            cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                            leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0,
                            s_aux=None, cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None,
                            batch_invariant=False):
        core.refuse_set(k_new=k_new, v_new=v_new, qv=qv, seqused_q=seqused_q, seqused_k=seqused_k,
                       page_table=page_table, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
                       q_descale=q_descale, cp_tot_seqused_k=cp_tot_seqused_k)
        if cp_world_size != 1:
            core.refuse("cp_world_size", cp_world_size)
        left, right = (-1, -1) if window_size is None else window_size
        o, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                      core.flash_mask(causal, left, right, softcap), s_aux)
        if out is not None:
            out.copy_(o)
            o = out
        return o, lse, _empty(q), _empty(q)

    @staticmethod
    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q,
                             sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal,
                             window_size=(-1, -1), softcap=0.0, deterministic=False, sm_margin=0):
        """-> (dq, dk, dv, softmax_d). No s_aux argument: the sink only enters through the LSE."""
        core.refuse_set(sequed_q=sequed_q, sequed_k=sequed_k)
        left, right = (-1, -1) if window_size is None else window_size
        return _bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv,
                    softmax_scale, core.flash_mask(causal, left, right, softcap))

    @staticmethod
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                        k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0,
                        num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, s_aux=None,
                        cp_world_size=1, cp_rank=0, cp_tot_seqused_k=None):
        """-> (out, softmax_lse); no gradient reaches ``s_aux`` (as in the real kernel)."""
        core.refuse_set(qv=qv, q_descale=q_descale, cp_tot_seqused_k=cp_tot_seqused_k)
        return _apply(q, k, v, s_aux, None, None, softmax_scale, causal, window_size, softcap, False)

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                               qv=None, q_descale=None, k_descale=None, v_descale=None,
                               window_size=(-1, -1), softcap=0.0, num_splits=1, pack_gqa=None,
                               deterministic=False, sm_margin=0, s_aux=None, cp_world_size=1,
                               cp_rank=0, cp_tot_seqused_k=None):
        """-> (out, softmax_lse ``[H,Tq]``); no gradient reaches ``s_aux``."""
        core.refuse_set(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale)
        return _apply(q, k, v, s_aux, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                      softcap, False)
