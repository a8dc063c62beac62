"""Run a band or document block through a flash kernel's batched and varlen entry points.

Shared by aten's CUDA flash op (:mod:`.aten_cuda`) and the hub flash kernels (:mod:`.hub`): the
kernel supplies four calls in flash's own layout (``[B, S, H, D]``, varlen ``[T, H, D]`` with
``cu_seqlens``, LSE ``[B, H, S]`` / ``[H, T]``, ``window_size_left/right`` with ``None`` for
unbounded, aligned bottom-right), and this module turns a :class:`.masks.BlockMask` into those
calls (:func:`.masks.flash_calls`): the region a band reaches, or the rows of each document,
gathered per window. Rows no call covers keep ``out = 0``, ``lse = -inf``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .common import NEG_INF, finite_lse
from .masks import BlockMask, flash_calls
from .merge import acc_dtype


class FlashOps(Protocol):
    def dense_fwd(self, q, k, v, scale, left, right): ...            # -> out [B,Sq,H,D], lse [B,H,Sq]
    def dense_bwd(self, dout, q, k, v, out, lse, scale, left, right): ...  # -> dq, dk, dv (BSHD)
    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right): ...  # -> out [T,H,D], lse [H,T]
    def varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right): ...


def _bshd(x):
    return x.transpose(1, 2)


def _flat(x):  # [B, H, S, D] -> [B*S, H, D]
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B * S, H, D)


def _index(segs, sq, sk, device):
    iq = torch.cat([torch.arange(b * sq + q0, b * sq + q1) for b, q0, q1, _, _ in segs]).to(device)
    ik = torch.cat([torch.arange(b * sk + k0, b * sk + k1) for b, _, _, k0, k1 in segs]).to(device)
    lq = [q1 - q0 for _, q0, q1, _, _ in segs]
    lk = [k1 - k0 for _, _, _, k0, k1 in segs]

    def cu(n):
        return torch.tensor([0] + n, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return iq, ik, cu(lq), cu(lk), max(lq), max(lk)


def forward(ops: FlashOps, q, k, v, scale, m: BlockMask):
    """``(out [B,H,Sq,D], lse [B,H,Sq])`` in the accumulation dtype."""
    B, H, sq, D = q.shape
    sk = k.shape[2]
    acc = acc_dtype(q)
    calls = flash_calls(m)
    if len(calls) == 1 and calls[0][0] == "dense" and calls[0][1] == (0, sq, 0, sk):
        o, l = ops.dense_fwd(_bshd(q), _bshd(k), _bshd(v), scale, *calls[0][2])
        return o.transpose(1, 2).to(acc), l.to(acc)
    out = torch.zeros(B, sq, H, D, dtype=acc, device=q.device)
    lse = torch.full((H, B, sq), NEG_INF, dtype=acc, device=q.device)  # [H, B*S] is varlen's layout
    for kind, where, window in calls:
        if kind == "dense":
            q0, q1, k0, k1 = where
            o, l = ops.dense_fwd(_bshd(q[..., q0:q1, :]), _bshd(k[..., k0:k1, :]), _bshd(v[..., k0:k1, :]), scale,
                                 *window)
            out[:, q0:q1] = o
            lse[:, :, q0:q1] = l.transpose(0, 1)
        else:
            iq, ik, cuq, cuk, mq, mk = _index(where, sq, sk, q.device)
            o, l = ops.varlen_fwd(_flat(q)[iq], _flat(k)[ik], _flat(v)[ik], cuq, cuk, mq, mk, scale, *window)
            out.view(B * sq, H, D).index_copy_(0, iq, o.to(acc))
            lse.view(H, B * sq).index_copy_(1, iq, l.to(acc))
    return out.transpose(1, 2), lse.transpose(0, 1)


def backward(ops: FlashOps, dout, q, k, v, out, lse, scale, m: BlockMask):
    """``dq, dk, dv`` in q/k/v's dtype; ``out``/``lse`` are the ring's merged ones."""
    B, H, sq, D = q.shape
    Hk, sk = k.shape[1], k.shape[2]
    dout, out, lse = dout.to(q.dtype), out.to(q.dtype), finite_lse(lse, acc_dtype(q))
    calls = flash_calls(m)
    if len(calls) == 1 and calls[0][0] == "dense" and calls[0][1] == (0, sq, 0, sk):
        gq, gk, gv = ops.dense_bwd(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, scale, *calls[0][2])
        return gq.transpose(1, 2), gk.transpose(1, 2), gv.transpose(1, 2)
    dq = torch.zeros(B, sq, H, D, dtype=q.dtype, device=q.device)
    dk = torch.zeros(B, sk, Hk, D, dtype=k.dtype, device=q.device)
    dv = torch.zeros(B, sk, Hk, D, dtype=v.dtype, device=q.device)
    for kind, where, window in calls:
        if kind == "dense":
            q0, q1, k0, k1 = where
            rows = slice(q0, q1)
            gq, gk, gv = ops.dense_bwd(_bshd(dout[..., rows, :]), _bshd(q[..., rows, :]), _bshd(k[..., k0:k1, :]),
                                       _bshd(v[..., k0:k1, :]), _bshd(out[..., rows, :]),
                                       lse[..., rows].contiguous(), scale, *window)
            dq[:, rows] += gq
            dk[:, k0:k1] += gk
            dv[:, k0:k1] += gv
        else:
            iq, ik, cuq, cuk, mq, mk = _index(where, sq, sk, q.device)
            lse_p = lse.permute(1, 0, 2).reshape(H, B * sq)[:, iq].contiguous()
            gq, gk, gv = ops.varlen_bwd(_flat(dout)[iq], _flat(q)[iq], _flat(k)[ik], _flat(v)[ik], _flat(out)[iq],
                                        lse_p, cuq, cuk, mq, mk, scale, *window)
            dq.view(B * sq, H, D).index_add_(0, iq, gq.to(q.dtype))
            dk.view(B * sk, Hk, D).index_add_(0, ik, gk.to(k.dtype))
            dv.view(B * sk, Hk, D).index_add_(0, ik, gv.to(v.dtype))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
