"""Sequence layouts (which global token positions each CP rank holds) and the distflash schedule.

``contiguous``: rank r holds the r-th of P equal slices.
``head_tail``: the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so
every rank gets the same amount of causal attention work (an early and a late chunk).
``distflash``: the *contiguous* layout (so recurrent layers and packed rows see one span per
rank), with the causal attention work balanced by the schedule instead of the cut
(:func:`distflash_schedule`, after DistFlashAttn, Li et al. 2023): ranks with little work
compute blocks for the ranks with much. Batches are cut contiguously; only Ring's attention
runs differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "head_tail")
SCHEDULES = ("contiguous", "head_tail", "distflash")   # what the work figures compare


def check_layout(layout: str) -> str:
    """The shard layout a name cuts batches in; ``distflash`` cuts contiguously (its balance is a schedule)."""
    aliases = {"none": "contiguous", "zigzag": "head_tail", "distflash": "contiguous"}
    layout = aliases.get(layout, layout)
    if layout == "documents":   # length-aware: a per-batch assignment (sharding.assignment), not a fixed cut
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown shard layout {layout!r}; use one of {', '.join(LAYOUTS)} or 'documents'")
    return layout


def chunks_per_rank(layout: str) -> int:
    layout = check_layout(layout)
    if layout == "documents":
        raise ValueError("a documents batch has no fixed cut: read its assignment (sharding.assignment)")
    return 2 if layout == "head_tail" else 1


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


# -- the distflash schedule ------------------------------------------------------------------

ALL, HEAD, TAIL = 0, 1, 2   # which query rows of a chunk a task covers: all, the first half, the second half


@dataclass(frozen=True)
class Task:
    """One block of causal attention: the queries of chunk ``q`` (rows ``part`` of it) against the
    keys/values of chunk ``kv`` (contiguous layout: chunk i is rank i's shard). ``q == kv`` is a
    diagonal block (the causal triangle)."""

    q: int
    kv: int
    part: int = ALL

    def rows(self, chunk: int) -> tuple[int, int]:
        """The query rows ``[start, stop)`` of the chunk this task covers."""
        half = chunk // 2
        return {ALL: (0, chunk), HEAD: (0, half), TAIL: (half, chunk)}[self.part]

    @property
    def diagonal(self) -> bool:
        return self.q == self.kv


def distflash_schedule(size: int) -> tuple[tuple[Task, ...], ...]:
    """``steps[s][r]``: the task rank ``r`` computes at step ``s``, every rank busy at every step.

    Step 0: every rank its diagonal ``(r, r)``. Then one step per offset ``t = 1 .. P//2``, which
    covers the pairs of offsets ``t`` and ``P - t`` (``P - t`` and ``t`` pairs: ``P`` together, one per
    rank): rank ``r >= t`` computes ``(r, r - t)`` with its own queries and the incoming K/V of
    rank ``r - t``; rank ``r < t`` computes ``(r + P - t, r)`` with its own K/V and the queries of
    rank ``r + P - t``, whose partial ``(out, lse)`` it sends back. For even ``P`` the offset ``P/2``
    has only ``P/2`` pairs: each pair's query rows are split in halves, the owner computing the
    first half and the K/V holder the second. Every rank then computes one diagonal and
    ``(P - 1) / 2`` full blocks: the causal work is balanced exactly, with every rank still
    holding one contiguous span.
    """
    if size < 1:
        raise ValueError(f"size={size} must be >= 1")
    P = size
    steps = [tuple(Task(r, r) for r in range(P))]
    for t in range(1, P // 2 + 1):
        if 2 * t == P:
            steps.append(tuple(Task(r, r - t, HEAD) if r >= t else Task(r + t, r, TAIL) for r in range(P)))
        else:
            steps.append(tuple(Task(r, r - t) if r >= t else Task(r + P - t, r) for r in range(P)))
    return tuple(steps)


@dataclass(frozen=True)
class Work:
    """Causal attention work per rank, in units of one ``(S/P) x (S/P)`` block."""

    layout: str
    size: int
    diagonal: str                 # "half": a diagonal block counts as its causal triangle; "full": as a block
    per_rank: tuple[float, ...]

    @property
    def max_over_mean(self) -> float:
        """1.0 is perfectly balanced; the slowest rank sets the step time."""
        return max(self.per_rank) / (sum(self.per_rank) / self.size)


def schedule_work(size: int, layout: str, diagonal: str = "half") -> Work:
    """Per-rank causal work of ``layout`` (``contiguous``, ``head_tail`` or ``distflash``) at ``size``
    ranks, counted block by block as each schedule computes them (a diagonal block as half a
    block, ``diagonal="half"``, or a whole one, ``"full"``)."""
    if diagonal not in ("half", "full"):
        raise ValueError(f"diagonal={diagonal!r}: use 'half' (the causal triangle) or 'full'")
    d = 0.5 if diagonal == "half" else 1.0
    P = size
    if layout == "distflash":
        per = [0.0] * P
        for step in distflash_schedule(P):
            for r, task in enumerate(step):
                per[r] += d if task.diagonal else (1.0 if task.part == ALL else 0.5)
    elif check_layout(layout) == "head_tail":
        # 2P half-size chunks (a block of them is a quarter block): chunk a sees a chunks before it and its diagonal
        per = [sum(a + d for a in shard_chunks("head_tail", P, r)) / 4 for r in range(P)]
    else:
        per = [r + d for r in range(P)]
    name = "distflash" if layout == "distflash" else check_layout(layout)
    return Work(name, P, diagonal, tuple(per))


def work_figure(seq_len: int, size: int, layout: str) -> float:
    """max/mean of causal attention work (query-key pairs, diagonal included) per rank: 1.0 is
    perfectly balanced. ``distflash`` counts the pairs each rank's schedule computes."""
    if layout == "distflash":
        check_divisible(seq_len, size, "contiguous")
        c = seq_len // size
        work = [0.0] * size
        for step in distflash_schedule(size):
            for r, task in enumerate(step):
                start, stop = task.rows(c)
                if task.diagonal:
                    work[r] += c * (c + 1) / 2
                else:
                    work[r] += (stop - start) * c
    else:
        work = []
        for r in range(size):
            pos = shard_positions(seq_len, size, r, layout)
            work.append(float((pos + 1).sum()))
    return max(work) / (sum(work) / size)
