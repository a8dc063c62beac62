"""The arithmetic of the CPU flash stand-in: tiled attention forward/backward on torch ops.

Why it exists: CI has no GPU, yet the flash paths (Ulysses with a hub kernel, Ring with the
hub block kernels) must run end to end against the non-CP model. This module computes what a
flash kernel computes, with the same conventions, so a code path that is right with it is right
with the real kernel's *interface* (the real kernel's numerics are checked on a GPU only):

- layout q ``[Sq, H, D]``, k/v ``[Sk, Hk, D]`` per sequence, GQA by head groups (query head
  ``h`` reads kv head ``h // (H // Hk)``);
- causal masks aligned **bottom-right** (query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``),
  windows ``(left, right)`` around that same diagonal, ``-1`` meaning unbounded;
- softcap ``s = cap * tanh(s / cap)`` before the softmax; alibi ``-slope * |i + Sk - Sq - j|``;
- an optional sink logit per head (``s_aux``) that joins the softmax denominator only;
- LSE ``[H, Sq]`` in fp32 (fp64 for fp64 inputs), ``+inf`` for a row that sees nothing (its
  output is 0), as the real kernels write it;
- the backward is the flash backward from ``(out, lse)``: ``P = exp(S - lse)``,
  ``dS = P * (dP - rowsum(dout * out))``; it never differentiates the forward.

Memory: queries are processed ``TILE`` rows at a time against the keys a tile can see, so the
largest temporary is ``[H, TILE, Sk]``; nothing ``[Sq, Sk]`` is built for long sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TILE = 128


@dataclass(frozen=True)
class Mask:
    """What one call masks: causal flag, window (left, right; -1 unbounded), softcap, alibi."""

    causal: bool = False
    left: int = -1
    right: int = -1
    softcap: float = 0.0

    def normalized(self, sk: int) -> "Mask":
        """The flash kernels' own normalisation: causal means right = 0; a window at least as
        long as the keys is no window."""
        left = -1 if self.left is None or self.left < 0 or self.left >= sk else int(self.left)
        right = -1 if self.right is None or self.right < 0 or self.right >= sk else int(self.right)
        if self.causal:
            right = 0
        return Mask(causal=self.causal, left=left, right=right, softcap=float(self.softcap or 0.0))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (exact tests); everything else computes in fp32, as the kernels do."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_range(t0: int, t1: int, sq: int, sk: int, m: Mask) -> tuple[int, int]:
    """Keys that queries ``t0..t1-1`` can see (a superset): the tile's band around the diagonal."""
    shift = sk - sq
    lo = 0 if m.left < 0 else max(0, t0 + shift - m.left)
    hi = sk if m.right < 0 else min(sk, t1 - 1 + shift + m.right + 1)
    return lo, max(lo, hi)


def _visible(t0: int, t1: int, lo: int, hi: int, sq: int, sk: int, m: Mask, device) -> torch.Tensor | None:
    """Bool ``[t1-t0, hi-lo]``: key ``j`` visible to query ``i``; None when all are."""
    if m.left < 0 and m.right < 0:
        return None
    rel = (torch.arange(lo, hi, device=device)[None, :]
           - torch.arange(t0, t1, device=device)[:, None] - (sk - sq))
    ok = torch.ones_like(rel, dtype=torch.bool)
    if m.right >= 0:
        ok &= rel <= m.right
    if m.left >= 0:
        ok &= rel >= -m.left
    return ok


def _scores(qt, kc, scale, m: Mask, alibi, t0, t1, lo, hi, sq, sk):
    """Scores ``[Hk, G, tq, tk]`` after scale, softcap and alibi; also tanh for the backward."""
    s = torch.einsum("qhgd,khd->hgqk", qt, kc[lo:hi]) * scale
    th = None
    if m.softcap > 0:
        th = torch.tanh(s / m.softcap)
        s = th * m.softcap
    if alibi is not None:
        rel = (torch.arange(lo, hi, device=s.device)[None, :]
               - torch.arange(t0, t1, device=s.device)[:, None] - (sk - sq)).abs().to(s.dtype)
        s = s - alibi[:, :, None, None] * rel
    return s, th


