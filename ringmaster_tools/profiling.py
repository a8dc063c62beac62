"""Measure what CP costs: bytes and time per collective, saved-activation and peak memory.

``profile_comms()`` records every collective ringmaster issues inside the block: its kind
(``all_to_all``, ``p2p`` = one isend/irecv pair of the ring, ``send``/``recv`` of sequential
state passing, ``all_gather``, ``reduce_scatter``), the autograd phase (``forward`` /
``backward``), the bytes this rank put on the wire (the share a collective keeps locally is
not counted), the wall time of the call, and a tag that says who issued it. The tag gives the
**layer kind**: ``attention`` (Ulysses / Ring / USP), ``recurrent`` (state passing and
causal-conv halos of Mamba2 / gated-DeltaNet layers) or ``other`` (e.g. ``gather_sequence``).

Tag convention: ``"<layer kind>:<name>"`` names the layer kind explicitly (``"attention:my_op"``);
a plain tag is looked up by its prefix (:data:`TAG_LAYER_KINDS`, extend with
:func:`register_tag_prefix`): ``ulysses_*``, ``ring_*``, ``usp_*`` are attention,
``state_passing``, ``conv_halo`` recurrent.

``profile_memory()`` measures one rank (one process): the bytes of tensors autograd saved for
backward inside the block (saved-tensor hooks, each storage once), the CUDA allocator peak on
GPU, and on CPU the process's peak RSS over the block (Linux: the high-water mark is reset at
entry through ``/proc/self/clear_refs``; elsewhere it is the process lifetime peak).
``gather_profiles(prof)`` collects one profile per rank of a group.

``count_collectives()`` counts bytes of *any* code's collectives at the c10d op level (a dispatch
mode over the ``c10d`` and ``_c10d_functional`` ops), so other libraries, DTensor and functional
collectives are measured with the same convention as ringmaster's own records.

``record_collectives()`` keeps each rank's collectives in the order it issued them (op, phase, group,
shapes, dtype, peer, splits, tag) and ``check_order(logs)`` says whether a group's sequences match one to one
(every rank issues the same collectives in the same order; each send meets its receive).
"""

from __future__ import annotations

import contextlib
import functools
import resource
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch

from ringmaster.comm import _RECORDERS, point_to_point, recording, timed_comm  # noqa: F401  (timed_comm: kept for old imports)


PHASES = ("forward", "backward")
LAYER_KINDS = ("attention", "recurrent", "other")

# collective kind -> how tables print it
KIND_LABELS = {
    "all_to_all": "all-to-all",
    "p2p": "p2p send/recv",
    "send": "p2p send",
    "recv": "p2p recv",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "gather": "gather",
    "reduce": "reduce",
}

# tag prefix -> layer kind (longest prefix wins; a tag matches "p", "p_*", "p.*" or "p:*")
TAG_LAYER_KINDS: dict[str, str] = {
    "attention": "attention",
    "attn": "attention",
    "ulysses": "attention",
    "ring": "attention",
    "usp": "attention",
    "recurrent": "recurrent",
    "state_passing": "recurrent",
    "conv_halo": "recurrent",
    "mamba": "recurrent",
    "gated_deltanet": "recurrent",
    "linear_attn": "recurrent",
    "heads": "recurrent",   # recurrent="heads": the all-to-alls to whole rows and back (heads_in / heads_out)
    "other": "other",
    "gather_sequence": "other",
}


def register_tag_prefix(prefix: str, layer_kind: str) -> None:
    """Count collectives whose tag starts with ``prefix`` as ``layer_kind`` (attention/recurrent/other)."""
    if layer_kind not in LAYER_KINDS:
        raise ValueError(f"layer_kind={layer_kind!r} is not one of {LAYER_KINDS}")
    TAG_LAYER_KINDS[prefix] = layer_kind


@functools.lru_cache(maxsize=1024)
def _layer_kind_cached(tag: str, _version: int) -> str:
    head, sep, _ = tag.partition(":")
    if sep and head in LAYER_KINDS:
        return head
    best, kind = -1, "other"
    for prefix, value in TAG_LAYER_KINDS.items():
        if (tag == prefix or tag.startswith((prefix + "_", prefix + ".", prefix + ":"))) and len(prefix) > best:
            best, kind = len(prefix), value
    return kind


def layer_kind(tag: str) -> str:
    """``"attention"``, ``"recurrent"`` or ``"other"`` for a collective's tag."""
    return _layer_kind_cached(tag or "", hash(tuple(sorted(TAG_LAYER_KINDS.items()))))


def _dist_rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


@dataclass
class CommRecord:
    kind: str          # "all_to_all", "all_gather", "reduce_scatter", "p2p", "send", "recv", ...
    phase: str         # "forward" | "backward"
    bytes_sent: int    # bytes this rank put on the wire (the share kept locally is not counted)
    seconds: float
    tag: str = ""

    @property
    def layer_kind(self) -> str:
        return layer_kind(self.tag)


