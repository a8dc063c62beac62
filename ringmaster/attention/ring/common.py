"""Small helpers every ring block kernel shares: GQA expansion, group reduction, empty results."""

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


def empty_result(q: torch.Tensor):
    """``(out, lse)`` of a block no row can see into: zeros and ``-inf`` (the merge ignores it)."""
    return (torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device),
            torch.full(q.shape[:-1], NEG_INF, dtype=acc_dtype(q), device=q.device))


def finite_lse(lse: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A merged LSE for a backward kernel: a row no key sees anywhere has ``-inf``; any finite value
    gives it P = 0 (its scores are masked), and kernels must not see ``-inf - -inf``."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(dtype).contiguous()
