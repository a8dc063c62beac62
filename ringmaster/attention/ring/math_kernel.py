"""The reference block kernel: dense scores in fp32 (fp64 for fp64), any device, any mask.

It materialises the block's ``[B, H, Sq, Sk]`` scores, so it runs only when asked for
(``ring_impl='math'``): the fused providers (``aten``, ``hf_kernels``) are the training paths.
"""

from __future__ import annotations

import torch

from ...config import RingImpl
from .common import NEG_INF, expand_heads, reduce_groups
from .masks import as_block_mask
from .merge import acc_dtype


class MathKernel:
    """Pure torch, any device and dtype; computes in fp32 (fp64 for fp64). The reference provider."""

    name = RingImpl.MATH

    def _probs(self, q, k, scale, mask, lse=None):
        dt = acc_dtype(q)
        s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
        m = as_block_mask(mask, q.shape[-2], k.shape[-2]).to_dense(q.device)
        if m is not None:
            s = s.masked_fill(~m, NEG_INF)
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        return p, lse

    def forward(self, q, k, v, scale, mask):
        g = q.shape[1] // k.shape[1]
        p, lse = self._probs(q, expand_heads(k, g), scale, mask)
        return torch.matmul(p, expand_heads(v, g).to(p.dtype)), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        g = q.shape[1] // k.shape[1]
        dt = acc_dtype(q)
        kx, vx = expand_heads(k, g).to(dt), expand_heads(v, g).to(dt)
        p, _ = self._probs(q, kx, scale, mask, lse=lse.to(dt))
        dout = dout.to(dt)
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, vx.transpose(-1, -2))
        delta = (dout * out.to(dt)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kx) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(dt)) * scale
        return dq.to(q.dtype), reduce_groups(dk, g).to(k.dtype), reduce_groups(dv, g).to(v.dtype)
