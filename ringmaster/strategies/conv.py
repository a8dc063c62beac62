"""Causal depthwise conv1d under CP: each chunk gets a halo of ``kernel_size - 1`` inputs.

The halo is the last ``kernel_size - 1`` conv inputs (after the padding mask, before the
conv) of the chunk before it in *sequence order*, zeros for the first chunk. With a
``head_tail`` layout a rank's two chunks take their halos from two different ranks, so the
tails of every chunk travel in one small all-gather (``P · chunks · (k-1)`` columns, tiny next
to any attention layer); its backward (reduce-scatter) returns each halo's gradient to the
rank whose inputs it was. The conv itself is the model's own kernel (``causal-conv1d`` on GPU
when installed, the transformers torch fallback on CPU), run on ``[halo | chunk]`` with the
first ``kernel_size - 1`` outputs dropped.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .state_passing import chunk_ids, split_local, tie


def _tail(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` columns of ``x [..., L]``, left-padded with zeros when ``L < width``."""
    t = x[..., max(0, x.shape[-1] - width):]
    if t.shape[-1] < width:
        t = torch.cat([t.new_zeros(*t.shape[:-1], width - t.shape[-1]), t], dim=-1)
    return t


def halos_from_tails(tails: Sequence[torch.Tensor], lengths: Sequence[int], width: int) -> list[torch.Tensor]:
    """``tails[c]``: chunk c's zero-padded tail (sequence order), ``lengths[c]`` its length.
    Returns the halo entering every chunk: the last ``width`` real inputs before it (zeros first)."""
    halos = []
    for c in range(len(tails)):
        parts, have = [], 0
        for j in range(c - 1, -1, -1):
            if have >= width:
                break
            valid = min(lengths[j], width)
            if valid:
                parts.append(tails[j][..., width - valid:])
                have += valid
        ref = tails[c]
        halo = torch.cat(parts[::-1], dim=-1) if parts else ref.new_zeros(*ref.shape[:-1], 0)
        halos.append(_tail(halo, width))
    return halos


def exchange_halos(chunks: Sequence[torch.Tensor], width: int, group, layout: str,
                   lengths: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Halos for this rank's ``chunks`` (storage order, each ``[..., L_j]``).

    ``lengths``: every chunk's length in *sequence order* over the whole group; default: all
    chunks as long as this rank's (the equal split :func:`ringmaster.shard.shard_tensor` makes)."""
    from ..comm import all_gather

    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(chunks):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(chunks)}")
    if lengths is None:
        lengths = [chunks[0].shape[-1]] * (P * len(ids))
    stacked = torch.stack([_tail(c, width) for c in chunks])          # [n, ..., width]
    gathered = all_gather(stacked, group, tag="conv_halo")            # [P, n, ..., width]
    tails = [None] * (P * len(ids))
    for r in range(P):
        for j, c in enumerate(chunk_ids(layout, P, r)):
            tails[c] = gathered[r, j]
    halos = halos_from_tails(tails, lengths, width)
    mine = [halos[c] for c in ids]
    mine[0] = tie(mine[0], gathered)  # the first rank uses no tail, but must join the backward collective
    return mine


def conv_with_halo(kernel: Callable, x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor, bias=None,
                   activation=None, **kwargs) -> torch.Tensor:
    """The model's own causal conv on ``[halo | x]``, first ``halo`` outputs dropped."""
    width = halo.shape[-1]
    out = kernel(torch.cat([halo.to(x.dtype), x], dim=-1), weight, bias, activation=activation, **kwargs)
    return out[..., width:]


def cp_causal_conv1d(kernel: Callable, x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, *,
                     group, layout: str, lengths: Sequence[int] | None = None, **kwargs) -> torch.Tensor:
    """``causal_conv1d_fn`` for a CP shard ``x [b, c, l]`` (``weight [c, k]``), exact across ranks."""
    width = weight.shape[-1] - 1
    if group is None or dist.get_world_size(group) == 1 or width == 0:
        return kernel(x, weight, bias, activation=activation, **kwargs)
    n = len(chunk_ids(layout, dist.get_world_size(group), dist.get_rank(group)))
    chunks = split_local(x, n, dim=-1)
    halos = exchange_halos(chunks, width, group, layout, lengths)
    outs = [conv_with_halo(kernel, c, h, weight, bias, activation, **kwargs) for c, h in zip(chunks, halos)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
