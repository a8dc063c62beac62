"""Autograd-aware collectives over a CP process group, and where ringmaster's own small tensors go.

Each function is exact in backward: all-to-all's adjoint is the reverse all-to-all,
all-gather's is reduce-scatter (sum). Bytes are reported to ``rm.profile_comms()``.

Collectives on activations (q/k/v, ring blocks, recurrent maps and states) run on the activations'
own device. The small tensors ringmaster makes itself (the input fingerprint, token counts, logged
losses) go to :func:`collective_device`: an NCCL group has no CPU backend, so a CPU tensor there
raises ``No backend type associated with device type cpu``.
"""

from __future__ import annotations

import contextvars

import contextlib
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from .compat import all_gather_single, backend_for, current_device, group_device_types, reduce_scatter_single

# (sink, sync_cuda) pairs that rm.profile_comms() registers while its block runs; empty otherwise,
# so timing costs nothing unless someone is measuring. sink(kind, phase, bytes_sent, seconds, tag).
_RECORDERS: list[tuple[Callable, bool]] = []


@contextlib.contextmanager
def recording(sink: Callable, sync_cuda: bool = True):
    """Send every collective record issued inside the block to ``sink`` (what the profilers use)."""
    entry = (sink, bool(sync_cuda))
    _RECORDERS.append(entry)
    try:
        yield
    finally:
        _RECORDERS.remove(entry)


def _maybe_sync() -> None:
    if any(sync for _, sync in _RECORDERS) and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed_comm(kind: str, phase: str, bytes_sent: int, tag: str = ""):
    """Time one collective and report it to the active recorders (no-op when nobody records, and inside
    ``torch.compile``: a traced region records nothing and reads no clock)."""
    if torch.compiler.is_compiling() or not _RECORDERS:
        yield
        return
    _maybe_sync()
    start = time.perf_counter()
    yield
    _maybe_sync()
    seconds = time.perf_counter() - start
    for sink, _ in list(_RECORDERS):
        sink(kind, phase, int(bytes_sent), seconds, tag)

_HANG_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective of the CP group failed or timed out; the message names the group and the layer."""


@contextlib.contextmanager
def diagnosed(kind: str, tag: str, group):
    """Turn a timeout / lost peer inside a collective into an error that says where and why (eager only:
    a traced collective fails when the compiled graph runs, not where it was traced)."""
    if torch.compiler.is_compiling():
        yield
        return
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if isinstance(exc, CollectiveError) or not any(sign in text.lower() for sign in _HANG_SIGNS):
            raise
        ranks = dist.get_process_group_ranks(group) if group is not None else "default"
        raise CollectiveError(
            f"{kind} {tag!r} on the CP group of global ranks {ranks} did not complete: {text.splitlines()[0]}. "
            "Likely cause: a rank of this group did not reach the same collective - it raised earlier (read "
            "every rank's log), its batch or model differs (keep RingmasterConfig(validate_inputs=True)), or a "
            "peer process died"
        ) from exc


def collective_device(group, like: torch.Tensor | torch.device | None = None) -> torch.device:
    """The device ringmaster's own small tensors use for a collective over ``group``.

    ``like``'s device when the group has a backend for its type (no copy: the batch or loss already
    lives there); else CPU when the group has a CPU backend (gloo, ``cpu:gloo,cuda:nccl``; no device
    sync for a handful of integers); else the group's accelerator, at this process's current index
    (``nccl`` or ``cuda:gloo`` -> ``cuda:<torch.cuda.current_device()>``: a batch still on CPU while
    the model is on CUDA). Raises, before any collective, when none of those exists here.
    """
    types = group_device_types(group)
    want = like.device if isinstance(like, torch.Tensor) else (torch.device(like) if like is not None else None)
    if want is not None and want.type in types:
        if want.index is None and want.type != "cpu":
            want = current_device(want.type) or want
        return want
    if "cpu" in types:
        return torch.device("cpu")
    for device_type in types:
        found = current_device(device_type)
        if found is not None:
            return found
    config = ",".join(types) or "none"
    where = f" for a tensor on {want}" if want is not None else ""
    raise RuntimeError(
        f"the CP group has backends for device types [{config}] only, and this process has no such device"
        f"{where}: ringmaster cannot place its collectives (input check, token counts) on it. Put the "
        f"model and batch on a {types[0] if types else 'supported'} device (torch.cuda.set_device(local_rank)), "
        "or build the group with a CPU backend as well, e.g. init_process_group('cpu:gloo,cuda:nccl')"
    )


def all_reduce_sum(value: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """``value`` summed over ``group`` (not differentiable), computed on :func:`collective_device`
    and returned on ``value``'s own device; ``value`` itself is left unchanged."""
    device = collective_device(group, like=value)
    buf = value.detach().to(device, copy=True)
    with diagnosed("all_reduce", tag, group):
        dist.all_reduce(buf, group=group)
    return buf.to(value.device)


