"""Rank-side job of tests/test_gpu_check.py: benchmarks/gpu_check.py's parity rows of the pool's CP size, run by the
script's own ``parity_job`` on the session pool's ranks (the pool's world is the CP group, as the script's ranks
are: ``rm.wire`` without a mesh)."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def parity_rows(ctx) -> list[dict]:
    import ringmaster as rm

    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import gpu_check

    try:
        return gpu_check.parity_job(ctx.rank, ctx.world, "cpu", gpu_check.parity_cases(ctx.world, True), True)
    finally:
        rm.teardown()