def forward(q, k, v, scale: float, mask: Mask, alibi=None, sink=None, tile: int = TILE):
    """One sequence: q ``[Sq,H,D]``, k ``[Sk,Hk,D]``, v ``[Sk,Hk,Dv]`` -> (out ``[Sq,H,Dv]`` in
    the compute dtype, lse ``[H,Sq]``). ``alibi``/``sink``: ``[H]`` or None."""
    sq, h, d = q.shape
    sk, hk, dv = v.shape
    g = h // hk
    ct = compute_dtype(q.dtype)
    m = mask.normalized(sk)
    qc = q.to(ct).reshape(sq, hk, g, d)
    kc, vc = k.to(ct), v.to(ct)
    al = None if alibi is None else alibi.to(ct).reshape(hk, g)
    sk_ = None if sink is None else sink.to(ct).reshape(hk, g, 1)
    out = torch.zeros(sq, hk, g, dv, dtype=ct, device=q.device)
    lse = torch.full((hk, g, sq), math.inf, dtype=ct, device=q.device)
    for t0 in range(0, sq, tile):
        t1 = min(sq, t0 + tile)
        lo, hi = _key_range(t0, t1, sq, sk, m)
        if hi <= lo:
            if sk_ is not None:
                lse[:, :, t0:t1] = sk_
            continue
        s, _ = _scores(qc[t0:t1], kc, scale, m, al, t0, t1, lo, hi, sq, sk)
        vis = _visible(t0, t1, lo, hi, sq, sk, m, q.device)
        if vis is not None:
            s = s.masked_fill(~vis, -math.inf)
        l = torch.logsumexp(s, dim=-1)
        if sk_ is not None:
            l = torch.logaddexp(l, sk_)
        l = torch.where(l == -math.inf, torch.full_like(l, math.inf), l)
        p = torch.exp(s - l[..., None])
        out[t0:t1] = torch.einsum("hgqk,khd->qhgd", p, vc[lo:hi])
        lse[:, :, t0:t1] = l
    return out.reshape(sq, h, dv), lse.reshape(h, sq)


def backward(dout, q, k, v, out, lse, scale: float, mask: Mask, alibi=None, sink=None, tile: int = TILE,
             dlse=None):
    """The flash backward of one sequence from the forward's ``out`` and ``lse`` (which may be
    those of a larger merged attention: each block's share is then exact). ``dlse`` ``[H,Sq]``:
    a gradient reaching the LSE too (FA4's ``return_lse``), ``dS += P * dlse``. Returns
    (dq, dk, dv, dsink) in the compute dtype; dsink is None without a sink. A row whose LSE is
    ``+inf`` or ``-inf`` saw nothing and gets no gradient."""
    sq, h, d = q.shape
    sk, hk, dvd = v.shape
    g = h // hk
    ct = compute_dtype(q.dtype)
    m = mask.normalized(sk)
    qc = q.to(ct).reshape(sq, hk, g, d)
    kc, vc = k.to(ct), v.to(ct)
    do = dout.to(ct).reshape(sq, hk, g, dvd)
    delta = (do * out.to(ct).reshape(sq, hk, g, dvd)).sum(-1).permute(1, 2, 0)  # [Hk,G,Sq]
    if dlse is not None:
        delta = delta - dlse.to(ct).reshape(hk, g, sq)
    lsec = lse.to(ct).reshape(hk, g, sq)
    lsec = torch.where(lsec == -math.inf, torch.full_like(lsec, math.inf), lsec)
    al = None if alibi is None else alibi.to(ct).reshape(hk, g)
    dq = torch.zeros(sq, hk, g, d, dtype=ct, device=q.device)
    dk = torch.zeros(sk, hk, d, dtype=ct, device=q.device)
    dv = torch.zeros(sk, hk, dvd, dtype=ct, device=q.device)
    dsink = None
    if sink is not None:
        psink = torch.exp(sink.to(ct).reshape(hk, g, 1) - lsec)
        dsink = -(psink * delta).sum(-1).reshape(h)
    for t0 in range(0, sq, tile):
        t1 = min(sq, t0 + tile)
        lo, hi = _key_range(t0, t1, sq, sk, m)
        if hi <= lo:
            continue
        s, th = _scores(qc[t0:t1], kc, scale, m, al, t0, t1, lo, hi, sq, sk)
        vis = _visible(t0, t1, lo, hi, sq, sk, m, q.device)
        if vis is not None:
            s = s.masked_fill(~vis, -math.inf)
        p = torch.exp(s - lsec[:, :, t0:t1, None])
        dot = do[t0:t1]
        dv[lo:hi] += torch.einsum("hgqk,qhgd->khd", p, dot)
        dp = torch.einsum("qhgd,khd->hgqk", dot, vc[lo:hi])
        ds = p * (dp - delta[:, :, t0:t1, None])
        if th is not None:
            ds = ds * (1 - th * th)
        dq[t0:t1] = torch.einsum("hgqk,khd->qhgd", ds, kc[lo:hi]) * scale
        dk[lo:hi] += torch.einsum("hgqk,qhgd->khd", ds, qc[t0:t1]) * scale
    return dq.reshape(sq, h, d), dk, dv, dsink