def with_layer_context(fn):
    """Wrap an attention-interface function so a failed collective names the layer it ran in."""
    def attention(module, *args, **kwargs):
        try:
            return fn(module, *args, **kwargs)
        except CollectiveError as exc:
            where = f"{type(module).__name__} (layer_idx={getattr(module, 'layer_idx', '?')})"
            raise CollectiveError(f"{exc} [in {where}]") from exc

    return attention


def _a2a(x: torch.Tensor, group, phase: str, tag: str) -> torch.Tensor:
    P = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    sent = x.numel() * x.element_size() * (P - 1) // P
    with diagnosed("all_to_all", tag, group), timed_comm("all_to_all", phase, sent, tag):
        dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return _a2a(x, group, "forward", tag)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.group, "backward", ctx.tag), None, None


def all_to_all(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """``x`` is ``[P, ...]``; slice ``i`` goes to rank ``i``; slice ``i`` of the result came from rank ``i``."""
    P = dist.get_world_size(group)
    if x.shape[0] != P:
        raise ValueError(f"all_to_all needs a leading dim of the group size {P}, got shape {tuple(x.shape)}")
    if P == 1:
        return x
    return _AllToAll.apply(x, group, tag)


def _all_gather(x: torch.Tensor, group, phase: str, tag: str) -> torch.Tensor:
    P = dist.get_world_size(group)
    x = x.contiguous()
    flat = x.reshape(1, -1)
    out = torch.empty((P, flat.shape[1]), dtype=x.dtype, device=x.device)
    with diagnosed("all_gather", tag, group), timed_comm("all_gather", phase, x.numel() * x.element_size() * (P - 1), tag):
        all_gather_single(out, flat, group=group)
    return out.view(P, *x.shape)


def _reduce_scatter(x: torch.Tensor, group, phase: str, tag: str) -> torch.Tensor:
    P = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    with diagnosed("reduce_scatter", tag, group), \
            timed_comm("reduce_scatter", phase, out.numel() * out.element_size() * (P - 1), tag):
        if backend_for(group, x.device.type) in ("gloo", None):
            # gloo's reduce_scatter is not available for every device/torch version (CUDA tensors on gloo:
            # the single-GPU check's ranks): an all-to-all brings every rank's slice for us here, and we
            # sum them. It sends (P-1)/P of x, what the record says; an all_reduce (the former fallback)
            # sends twice that, 2(P-1)/P of x, while the record said (P-1)/P: half of what went out.
            parts = torch.empty_like(x)
            dist.all_to_all_single(parts, x, group=group)
            torch.sum(parts, dim=0, out=out)
        else:
            reduce_scatter_single(out, x, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return _all_gather(x, group, "forward", tag)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, "backward", ctx.tag), None, None


def all_gather(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """Stack every rank's ``x`` into ``[P, *x.shape]``; backward sums the gradients back (reduce-scatter)."""
    if dist.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group, tag)


# ---- point-to-point messages as traceable functional collectives (the ring's and distflash's hops)


def start_exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Size]], group,
                   like: torch.Tensor, after: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[int, torch.Size]]]:
    """Issue point-to-point messages over ``group`` as one functional all-to-all (``torch.distributed.
    _functional_collectives.all_to_all_single``) and return at once: ``(flat, layout)`` for
    :func:`finish_exchange`.

    ``sends``: ``[(group rank, tensor)]``, at most one per peer; ``recvs``: ``[(group rank, shape)]``, at most
    one per peer, in the order the caller wants them back. Every message has ``like``'s dtype. Every rank of
    the group must call this at the same point (it is a collective), also one with nothing to move; both
    ends derive the sizes from the same global plan. In eager mode the result is an
    ``AsyncCollectiveTensor``: the transfer runs while the caller computes, and waits at
    :func:`finish_exchange` (or first use). Under ``torch.compile`` it traces as ``all_to_all_single`` +
    ``wait_tensor``, which the compiler schedules (isend/irecv and ``P2POp`` would break the graph);
    ``after`` (a backward's incoming gradient) keeps it in that phase (:func:`pinned`), and a rank that
    receives nothing must :func:`anchor` the result.

    Every collective's order is the program's: the compiler never reorders collectives relative to one
    another, and each rank issues the same ones in the same order."""
    P = dist.get_world_size(group)
    if len({peer for peer, _ in sends}) < len(sends) or len({peer for peer, _ in recvs}) < len(recvs):
        raise ValueError("start_exchange: at most one message to and one from each peer")
    parts = [None] * P
    in_splits, out_splits = [0] * P, [0] * P
    for peer, t in sends:
        parts[peer] = t.reshape(-1).to(like.dtype)   # the wire format is the caller's, on both ends
        in_splits[peer] = t.numel()
    for peer, shape in recvs:
        out_splits[peer] = torch.Size(shape).numel()
    starts = [sum(out_splits[:peer]) for peer in range(P)]   # messages arrive in peer order
    layout = [(starts[peer], torch.Size(shape)) for peer, shape in recvs]
    chunks = [p for p in parts if p is not None]
    flat = torch.cat(chunks) if len(chunks) > 1 else chunks[0] if chunks else like.new_empty((0,))
    if after is not None:
        flat = pinned(flat, after)
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(flat.contiguous(), out_splits, in_splits, group), layout
    token = _POINT_TO_POINT.set(True)   # for counters at the c10d level: these are messages, not an all-to-all
    try:
        return funcol.all_to_all_single(flat.contiguous(), out_splits, in_splits, group), layout
    finally:
        _POINT_TO_POINT.reset(token)


