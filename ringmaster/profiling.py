"""Measure what CP costs: bytes and time per collective, saved-activation and peak memory."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

_COMM_PROFILERS: list["CommProfile"] = []


@dataclass
class CommRecord:
    kind: str          # "all_to_all", "all_gather", "reduce_scatter", "send", "recv", ...
    phase: str         # "forward" | "backward"
    bytes_sent: int    # bytes this rank put on the wire (the share kept locally is not counted)
    seconds: float
    tag: str = ""


@dataclass
class CommProfile:
    records: list[CommRecord] = field(default_factory=list)

    def total_bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes_sent for r in self.records
                   if (kind is None or r.kind == kind) and (phase is None or r.phase == phase))

    def summary(self) -> dict[tuple[str, str], dict[str, float]]:
        out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "seconds": 0.0})
        for r in self.records:
            row = out[(r.kind, r.phase)]
            row["calls"] += 1
            row["bytes"] += r.bytes_sent
            row["seconds"] += r.seconds
        return dict(out)


def record_comm(kind: str, phase: str, bytes_sent: int, seconds: float, tag: str = "") -> None:
    for prof in _COMM_PROFILERS:
        prof.records.append(CommRecord(kind, phase, int(bytes_sent), seconds, tag))


def comms_enabled() -> bool:
    return bool(_COMM_PROFILERS)


@contextlib.contextmanager
def timed_comm(kind: str, phase: str, bytes_sent: int, tag: str = ""):
    if not _COMM_PROFILERS:
        yield
        return
    start = time.perf_counter()
    yield
    record_comm(kind, phase, bytes_sent, time.perf_counter() - start, tag)


@contextlib.contextmanager
def profile_comms():
    """Collect every ringmaster collective issued inside the block (forward and backward)."""
    prof = CommProfile()
    _COMM_PROFILERS.append(prof)
    try:
        yield prof
    finally:
        _COMM_PROFILERS.remove(prof)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class MemoryProfile:
    saved_bytes: int = 0            # bytes of tensors autograd saved for backward inside the block
    peak_saved_bytes: int = 0
    peak_rss_bytes: int = 0
    cuda_peak_bytes: int | None = None


@contextlib.contextmanager
def profile_memory():
    """Peak memory of the block: saved-for-backward bytes (every device), the CUDA allocator peak
    when on GPU, and the process peak RSS on CPU. Saved bytes count each storage once."""
    prof = MemoryProfile()
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            key = id(t)
        if key not in seen:
            seen.add(key)
            prof.saved_bytes += t.untyped_storage().nbytes() if t.layout == torch.strided else t.numel() * t.element_size()
            prof.peak_saved_bytes = max(prof.peak_saved_bytes, prof.saved_bytes)
        return t

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield prof
    if cuda:
        prof.cuda_peak_bytes = torch.cuda.max_memory_allocated()
    prof.peak_rss_bytes = peak_rss_bytes()
