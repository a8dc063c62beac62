"""Sequence layouts: which global token positions each CP rank holds.

``contiguous``: rank r holds the r-th of P equal slices.
``head_tail``: the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so
every rank gets the same amount of causal attention work (an early and a late chunk).
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "head_tail")
DISTFLASH_REFUSAL = ("load_balance='distflash' is not implemented: head_tail already balances causal work to within "
                     "1% (balancers.work_figure); use load_balance='head_tail'")


def check_layout(layout: str) -> str:
    aliases = {"none": "contiguous", "zigzag": "head_tail"}
    layout = aliases.get(layout, layout)
    if layout == "distflash":
        raise ValueError(DISTFLASH_REFUSAL)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown shard layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if check_layout(layout) == "head_tail" else 1


def check_divisible(seq_len: int, size: int, layout: str) -> None:
    parts = size * chunks_per_rank(layout)
    if seq_len % parts:
        pad_to = -(-seq_len // parts) * parts
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {parts} "
            f"({'2 x ' if parts != size else ''}cp size {size}, layout {check_layout(layout)!r}); "
            f"pad the batch to {pad_to} tokens (labels -100 on the padding), e.g. the collator's "
            f"pad_to_multiple_of={parts}"
        )


def shard_chunks(layout: str, size: int, rank: int) -> list[int]:
    """Indices of the equal chunks (out of ``size * chunks_per_rank``) that ``rank`` holds, in order."""
    if check_layout(layout) == "head_tail":
        return [rank, 2 * size - 1 - rank]
    return [rank]


def shard_positions(seq_len: int, size: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global positions held by ``rank``, in the order its shard stores them."""
    check_divisible(seq_len, size, layout)
    n = chunks_per_rank(layout)
    chunk = seq_len // (size * n)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in shard_chunks(layout, size, rank)])


def gathered_positions(seq_len: int, size: int, layout: str, device=None) -> torch.Tensor:
    """Global position of each element after concatenating the shards of ranks 0..P-1."""
    return torch.cat([shard_positions(seq_len, size, r, layout, device) for r in range(size)])


def work_figure(seq_len: int, size: int, layout: str) -> float:
    """max/mean of causal attention work (query-key pairs) per rank: 1.0 is perfectly balanced."""
    work = []
    for r in range(size):
        pos = shard_positions(seq_len, size, r, layout)
        work.append(float((pos + 1).sum()))
    return max(work) / (sum(work) / size)
