"""What a registered CP attention function is bound to (a leaf: imports nothing from the package)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionBinding:
    """What one registered CP attention function is closed over (never changes after setup)."""

    backend: str                       # "ulysses" | "ring" | "usp"
    inner: str                         # the model's own kernel: "sdpa", "eager", "flex_attention", ...
    cp_group: Any
    cp_rank: int
    cp_size: int
    ulysses_group: Any = None
    ring_group: Any = None
    ring_kernel: Any = None
    rotate: str = "alltoall"
    schedule: str = "ring"             # Ring's block schedule: "ring" (the rotation loop) | "distflash"
    name: str = ""
    inner_kernel: Any = None           # a flash inner's resolved kernel (attention.flash_kernels.FlashKernel)
    ledger: Any = None                 # the runtime's first-forward accounting (attention.accounting.Ledger)
    documents: bool = False            # load_balance="documents": batches carry a per-batch assignment

    def layouts(self) -> tuple[str, ...]:
        """Shard layouts this attention is exact for: the Ring loop plans with any layout the batch
        was cut with; the distflash schedule and Ulysses (and USP's Ulysses stage) need contiguous spans.
        A ``documents`` batch (length-aware, when the runtime was set up with ``load_balance="documents"``) runs
        its split documents in one of these and its whole ones locally."""
        static = ("contiguous", "head_tail") if self.backend == "ring" and self.schedule != "distflash" \
            else ("contiguous",)
        return static + (("documents",) if self.documents else ())