def _stat() -> dict[str, float]:
    return {"calls": 0, "bytes": 0, "seconds": 0.0}


@dataclass
class CommProfile:
    """Collectives of one rank. Filters: ``kind``, ``phase``, ``layer_kind``, ``tag``."""

    records: list[CommRecord] = field(default_factory=list)
    rank: int | None = None

    def select(self, kind: str | None = None, phase: str | None = None, layer_kind: str | None = None,
               tag: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (kind is None or r.kind == kind) and (phase is None or r.phase == phase)
                and (layer_kind is None or r.layer_kind == layer_kind) and (tag is None or r.tag == tag)]

    def total_bytes(self, kind: str | None = None, phase: str | None = None, layer_kind: str | None = None,
                    tag: str | None = None) -> int:
        return sum(r.bytes_sent for r in self.select(kind, phase, layer_kind, tag))

    def total_seconds(self, kind: str | None = None, phase: str | None = None, layer_kind: str | None = None,
                      tag: str | None = None) -> float:
        return sum(r.seconds for r in self.select(kind, phase, layer_kind, tag))

    def calls(self, kind: str | None = None, phase: str | None = None, layer_kind: str | None = None,
              tag: str | None = None) -> int:
        return len(self.select(kind, phase, layer_kind, tag))

    def summary(self, by: Iterable[str] = ("kind", "phase")) -> dict[tuple, dict[str, float]]:
        """``{(value of each field in by): {"calls", "bytes", "seconds"}}``; fields are record
        attributes: ``kind``, ``phase``, ``layer_kind``, ``tag``. The default groups by (kind, phase)."""
        by = tuple(by)
        out: dict[tuple, dict[str, float]] = defaultdict(_stat)
        for r in self.records:
            row = out[tuple(getattr(r, f) for f in by)]
            row["calls"] += 1
            row["bytes"] += r.bytes_sent
            row["seconds"] += r.seconds
        return dict(out)

    def _nested(self, key: str) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (value, phase), stat in sorted(self.summary((key, "phase")).items()):
            out.setdefault(value, {p: _stat() for p in PHASES})[phase] = stat
        return out

    def by_kind(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{collective kind: {"forward": stat, "backward": stat}}``, stat = ``{"calls", "bytes", "seconds"}``."""
        return self._nested("kind")

    def by_layer_kind(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{"attention" | "recurrent" | "other": {"forward": stat, "backward": stat}}``."""
        return self._nested("layer_kind")

    def by_tag(self) -> dict[str, dict[str, dict[str, float]]]:
        return self._nested("tag")

    def rows(self) -> list[dict]:
        """One row per (layer kind, collective kind): calls, bytes and seconds forward and backward."""
        rows: dict[tuple[str, str], dict] = {}
        for (lk, kind, phase), stat in self.summary(("layer_kind", "kind", "phase")).items():
            row = rows.setdefault((lk, kind), {"rank": self.rank, "layer_kind": lk, "kind": kind,
                                               **{f"{p}_{s}": 0 for p in ("fwd", "bwd")
                                                  for s in ("calls", "bytes", "seconds")}})
            p = "fwd" if phase == "forward" else "bwd"
            row[f"{p}_calls"] += stat["calls"]
            row[f"{p}_bytes"] += stat["bytes"]
            row[f"{p}_seconds"] += stat["seconds"]
        order = {k: i for i, k in enumerate(LAYER_KINDS)}
        return [rows[k] for k in sorted(rows, key=lambda k: (order.get(k[0], 9), k[1]))]

    def table(self, title: str | None = None) -> str:
        """A printable table: bytes and milliseconds per layer kind and collective, forward and backward."""
        header = (f"{'layer kind':<10} {'collective':<15} {'calls':>5} {'fwd sent':>11} {'fwd ms':>8} "
                  f"{'bwd sent':>11} {'bwd ms':>8}")
        lines = ([title] if title else []) + [header, "-" * len(header)]
        total = {"calls": 0, "fb": 0, "fs": 0.0, "bb": 0, "bs": 0.0}
        for row in self.rows():
            calls = row["fwd_calls"] + row["bwd_calls"]
            lines.append(f"{row['layer_kind']:<10} {KIND_LABELS.get(row['kind'], row['kind']):<15} {calls:>5} "
                         f"{format_bytes(row['fwd_bytes']):>11} {row['fwd_seconds'] * 1e3:>8.2f} "
                         f"{format_bytes(row['bwd_bytes']):>11} {row['bwd_seconds'] * 1e3:>8.2f}")
            total["calls"] += calls
            total["fb"] += row["fwd_bytes"]
            total["fs"] += row["fwd_seconds"]
            total["bb"] += row["bwd_bytes"]
            total["bs"] += row["bwd_seconds"]
        lines.append(f"{'total':<10} {'':<15} {total['calls']:>5} {format_bytes(total['fb']):>11} "
                     f"{total['fs'] * 1e3:>8.2f} {format_bytes(total['bb']):>11} {total['bs'] * 1e3:>8.2f}")
        return "\n".join(lines)

    def gather(self, group=None) -> list["CommProfile"]:
        """Every rank's profile (collective over ``group``; call it on every rank of the group)."""
        return gather_profiles(self, group)


def record_comm(kind: str, phase: str, bytes_sent: int, seconds: float, tag: str = "") -> None:
    """Record one collective in every active :func:`profile_comms` block (for code outside ringmaster)."""
    for sink, _ in list(_RECORDERS):
        sink(kind, phase, int(bytes_sent), seconds, tag)


def comms_enabled() -> bool:
    return bool(_RECORDERS)


@contextlib.contextmanager
def profile_comms(sync_cuda: bool = True):
    """Collect every ringmaster collective issued inside the block (forward and backward).

    Yields a :class:`CommProfile` (this rank's records). With ``sync_cuda`` (default) each
    timed collective synchronizes the GPU before and after, so its seconds are the
    collective's own and not just its launch (this removes compute/communication overlap
    while profiling; pass ``False`` to keep it).
    """
    prof = CommProfile(rank=_dist_rank())

    def sink(kind, phase, bytes_sent, seconds, tag):
        prof.records.append(CommRecord(kind, phase, bytes_sent, seconds, tag))

    with recording(sink, sync_cuda):
        yield prof


# ---------------------------------------------------------------------------------------------
# memory


def peak_rss_bytes() -> int:
    """This process's peak resident set size: ``VmHWM`` on Linux (resettable, see
    :func:`reset_peak_rss`), else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    return _proc_status("VmRSS")


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark to the current RSS (Linux); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryProfile:
    saved_bytes: int = 0            # bytes of tensors autograd saved for backward inside the block
    peak_saved_bytes: int = 0
    peak_rss_bytes: int = 0         # process peak RSS during the block ("block") or lifetime ("process")
    cuda_peak_bytes: int | None = None
    rank: int | None = None
    rss_start_bytes: int | None = None
    rss_scope: str = "process"      # "block" when the high-water mark was reset at entry
    cuda_start_bytes: int | None = None
    saved_tensors: int = 0          # distinct storages saved

    @property
    def peak_rss_delta_bytes(self) -> int | None:
        """Peak RSS above the RSS at entry (what the block added), when the peak is the block's."""
        if self.rss_scope != "block" or self.rss_start_bytes is None:
            return None
        return max(self.peak_rss_bytes - self.rss_start_bytes, 0)

    @property
    def cuda_peak_delta_bytes(self) -> int | None:
        if self.cuda_peak_bytes is None or self.cuda_start_bytes is None:
            return None
        return max(self.cuda_peak_bytes - self.cuda_start_bytes, 0)

    @property
    def peak_bytes(self) -> int:
        """The device's peak: the CUDA allocator's on GPU, else the process peak RSS."""
        return self.cuda_peak_bytes if self.cuda_peak_bytes is not None else self.peak_rss_bytes

    def gather(self, group=None) -> list["MemoryProfile"]:
        """Every rank's profile (collective over ``group``; call it on every rank of the group)."""
        return gather_profiles(self, group)


_MEMORY_DEPTH = threading.local()


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    try:
        if t.layout == torch.strided:
            return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        pass
    return t.numel() * t.element_size()


@contextlib.contextmanager
def profile_memory(cuda_device=None):
    """Peak memory of the block on this rank.

    * ``saved_bytes`` / ``peak_saved_bytes``: bytes of the tensors autograd saved for backward
      inside the block (every device; each storage counted once, so views and parameters saved
      by several ops count once). Run forward (and backward) inside the block.
    * ``cuda_peak_bytes``: ``torch.cuda.max_memory_allocated`` over the block (its stats are reset
      at entry) when CUDA is available; ``cuda_start_bytes`` what was allocated at entry.
    * ``peak_rss_bytes``: the process's peak RSS. On Linux the high-water mark is reset at entry
      (``rss_scope == "block"``, ``peak_rss_delta_bytes`` = what the block added above the RSS at
      entry); nested blocks do not reset it again. Elsewhere the process lifetime peak.
    """
    prof = MemoryProfile(rank=_dist_rank())
    seen: set = set()

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            prof.saved_tensors += 1
            prof.saved_bytes += _nbytes(t)
            prof.peak_saved_bytes = max(prof.peak_saved_bytes, prof.saved_bytes)
        return t

    depth = getattr(_MEMORY_DEPTH, "n", 0)
    cuda = torch.cuda.is_available()
    if cuda:
        if depth == 0:
            torch.cuda.reset_peak_memory_stats(cuda_device)
        prof.cuda_start_bytes = torch.cuda.memory_allocated(cuda_device)
    prof.rss_start_bytes = current_rss_bytes()
    if depth == 0 and reset_peak_rss():
        prof.rss_scope = "block"
    _MEMORY_DEPTH.n = depth + 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield prof
    finally:
        _MEMORY_DEPTH.n = depth
        if cuda:
            prof.cuda_peak_bytes = torch.cuda.max_memory_allocated(cuda_device)
        prof.peak_rss_bytes = peak_rss_bytes()


@dataclass
class TensorMemory:
    """Live tensor bytes created inside a :func:`track_tensor_memory` block (see there)."""

    peak_bytes: int = 0        # most bytes alive at once, counting only storages created in the block
    live_bytes: int = 0        # bytes still alive now (or at exit)
    allocations: int = 0       # distinct storages created
    peak_op: str = ""          # the op whose outputs set the peak
    largest_bytes: int = 0     # the single largest storage created
    largest_op: str = ""       # the op that created it, and its shape
    largest_wide_bytes: int = 0  # the largest storage of a dtype wider than one byte (not bool/int8)
    largest_wide_op: str = ""
    rank: int | None = None


def _storages(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _storages(item)


def _input_storage_ids(args, kwargs) -> set[int]:
    ids = set()
    for t in _storages(list(args) + list((kwargs or {}).values())):
        try:
            ids.add(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            pass
    return ids


@contextlib.contextmanager
def track_tensor_memory(skip_aliases: bool = False):
    """Peak bytes of the tensor storages created inside the block and alive at once, on any device.

    ``skip_aliases=True`` does not count an op's output that shares storage with one of its inputs
    (a view such as a weight's ``t()`` inside ``linear``, an in-place update such as the optimizer's
    ``param.mul_``): without it, a storage from before the block that such an op returns is counted
    as if it were new, for as long as it lives (the parameters a forward touches, an optimizer's
    states). The memory planner's check (benchmarks/memory_plan.py) passes True.

    A ``TorchDispatchMode`` sees every aten op below autograd (forward and backward, composite
    ops decomposed): each new output storage is counted when created and uncounted when freed
    (a weak reference to the storage, whose Python object lives exactly as long as the storage).
    Storages from before the block (parameters, inputs) are not counted; gradients created in the
    block are. What a kernel allocates inside itself (a fused kernel's tiles, the body of a
    higher-order op such as ``flex_attention``) is not seen, which is the point: this measures what the code around the kernels materialises. Slower than
    :func:`profile_memory` (a Python call per op), so a test tool, not a training-time profiler.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    stats = TensorMemory(rank=_dist_rank())
    refs: dict[int, object] = {}  # id(storage) -> weakref (keeps the callback alive)

    def freed(key, nbytes):
        def callback(_):
            refs.pop(key, None)
            stats.live_bytes -= nbytes
        return callback

    class _Mode(TorchDispatchMode):
        # a higher-order op (flex_attention) is one kernel here: its outputs count, its insides do not
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            grew = False
            inputs = _input_storage_ids(args, kwargs) if skip_aliases else ()
            for t in _storages(out):
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                key = id(st)
                if key in refs or key in inputs:
                    continue
                nbytes = st.nbytes()
                refs[key] = weakref.ref(st, freed(key, nbytes))
                stats.allocations += 1
                stats.live_bytes += nbytes
                grew = True
                if nbytes > stats.largest_bytes:
                    stats.largest_bytes, stats.largest_op = nbytes, f"{func} {tuple(t.shape)} {t.dtype}"
                if t.element_size() > 1 and nbytes > stats.largest_wide_bytes:
                    stats.largest_wide_bytes, stats.largest_wide_op = nbytes, f"{func} {tuple(t.shape)} {t.dtype}"
            if grew and stats.live_bytes > stats.peak_bytes:
                stats.peak_bytes, stats.peak_op = stats.live_bytes, str(func)
            return out

    with _Mode():
        yield stats


def gather_profiles(prof, group=None) -> list:
    """``[profile of rank 0, rank 1, ...]`` of ``group`` (all_gather_object; a world of one or no
    initialised process group returns ``[prof]``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [prof]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, prof, group=group)
    return out


def memory_table(profiles: Iterable[MemoryProfile], title: str | None = None) -> str:
    """Per-rank table of saved-for-backward bytes, peak RSS (and its rise over the block), CUDA peak."""
    profiles = list(profiles)
    cuda = any(p.cuda_peak_bytes is not None for p in profiles)
    header = f"{'rank':>4} {'saved for bwd':>14} {'tensors':>7} {'peak RSS':>11} {'RSS rise':>11}" + (
        f" {'CUDA peak':>11} {'CUDA rise':>11}" if cuda else "")
    lines = ([title] if title else []) + [header, "-" * len(header)]
    for i, p in enumerate(profiles):
        rank = p.rank if p.rank is not None else i
        rise = p.peak_rss_delta_bytes
        line = (f"{rank:>4} {format_bytes(p.peak_saved_bytes):>14} {p.saved_tensors:>7} "
                f"{format_bytes(p.peak_rss_bytes):>11} {format_bytes(rise) if rise is not None else '-':>11}")
        if cuda:
            line += (f" {format_bytes(p.cuda_peak_bytes or 0):>11} "
                     f"{format_bytes(p.cuda_peak_delta_bytes or 0):>11}")
        lines.append(line)
    return "\n".join(lines)


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------------
# any library's collectives, counted at the c10d op level


def _phase_now() -> str:
    try:
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"
    except AttributeError:  # pragma: no cover - very old torch
        return "forward"


def _tensor_bytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_tensor_bytes(x) for x in t)
    return 0


def _pg_rank_size(pg) -> tuple[int, int]:
    """(rank, size) of a c10d op's ProcessGroup argument, or of a functional op's group name."""
    if isinstance(pg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(pg)
    elif isinstance(pg, torch.ScriptObject):  # how the dispatcher passes a c10d op its group
        from torch.distributed import ProcessGroup

        pg = ProcessGroup.unbox(pg)
    return pg.rank(), pg.size()


def _alltoall_bytes(inp, out_splits, in_splits, rank: int, size: int) -> int:
    if in_splits:
        row = _tensor_bytes(inp) // max(inp.shape[0], 1)
        return row * (sum(in_splits) - in_splits[rank])
    return _tensor_bytes(inp) * (size - 1) // size


def _c10d_sent(op: str, args: tuple) -> tuple[str, int]:
    """(kind, bytes this rank puts on the wire) for one c10d / functional-collective op.

    Convention (ringmaster's records use the same): the share a collective keeps locally is not
    counted; all-gather sends its input to P-1 peers; reduce-scatter sends all but its own output
    chunk; all-reduce counts the ring volume ``2 (P-1)/P``; a rooted op counts what this rank sends."""
    a = args
    if op == "send":
        return "send", _tensor_bytes(a[0])
    if op in ("recv_", "recv_any_source_", "barrier", "monitored_barrier_", "wait_tensor", "check_for_nan",
              "irecv"):
        return op.rstrip("_"), 0
    if op == "isend":  # functional: (tensor, dst, tag, group_name)
        return "send", _tensor_bytes(a[0])
    if op == "batch_p2p_ops":  # (op_list, peer_list, tag_list, tensors, group_name)
        return "p2p", sum(_tensor_bytes(t) for kind, t in zip(a[0], a[3]) if "send" in kind)
    if op == "alltoall_base_":  # (output, input, pg, output_split_sizes, input_split_sizes, ...)
        rank, size = _pg_rank_size(a[2])
        return "all_to_all", _alltoall_bytes(a[1], a[3], a[4], rank, size)
    if op == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group_name)
        rank, size = _pg_rank_size(a[3])
        # ringmaster's point-to-point messages (the ring's hops, distflash's messages; comm.start_exchange) are
        # counted as sends, like batch_isend_irecv's; any other all-to-all (torch's permute_tensor too) as one
        kind = "send" if point_to_point() else "all_to_all"
        return kind, _alltoall_bytes(a[0], a[1], a[2], rank, size)
    if op == "alltoall_":  # (outputs, inputs, pg, ...)
        rank, _ = _pg_rank_size(a[2])
        return "all_to_all", sum(_tensor_bytes(t) for i, t in enumerate(a[1]) if i != rank)
    if op in ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
        _, size = _pg_rank_size(a[2])
        return "all_gather", _tensor_bytes(a[1]) * (size - 1)
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        return "all_gather", _tensor_bytes(a[0]) * (a[1] - 1)  # (input(s), group_size, group_name)
    if op in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        _, size = _pg_rank_size(a[2])
        return "reduce_scatter", _tensor_bytes(a[0]) * (size - 1)
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"):
        size = a[2]  # (input(s), reduce_op, group_size, group_name): all but this rank's 1/P
        return "reduce_scatter", _tensor_bytes(a[0]) * (size - 1) // size
    if op in ("allreduce_", "allreduce_coalesced_"):
        _, size = _pg_rank_size(a[1])
        return "all_reduce", 2 * _tensor_bytes(a[0]) * (size - 1) // size
    if op in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
        _, size = _pg_rank_size(a[2])
        return "all_reduce", 2 * _tensor_bytes(a[0]) * (size - 1) // size
    if op in ("broadcast", "broadcast_") and isinstance(a[1], int):  # functional: (input, src, group_name)
        rank, size = _pg_rank_size(a[2])
        return "broadcast", _tensor_bytes(a[0]) * (size - 1) if rank == a[1] else 0
    if op == "broadcast_":  # c10d: (tensors, pg, root_rank, root_tensor, ...)
        rank, size = _pg_rank_size(a[1])
        return "broadcast", _tensor_bytes(a[0]) * (size - 1) if rank == a[2] else 0
    if op == "reduce_":  # (tensors, pg, op, root_rank, ...)
        rank, _ = _pg_rank_size(a[1])
        return "reduce", 0 if rank == a[3] else _tensor_bytes(a[0])
    if op == "gather_":  # (outputs, inputs, pg, root_rank, ...)
        rank, _ = _pg_rank_size(a[2])
        return "gather", 0 if rank == a[3] else _tensor_bytes(a[1])
    if op == "scatter_":  # (outputs, inputs, pg, root_rank, ...)
        rank, _ = _pg_rank_size(a[2])
        return "scatter", sum(_tensor_bytes(t) for i, t in enumerate(a[1][0] if a[1] else []) if i != rank) \
            if rank == a[3] else 0
    return op, 0


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _normalize(args, kwargs, schema) -> tuple:
    """Positional arguments in schema order (kwargs folded in, defaults filled)."""
    if not kwargs:
        return tuple(args)
    out = list(args)
    for arg in schema.arguments[len(args):]:
        out.append(kwargs.get(arg.name, arg.default_value))
    return tuple(out)


@contextlib.contextmanager
def count_collectives(tag: str = "c10d", include_zero: bool = False):
    """Count the bytes of every collective this thread issues inside the block, whoever issues it.

    Counting happens where every library's collectives meet: the dispatcher ops of the ``c10d``
    namespace (what ``torch.distributed``'s process-group calls run: ``alltoall_base_``,
    ``send``, ``allgather_`` ...) and of ``_c10d_functional`` (functional collectives: DTensor,
    torch's ``context_parallel``). A ``TorchDispatchMode`` sees each op once, with its real
    arguments, so a library that imported ``all_to_all_single`` by name, calls a process group
    method, or uses functional collectives is counted the same way; a collective implemented with
    another (the functional op's own c10d call) counts once. Distributed tensors
    (DTensor) are let through to their own handler, which runs with this mode still active, so the
    collectives its handlers issue (context_parallel's ring) are seen too; other subclasses (fake
    tensors of sharding propagation) run as they would without the mode.

    Yields a :class:`CommProfile` in ringmaster's byte convention (:func:`_c10d_sent`); the phase
    is ``backward`` while autograd runs a backward pass; ``seconds`` is the op's wall time (for an
    async op, its launch). Zero-byte ops (recv, barrier, wait) are left out unless ``include_zero``.
    Cost: a Python call per aten op inside the block, so time steps outside it.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    prof = CommProfile(rank=_dist_rank())
    try:
        from torch.distributed.tensor import DTensor as dtensor
    except ImportError:  # pragma: no cover - torch without distributed
        dtensor = None

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if dtensor is not None and any(issubclass(t, dtensor) for t in types):
                return NotImplemented  # DTensor's handler first; the ops it issues come back here
            ns = func.namespace
            if ns not in COLLECTIVE_NAMESPACES:
                return func(*args, **(kwargs or {}))
            op = func._schema.name.split("::", 1)[1]
            try:
                kind, nbytes = _c10d_sent(op, _normalize(args, kwargs, func._schema))
            except Exception:  # never let counting break the collective
                kind, nbytes = op, 0
            phase = _phase_now()
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if nbytes or include_zero:
                prof.records.append(CommRecord(kind, phase, int(nbytes), time.perf_counter() - start, tag))
            return out

    with _Counter():
        yield prof



# ---------------------------------------------------------------------------------------------
# the order of collectives: each rank's sequence, and whether the group's sequences match


# ops that issue nothing another rank must match (a wait completes an op already recorded; the functional
# collectives' autograd wrapper only wraps the result of the one it follows)
_UNORDERED_OPS = ("wait_tensor", "check_for_nan", "_wrap_tensor_autograd")
_P2P_OPS = {"send": "send", "isend": "send", "recv_": "recv", "irecv": "recv", "recv_any_source_": "recv"}


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as this rank issued it (see :func:`record_collectives`).

    ``op``: the dispatcher op (``allgather_``, ``alltoall_base_``, ``all_to_all_single``, ``send`` ...);
    ``phase``: ``forward`` / ``backward`` (a checkpoint's recomputation runs in ``backward``); ``group``: the
    global ranks of its process group; ``shapes``: its input tensors' shapes; ``dtype``; ``peer``: the global
    rank of a send's destination / a receive's source (else None); ``splits``: an all-to-all's
    ``(input splits, output splits)`` when it has them (messages of different sizes per peer: the ring's and
    distflash's hops); ``tag``: the c10d tag of a p2p op, or the ringmaster tag (``conv_halo``,
    ``ulysses_qkv`` ...) of the collective it belongs to."""

    op: str
    phase: str
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    peer: int | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    tag: str = ""

    def signature(self) -> tuple:
        """What every member of the group must issue at the same point (for p2p: the peer, direction aside)."""
        if self.peer is not None:
            return ("p2p", self.phase, self.shapes, self.dtype, self.tag)
        shapes = () if self.splits is not None else self.shapes   # an all-to-all's sizes are per rank: see splits
        return (self.op, self.phase, self.group, shapes, self.dtype, self.tag)

    def describe(self) -> str:
        where = f" peer {self.peer}" if self.peer is not None else f" group {list(self.group)}"
        size = f" splits {list(self.splits[0])}->{list(self.splits[1])}" if self.splits is not None else \
            f" {[list(s) for s in self.shapes]}"
        return f"{self.phase} {self.op}{where}{size} {self.dtype}{f' [{self.tag}]' if self.tag else ''}"


def _group_ranks(pg) -> tuple[int, ...]:
    import torch.distributed as dist

    if isinstance(pg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(pg)
    elif isinstance(pg, torch.ScriptObject):
        from torch.distributed import ProcessGroup

        pg = ProcessGroup.unbox(pg)
    return tuple(dist.get_process_group_ranks(pg))


def _shapes(x) -> tuple[tuple[int, ...], ...]:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape),)
    if isinstance(x, (list, tuple)):
        return tuple(s for t in x for s in _shapes(t))
    return ()


def _dtype(x) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    if isinstance(x, (list, tuple)):
        for t in x:
            d = _dtype(t)
            if d:
                return d
    return ""


def _event(op: str, a: tuple, phase: str) -> CollectiveEvent:
    """The event of one c10d / functional-collective op from its arguments in schema order."""
    if op in ("send", "recv_", "recv_any_source_"):   # c10d: (tensors, pg, peer (group rank), tag)
        group = _group_ranks(a[1])
        peer = group[a[2]] if op != "recv_any_source_" else -1
        return CollectiveEvent(op, phase, group, _shapes(a[0]), _dtype(a[0]), peer, tag=str(a[3]))
    if op in ("isend", "irecv"):   # functional: (tensor|shape..., peer, tag, group_name)
        group = _group_ranks(a[-1])
        return CollectiveEvent(op, phase, group, _shapes(a[0]), _dtype(a[0]), group[a[-3]], tag=str(a[-2]))
    pg = next((x for x in a if isinstance(x, (torch.ScriptObject, str))), None)
    group = _group_ranks(pg) if pg is not None else ()
    if op == "alltoall_base_":   # (output, input, pg, output_split_sizes, input_split_sizes, ...)
        splits = (tuple(a[4]), tuple(a[3])) if a[3] or a[4] else None
        return CollectiveEvent(op, phase, group, _shapes(a[1]), _dtype(a[1]), splits=splits)
    if op == "all_to_all_single":   # functional: (input, output_split_sizes, input_split_sizes, group_name)
        return CollectiveEvent(op, phase, group, _shapes(a[0]), _dtype(a[0]), splits=(tuple(a[2]), tuple(a[1])))
    # in-place c10d ops take (outputs, inputs, pg, ...) or (tensors, pg, ...); functional ones (input(s), ...)
    inputs = a[1] if len(a) > 2 and isinstance(a[2], torch.ScriptObject) else a[0]
    return CollectiveEvent(op, phase, group, _shapes(inputs), _dtype(inputs))


@dataclass
class CollectiveLog:
    """One rank's collectives, in the order it issued them (:func:`record_collectives`)."""

    events: list[CollectiveEvent] = field(default_factory=list)
    rank: int | None = None

    def gather(self, group=None) -> list["CollectiveLog"]:
        """Every rank's log (collective over ``group``; call it on every rank of the group, outside the block)."""
        return gather_profiles(self, group)


@contextlib.contextmanager
def record_collectives():
    """Record every collective this rank issues inside the block, in issue order, forward and backward.

    The same dispatch mode as :func:`count_collectives` (the ``c10d`` / ``_c10d_functional`` ops, whoever
    issues them), but it keeps the order and what each rank must match: op, phase, group, input shapes,
    dtype, peer of a p2p op, an all-to-all's splits and a tag (:class:`CollectiveEvent`). ringmaster's own tag
    (``conv_halo``, ``state_passing``, ``ulysses_qkv`` ...) is taken from its timing hook, which reports each
    collective right after the one c10d op it timed (it replaces a p2p op's c10d tag); functional exchanges (the
    ring's hops) keep none. Waits are
    left out: what matters is the order the ranks *issue* collectives in. :func:`check_order` compares the
    logs of a group."""
    from torch.utils._python_dispatch import TorchDispatchMode

    log = CollectiveLog(rank=_dist_rank())
    untagged: list[int] = []   # events since ringmaster's last record

    def sink(kind, phase, bytes_sent, seconds, tag):
        # ringmaster's hook times one c10d call and reports right after it: the last op recorded since
        if untagged and tag:
            e = log.events[untagged[-1]]
            log.events[untagged[-1]] = CollectiveEvent(e.op, e.phase, e.group, e.shapes, e.dtype, e.peer, e.splits,
                                                       tag)
        untagged.clear()

    try:
        from torch.distributed.tensor import DTensor as dtensor
    except ImportError:  # pragma: no cover
        dtensor = None

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if dtensor is not None and any(issubclass(t, dtensor) for t in types):
                return NotImplemented
            if func.namespace in COLLECTIVE_NAMESPACES:
                op = func._schema.name.split("::", 1)[1]
                if op not in _UNORDERED_OPS:
                    untagged.append(len(log.events))
                    log.events.append(_event(op, _normalize(args, kwargs, func._schema), _phase_now()))
            return func(*args, **(kwargs or {}))

    with recording(sink, sync_cuda=False), _Recorder():
        yield log


def check_order(logs: list) -> list[str]:
    """Whether the ranks' collective sequences can all complete, matched one to one; ``[]`` when they can, else
    what blocks (each stuck rank's next collective).

    ``logs``: one :class:`CollectiveLog` (or list of events) per global rank, index = rank. A collective
    matches when every member of its group issues one with the same signature (op, phase, group, shapes,
    dtype, tag) as its next collective on that group, an all-to-all's splits agreeing (what rank ``i`` sends
    ``j`` is what ``j`` receives from ``i``); a send matches its peer's receive of the same shape, dtype and
    tag. The check replays the logs with every collective blocking until its partners reach it (the
    strictest case, so a schedule that passes cannot deadlock or pair a collective with another one): for
    group collectives alone it says the sequences are identical on every rank of the group."""
    seqs = [list(getattr(log, "events", log)) for log in logs]
    pos = [0] * len(seqs)

    def head(r):
        return seqs[r][pos[r]] if pos[r] < len(seqs[r]) else None

    def matched(r) -> list[int] | None:
        e = head(r)
        if e is None:
            return None
        if e.peer is not None:
            peer = e.peer
            if not 0 <= peer < len(seqs):
                return None
            f = head(peer)
            sending = e.op in ("send", "isend")
            if (f is None or f.peer != r or (f.op in ("send", "isend")) == sending
                    or f.signature() != e.signature()):
                return None
            return [r, peer]
        members = list(e.group) or list(range(len(seqs)))
        heads = {m: head(m) if 0 <= m < len(seqs) else None for m in members}
        if any(h is None or h.peer is not None or h.signature() != e.signature() for h in heads.values()):
            return None
        if e.splits is not None:
            for i, m in enumerate(members):
                for j, n in enumerate(members):
                    if heads[m].splits is None or heads[n].splits is None or \
                            heads[m].splits[0][j] != heads[n].splits[1][i]:
                        return None
        return members

    progress = True
    while progress:
        progress = False
        for r in range(len(seqs)):
            ranks = matched(r)
            if ranks:
                for m in ranks:
                    pos[m] += 1
                progress = True
    stuck = [r for r in range(len(seqs)) if pos[r] < len(seqs[r])]
    if not stuck:
        return []
    return [f"rank {r} stuck at collective #{pos[r]} of {len(seqs[r])}: {head(r).describe()}" for r in stuck]


# aten ops that make the host wait for the device on a GPU: a scalar read, or an output whose size
# depends on tensor values (the device must finish before the host can allocate it)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
            "bincount", "_assert_async")