def softmax_d(dout, out) -> torch.Tensor:
    """``rowsum(dout * out)`` as ``[..., H, S]`` from ``[..., S, H, D]`` (what the kernels return)."""
    return (dout.float() * out.float()).sum(-1).transpose(-1, -2).contiguous()


# --- batched and varlen drivers -------------------------------------------------------------

def _alibi_row(alibi, b):
    if alibi is None:
        return None
    return alibi[b] if alibi.dim() == 2 else alibi


def forward_batched(q, k, v, scale, mask, alibi=None, sink=None):
    """q ``[B,Sq,H,D]`` -> (out ``[B,Sq,H,Dv]`` in q's dtype, lse ``[B,H,Sq]``)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, l = forward(q[b], k[b], v[b], scale, mask, _alibi_row(alibi, b), sink)
        outs.append(o.to(q.dtype))
        lses.append(l)
    return torch.stack(outs), _lse_dtype(torch.stack(lses), q)


def backward_batched(dout, q, k, v, out, lse, scale, mask, alibi=None, sink=None, dlse=None):
    dqs, dks, dvs, dsink = [], [], [], None
    for b in range(q.shape[0]):
        dq, dk, dv, ds = backward(dout[b], q[b], k[b], v[b], out[b], lse[b], scale, mask,
                                  _alibi_row(alibi, b), sink, dlse=None if dlse is None else dlse[b])
        dqs.append(dq), dks.append(dk), dvs.append(dv)
        if ds is not None:
            dsink = ds if dsink is None else dsink + ds
    return torch.stack(dqs), torch.stack(dks), torch.stack(dvs), dsink


def _bounds(cu) -> list[int]:
    return [int(x) for x in cu.tolist()]


def forward_varlen(q, k, v, cu_q, cu_k, scale, mask, alibi=None, sink=None):
    """Packed q ``[Tq,H,D]``, k/v ``[Tk,Hk,D]``, documents ``cu_q``/``cu_k`` ->
    (out ``[Tq,H,Dv]``, lse ``[H,Tq]``). Rows past ``cu_q[-1]`` stay 0 (lse +inf)."""
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    if len(bq) != len(bk):
        raise ValueError(f"cu_seqlens_q has {len(bq)} entries and cu_seqlens_k {len(bk)}: they must match")
    ct = compute_dtype(q.dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=ct, device=q.device)
    for i in range(len(bq) - 1):
        a, b, c, e = bq[i], bq[i + 1], bk[i], bk[i + 1]
        if b <= a:
            continue
        if e <= c:
            if sink is not None:
                lse[:, a:b] = sink.to(ct)[:, None]
            continue
        o, l = forward(q[a:b], k[c:e], v[c:e], scale, mask, _alibi_row(alibi, i), sink)
        out[a:b] = o.to(q.dtype)
        lse[:, a:b] = l
    return out, _lse_dtype(lse, q)


def backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, scale, mask, alibi=None, sink=None, dlse=None):
    bq, bk = _bounds(cu_q), _bounds(cu_k)
    ct = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    dsink = None if sink is None else torch.zeros(q.shape[1], dtype=ct, device=q.device)
    for i in range(len(bq) - 1):
        a, b, c, e = bq[i], bq[i + 1], bk[i], bk[i + 1]
        if b <= a:
            continue
        if e <= c:
            if sink is not None:  # a sink-only row: its output is 0, d sink = -p_sink * delta
                delta = (dout[a:b].to(ct) * out[a:b].to(ct)).sum(-1).T
                if dlse is not None:
                    delta = delta - dlse[:, a:b].to(ct)
                dsink -= (torch.exp(sink.to(ct)[:, None] - lse[:, a:b].to(ct)) * delta).sum(-1)
            continue
        g = backward(dout[a:b], q[a:b], k[c:e], v[c:e], out[a:b], lse[:, a:b], scale, mask,
                     _alibi_row(alibi, i), sink, dlse=None if dlse is None else dlse[:, a:b])
        dq[a:b], dk[c:e], dv[c:e] = g[0], g[1], g[2]
        if g[3] is not None:
            dsink += g[3]
    return dq, dk, dv, dsink


def _lse_dtype(lse, q):
    """fp32 as the kernels write it; fp64 inputs keep fp64 so exactness tests stay exact."""
    return lse if q.dtype == torch.float64 else lse.float()


class Attention(torch.autograd.Function):
    """Differentiable wrapper used by the ``flash_attn_*func`` entry points.

    ``sink_grad`` False mirrors kernels whose backward returns no sink gradient (vllm's FA3);
    ``lse_grad`` True lets a gradient reach the LSE (FA4 with ``return_lse``), otherwise the LSE is
    non-differentiable as in FA2/FA3."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_q, cu_k, scale, mask, alibi, sink_grad, lse_grad=False, empty_lse=math.inf):
        if cu_q is None:
            out, lse = forward_batched(q, k, v, scale, mask, alibi, sink)
        else:
            out, lse = forward_varlen(q, k, v, cu_q, cu_k, scale, mask, alibi, sink)
        if empty_lse != math.inf:
            lse = torch.where(lse == math.inf, torch.full_like(lse, empty_lse), lse)
        ctx.save_for_backward(q, k, v, out, lse, sink, cu_q, cu_k, alibi)
        ctx.scale, ctx.mask, ctx.sink_grad = scale, mask, sink_grad
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, cu_q, cu_k, alibi = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if cu_q is None:
            dq, dk, dv, ds = backward_batched(dout, q, k, v, out, lse, ctx.scale, ctx.mask, alibi, sink, dlse)
        else:
            dq, dk, dv, ds = backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.mask,
                                             alibi, sink, dlse)
        dsink = None
        if sink is not None and ctx.sink_grad and ctx.needs_input_grad[3]:
            dsink = ds.to(sink.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink,
                None, None, None, None, None, None, None, None)


def default_scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def refuse_set(**extras):
    """Refuse every keyword the caller set (not None): arguments the stand-in does not implement."""
    for name, value in extras.items():
        if value is not None:
            refuse(name, "<set>")


def flash_mask(causal, left, right, softcap) -> "Mask":
    """The :class:`Mask` of a flash call's ``causal``/``window_size_left/right`` (None = unbounded)/``softcap``."""
    return Mask(causal=bool(causal), left=-1 if left is None else left,
                right=-1 if right is None else right, softcap=softcap or 0.0)


def refuse(name: str, value, why: str = "the CPU flash stand-in does not implement it"):
    raise NotImplementedError(f"{name}={value!r}: {why}")
