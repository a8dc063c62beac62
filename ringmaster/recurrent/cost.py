"""``recurrent="auto"``, per layer: head-parallel where it sends no more than the state passing would.

What each strategy costs one rank per row of one recurrent layer, forward (backward sends the same again):

* ``heads`` sends the kernel's per-token inputs and its output, ``(S/P)(P-1)/P`` tokens of them (inputs read by a
  group of heads counted once per rank that reads them): O(S/P). It computes nothing extra, holds no maps for
  backward, and its kernel runs exactly as without CP (in bf16 too: ``docs/benchmarks.md``).
* ``scan`` all-gathers one map per rank, ``(P-1)`` maps, whatever S; it computes each chunk's map besides its
  outputs and holds the P maps until the layer's backward.
* ``sequential`` sends one state per hop, and the ranks wait for one another.

So wherever ``heads`` sends no more bytes than the state passing ``auto`` would pick, it is no worse on any count,
and ``auto`` picks it for that layer; elsewhere the state passing. The byte counts come from the layer itself:
``rm.wire``'s probe forward records the kernel's per-token inputs, its map and its state (:class:`LayerCost`), and
the choice is made per call from the row length the batch carries (host arithmetic, the same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import UnsupportedLayerError
from .heads import check_groups, check_heads

HEADS = "heads"


class CostRecorded(Exception):
    """Raised by a probe that only records costs (:func:`~.wiring.layer_costs`) once it has them: the layer's
    kernels never run (the model may be on the meta device, where a Triton or CUDA kernel cannot)."""


@dataclass(frozen=True)
class LayerCost:
    """One recurrent layer at CP size ``size``, per row: bytes of the kernel's inputs and output per token in heads
    form (``token_bytes``; None: the heads do not split over ``size``, with ``why``), of one map (``map_bytes``,
    what ``scan`` all-gathers) and of one state (``state_bytes``, what ``sequential`` sends per hop)."""

    size: int
    token_bytes: float | None
    map_bytes: float
    state_bytes: float
    why: str = ""

    def sent(self, strategy: str, seq_len: int) -> float | None:
        """Bytes one rank sends for this layer, forward, per row of ``seq_len`` tokens (None: not possible)."""
        P = self.size
        if strategy == HEADS:
            return None if self.token_bytes is None else seq_len / P * self.token_bytes * (P - 1) / P
        if strategy == "scan":
            return (P - 1) * self.map_bytes
        if strategy == "sequential":
            return self.state_bytes
        raise ValueError(f"recurrent strategy {strategy!r}: heads, scan or sequential")

    def heads_up_to(self, fallback: str) -> int:
        """The longest row (tokens, a multiple of the CP size) on which ``heads`` sends no more than ``fallback``;
        0 where the heads do not split."""
        if self.token_bytes is None or self.token_bytes <= 0 or self.size <= 1:
            return 0
        P = self.size
        longest = int(self.sent(fallback, 0) * P * P / ((P - 1) * self.token_bytes))
        return longest - longest % P

    def pick(self, seq_len: int, fallback: str) -> str:
        """``heads`` where it sends no more than ``fallback`` on a row of ``seq_len`` tokens, else ``fallback``."""
        return HEADS if 0 < seq_len <= self.heads_up_to(fallback) else fallback

    def describe(self, fallback: str) -> str:
        if self.token_bytes is None:
            return f"{fallback} ({self.why})"
        if self.heads_up_to(fallback) == 0:
            return f"{fallback} (heads would send more on any row)"
        return f"heads on rows up to {self.heads_up_to(fallback)} tokens, {fallback} on longer ones"


def per_token_bytes(tensors: Sequence[torch.Tensor], out: torch.Tensor, shared: dict[int, int], size: int) -> float:
    """Bytes per token of ``tensors`` (each ``[b, l, ...]``) and ``out`` in heads form: an input read by ``G`` groups
    of heads (``shared``: index -> G) sent once per rank that reads it when ``G < size``."""
    total = 0.0
    for i, t in enumerate([*tensors, out]):
        per = t.element_size() * t[0, 0].numel()
        G = shared.get(i) if i < len(tensors) else None
        total += per * (size / G if G is not None and G < size else 1)
    return total


def layer_cost(path: str, size: int, segment, tensors: Sequence[torch.Tensor], out: torch.Tensor, heads: int,
               shared: dict[int, tuple[int, str]] | None = None) -> LayerCost:
    """What the probe forward of a layer records for ``auto``: ``segment`` (its :class:`~.scan.Segment`: the map
    and the state, per row), the kernel's per-token ``tensors`` and output ``out`` in the form heads would move
    them, ``heads`` the head (or channel) count the CP size must divide, ``shared``: index -> (groups, what)."""
    shared = shared or {}
    rows = out.shape[0]
    shape, dtype, _ = segment.state_meta()
    size_of = torch.empty((), dtype=dtype).element_size()   # maps and states: fp32, or fp64 for a float64 model
    state = torch.Size(shape).numel() * size_of
    map_bytes = torch.Size(segment.map_meta()).numel() * size_of / rows
    try:
        check_heads(path, "heads", heads, size)
        for G, what in shared.values():
            check_groups(path, heads, G, size, what)
    except UnsupportedLayerError as e:
        return LayerCost(size, None, map_bytes, state / rows, why=str(e).split(": ", 1)[-1].split(";")[0])
    return LayerCost(size, per_token_bytes(tensors, out, {i: g for i, (g, _) in shared.items()}, size), map_bytes,
                     state / rows)
