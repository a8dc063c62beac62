"""Small helpers every ring block kernel shares: GQA expansion, group reduction, empty results,
equal head dims for fused ops (MLA), logit soft-capping."""

from __future__ import annotations

import torch

from .merge import acc_dtype

NEG_INF = float("-inf")


def expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, Hkv * groups, S, D]`` for kernels without native GQA."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_heads`: sum each KV head's query group."""
    if groups == 1:
        return dx
    B, H, S, D = dx.shape
    return dx.view(B, H // groups, groups, S, D).sum(dim=2)


def empty_result(q: torch.Tensor, dv: int | None = None):
    """``(out, lse)`` of a block no row can see into: zeros and ``-inf`` (the merge ignores it).
    ``dv``: the value head dim when it differs from the query's (MLA)."""
    shape = q.shape if dv is None else (*q.shape[:-1], dv)
    return (torch.zeros(shape, dtype=acc_dtype(q), device=q.device),
            torch.full(q.shape[:-1], NEG_INF, dtype=acc_dtype(q), device=q.device))


def finite_lse(lse: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A merged LSE for a backward kernel: a row no key sees anywhere has ``-inf``; any finite value
    gives it P = 0 (its scores are masked), and kernels must not see ``-inf - -inf``."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(dtype).contiguous()


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


class EqualHeadDims:
    """Fused ops (aten's flash/efficient ops, flash kernels) want one head dim for q, k and v; MLA
    (deepseek_v2/v3, minicpm3, ...) has query/key heads wider than value heads. Zero columns change
    neither the scores (q.k) nor the output's kept columns, and a zero-padded ``out``/``dout`` leaves
    the backward's ``delta = sum(dout * out)`` unchanged, so padding everything to the wider dim and
    slicing the results is exact."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        self.dk, self.dv = q.shape[-1], v.shape[-1]
        self.width = max(self.dk, self.dv)
        self.equal = self.dk == self.dv

    def inputs(self, q, k, v):
        if self.equal:
            return q, k, v
        return _pad_to(q, self.width), _pad_to(k, self.width), _pad_to(v, self.width)

    def outputs(self, out):
        """``out [..., width]`` -> ``[..., dv]`` (``pad`` widens ``out``/``dout`` back for a backward)."""
        return out if self.equal else out[..., :self.dv]

    def pad(self, x):
        return x if self.equal else _pad_to(x, self.width)

    def grads(self, dq, dk, dv):
        if self.equal:
            return dq, dk, dv
        return dq[..., :self.dk], dk[..., :self.dk], dv[..., :self.dv]


def capped(scores: torch.Tensor, softcap: float | None):
    """Gemma-2 logit soft-capping ``softcap * tanh(s / softcap)`` applied to ``scores`` (already scaled),
    and ``tanh`` for the backward (``d capped / d s = 1 - tanh^2``); ``(scores, None)`` without a cap."""
    if not softcap:
        return scores, None
    th = torch.tanh(scores / softcap)
    return th * softcap, th
