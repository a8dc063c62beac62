"""The attention work CP issues: query-key pairs handed to a kernel, counted for benchmarks and tests.

A subscriber (``with counting() as tally:``) sees every kernel call the Ulysses sdpa tiles and the ring's block
pairs issue, eager or inside ``torch.ops.ringmaster.*`` when compiled: ``tally["pairs"]`` sums rows x heads x
queries x keys of each call's region (before a kernel trims masked tiles). Nothing is counted while tracing, and
nothing at all when nobody subscribes. Process-level subscribers (as :mod:`ringmaster.comm`'s timing hooks), not
per-batch state.
"""

from __future__ import annotations

import contextlib

import torch

_TALLIES: list[dict] = []


@contextlib.contextmanager
def counting():
    """Count the attention work issued inside the block: yields ``{"pairs": int, "calls": int}``."""
    tally = {"pairs": 0, "calls": 0}
    _TALLIES.append(tally)
    try:
        yield tally
    finally:
        _TALLIES.remove(tally)


def issued(q: torch.Tensor, k: torch.Tensor) -> None:
    """One kernel call of q ``[B, H, Sq, D]`` against k ``[B, Hk, Sk, D]``."""
    if not _TALLIES or torch.compiler.is_compiling():
        return
    pairs = q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2]
    for tally in _TALLIES:
        tally["pairs"] += pairs
        tally["calls"] += 1