# Python-level reads of tensor values that bypass those ops (a copy to host memory)
SYNC_METHODS = ("tolist", "numpy")


class HostSyncs:
    """What :func:`count_host_syncs` saw: per op name, how many calls."""

    def __init__(self):
        self.ops: dict[str, int] = {}

    def add(self, name: str) -> None:
        self.ops[name] = self.ops.get(name, 0) + 1

    @property
    def scalar_reads(self) -> int:
        """``aten._local_scalar_dense`` calls: ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``."""
        return self.ops.get("_local_scalar_dense", 0)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _device_to_host(args, out) -> bool:
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) and isinstance(out, torch.Tensor) \
        and out is args[0] else (args[0] if args and isinstance(args[0], torch.Tensor) else None)
    return (src is not None and isinstance(out, torch.Tensor) and src.device.type not in ("cpu", "meta")
            and out.device.type == "cpu")


@contextlib.contextmanager
def count_host_syncs():
    """Count the reads of tensor values on the host inside the block (forward and backward alike):
    scalar reads (``aten._local_scalar_dense``), ops whose output size depends on values (``nonzero``,
    boolean indexing, ``bincount``, ``unique``), ``tensor.tolist()`` / ``.numpy()`` and copies of a device
    tensor to host memory (``device_to_host``; none exist on a CPU run). On a GPU each is a
    stall until the device has drained its queue; on CPU the same calls are counted, so the CPU run
    measures what a GPU step would pay. Yields a :class:`HostSyncs`."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = HostSyncs()
    sync_ops = set(SYNC_OPS)
    methods = {getattr(torch.Tensor, m) for m in SYNC_METHODS}

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::", 1)[1]
            if name in sync_ops:
                seen.add(name)
            out = func(*args, **(kwargs or {}))
            if name in ("_to_copy", "copy_") and _device_to_host(args, out):
                seen.add("device_to_host")   # .cpu() / .to("cpu") of a device tensor (never seen on a CPU run)
            return out

    class _Methods(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in methods:
                seen.add(func.__name__)
            return func(*args, **(kwargs or {}))

    with _Methods(), _Ops():
        yield seen