# True only while start_exchange issues its collective (eager): lets a c10d-level counter
# (ringmaster_tools.profiling.count_collectives) count those bytes as point-to-point sends
_POINT_TO_POINT: contextvars.ContextVar[bool] = contextvars.ContextVar("ringmaster_point_to_point", default=False)


def point_to_point() -> bool:
    """Whether the collective being issued now is :func:`start_exchange`'s point-to-point messages."""
    return _POINT_TO_POINT.get()


def complete(t: torch.Tensor) -> torch.Tensor:
    """Wait for an in-flight functional collective's result (a no-op when traced or already a plain tensor)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def finish_exchange(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    """The messages :func:`start_exchange` posted, waited for, in the order of its ``recvs``."""
    flat = complete(flat)
    return [flat[offset:offset + shape.numel()].view(shape) for offset, shape in layout]


def pinned(x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """``x``, depending on ``after`` under ``torch.compile`` (``x`` itself in eager mode).

    AOTAutograd's partitioner places each node of the joint graph by what its inputs depend on: a backward
    collective on saved tensors only (the ring's first K/V hop) goes to the end of the forward graph, and a
    receive with nothing to send (its input a fresh empty tensor) depends on nothing at all, so it may be
    placed in either graph or both: out of order with the peers' collectives. A zero-element slice of the
    phase's input (the forward's q, the backward's incoming gradient), summed (0) into ``x``, keeps the
    collective in its phase."""
    if not torch.compiler.is_compiling():
        return x
    return x + after.reshape(-1)[:0].sum().to(x.dtype)


def anchor(x: torch.Tensor, unread: list[torch.Tensor]) -> torch.Tensor:
    """``x``, made to depend on exchanges whose (empty) result this rank never reads: a rank that only sends.

    To the compiler a functional collective is a pure function of its input: one whose result nothing
    uses is dead code and is dropped, on this rank only, while its peers wait for its message (a hang,
    or the next collective matched with the wrong one). Under ``torch.compile`` each such result's sum
    (over no elements: 0) is added to ``x``, which the graph returns; in eager mode ``x`` is returned as
    it is (every exchange is waited for in program order)."""
    if not torch.compiler.is_compiling():
        return x
    for t in unread:
        x = x + t.sum().to(x.dtype)
    return x
