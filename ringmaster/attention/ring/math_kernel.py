"""The reference block kernel: dense scores in fp32 (fp64 for fp64), any device, any mask.

It materialises the block's ``[B, H, Sq, Sk]`` scores, so it runs only when asked for
(``ring_impl='math'``): the fused providers (``aten``, ``hf_kernels``) are the training paths.
A block mask with a relative bias (``rel_logits``, Inkling) makes its backward return a fourth
gradient, that of the block's ``rel_logits`` rows. It takes any head dims (MLA: value heads narrower than query/key heads) and Gemma-2's logit
soft-capping (``softcap``), forward and backward; ``aten`` on CPU runs its softcap blocks through
it per tile of query rows.
"""

from __future__ import annotations

import torch

from ...config import RingImpl
from .common import NEG_INF, capped, expand_heads, reduce_groups
from .masks import as_block_mask
from .merge import acc_dtype


class MathKernel:
    """Pure torch, any device and dtype; computes in fp32 (fp64 for fp64). The reference provider."""

    name = RingImpl.MATH

    def check(self, q, v, softcap=None) -> None:
        """Every head dim and softcap run here (the interface's refusal hook)."""

    def _probs(self, q, k, scale, mask, lse=None, softcap=None):
        dt = acc_dtype(q)
        s, th = capped(torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale, softcap)
        block = as_block_mask(mask, q.shape[-2], k.shape[-2])
        bias = block.bias(0, q.shape[-2], 0, k.shape[-2], q.device, dt)
        if bias is not None:  # ALiBi / relative bias: added to the scaled scores (its gradient is ds itself)
            s = s + bias
        m = block.to_dense(q.device)
        if m is not None:
            s = s.masked_fill(~m, NEG_INF)
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        return p, lse, th

    def forward(self, q, k, v, scale, mask, softcap=None):
        g = q.shape[1] // k.shape[1]
        p, lse, _ = self._probs(q, expand_heads(k, g), scale, mask, softcap=softcap)
        return torch.matmul(p, expand_heads(v, g).to(p.dtype)), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask, softcap=None):
        g = q.shape[1] // k.shape[1]
        dt = acc_dtype(q)
        kx, vx = expand_heads(k, g).to(dt), expand_heads(v, g).to(dt)
        p, _, th = self._probs(q, kx, scale, mask, lse=lse.to(dt), softcap=softcap)
        dout = dout.to(dt)
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, vx.transpose(-1, -2))
        delta = (dout * out.to(dt)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if th is not None:  # through the cap: d(cap * tanh(s / cap)) / ds = 1 - tanh^2
            ds = ds * (1 - th * th)
        dq = torch.matmul(ds, kx) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(dt)) * scale
        grads = dq.to(q.dtype), reduce_groups(dk, g).to(k.dtype), reduce_groups(dv, g).to(v.dtype)
        block = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if block.rel_logits is None:
            return grads
        # the relative bias's gradient: each score's ds lands on the profile column of its distance
        index, keep = block.rel_index(0, q.shape[-2], 0, k.shape[-2], q.device)
        index = index.expand(*ds.shape[:2], -1, -1)
        drel = torch.zeros(*ds.shape[:3], block.rel_logits.shape[-1], dtype=dt, device=q.device)
        drel.scatter_add_(-1, index, ds * keep.to(dt))
        return (*grads, drel)
