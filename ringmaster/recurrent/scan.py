"""The scan engine: exact cross-rank state passing for any recurrent layer kind.

A shard of a recurrent layer needs the state the earlier shards leave behind. Every layer
ringmaster handles is *affine in its incoming state* over a stretch of tokens::

    S_end = A · S_start + b        (A: per-head scalar decay for Mamba2, a per-(channel, state)
                                     diagonal decay for Mamba1,
                                     a d_k × d_k transition for the gated delta rule)

and its outputs are affine in ``S_start`` too. Two strategies (``RingmasterConfig.recurrent``):

``scan``
    every rank computes the map ``(A_c, b_c)`` of each chunk it holds, one all-gather shares
    them, every rank composes the exclusive prefix in fp32 in *sequence order* (so a
    ``head_tail`` layout, 2P chunks, works the same way) and finishes its outputs with the
    right initial state. Backward runs through the same all-gather (reduce-scatter).
``sequential``
    the final state goes from chunk to chunk in sequence order with point-to-point
    send/recv; backward sends the state gradient back the same way. Costs no extra compute
    but P-1 (2P-1 for head_tail) hops of latency.

Packed rows (several documents per row) and padding: the state resets at every document start.
A chunk is cut at its document starts (:class:`DocumentSegment`); a chunk holding a start has
the map ``A = 0`` (its end state does not depend on the incoming state), so both strategies and
every layout stay unchanged around it. The document ids come from the ``ringmaster_batch`` kwarg
(or, for a mixer called without kwargs, from the model's step carrier, :mod:`ringmaster.sharding.carrier`);
the cuts themselves come from the batch's host runs (``CPBatch.runs``), never from the ids' values.

Products of decays are only ever multiplied, never divided. The layer adapters
(:mod:`.mamba`, :mod:`.linear_attn`) describe one chunk of their kernel as a ``Segment``;
this module only knows segments, layouts and collectives.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather, pinned, timed_comm
from ..errors import WireFormatError
from ..sharding import balancers

STRATEGIES = ("scan", "sequential")
# opt-in strategies a kind may offer (``RecurrentKind.strategies``), refused at wire by the others: ``fla_cp``
# (flash-linear-attention's own CP), ``heads`` (head-parallel: :mod:`ringmaster.recurrent.heads`)
KERNEL_STRATEGIES = ("fla_cp", "heads")


def auto_strategy(size: int) -> str:
    """The state passing ``recurrent="auto"`` runs at CP size ``size`` (where it does not run heads):
    sequential for P <= 2, else the scan."""
    return "sequential" if size <= 2 else "scan"


class Segment(Protocol):
    """One contiguous stretch of tokens of one recurrent kernel call."""

    def local_map(self) -> tuple[torch.Tensor, Any]:
        """``(packed map (A, b) in fp32, aux)`` with a zero incoming state."""

    def map_meta(self) -> tuple[int, ...]:
        """The shape of :meth:`local_map`'s packed map, without computing it (``recurrent="auto"``'s costs: the
        scan all-gathers one per rank)."""

    def combine(self, state: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor:
        """``A · state + b`` (``b`` when ``state`` is None), fp32."""

    def finish(self, aux: Any, state_in: torch.Tensor | None) -> Any:
        """The segment's outputs for incoming state ``state_in`` (None: zero), from ``aux``."""

    def run(self, state_in: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
        """``(outputs, final state)`` computed directly from ``state_in`` (the sequential path). ``state_in``
        comes in the wire format (:func:`wire_format`); the final state may come out in whatever dtype the
        kernel computes it in (the pass casts it to the wire format)."""

    def state_meta(self) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        """Shape, dtype and device of the state tensor this segment passes on: a function of what every rank
        of the group shares (batch and head sizes, the inputs' dtypes), never of the local shard's length or
        of the kernel's output, so both ends of a hop derive the same one (:func:`wire_format`)."""


def state_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or float64 when an input is float64: maps, prefixes and states never go below fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def hi(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class WireFormat(NamedTuple):
    """The shape and dtype a passed state has on the wire: one per passed tensor, agreed by both ends."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


def wire_format(segment: Segment) -> WireFormat:
    """The wire format of the state a layer call passes between its chunks, derived once per call from
    :meth:`Segment.state_meta` (facts every rank shares). The sender casts to it (:func:`to_wire`), the
    receiver allocates it, and a state handed to a chunk on the same rank takes it too, so every chunk sees
    the same incoming state whoever computed it."""
    shape, dtype, _ = segment.state_meta()
    return WireFormat(tuple(int(n) for n in shape), dtype)


def _mismatch(state: torch.Tensor, fmt: WireFormat, name: str | None, what: str) -> WireFormatError:
    return WireFormatError(
        f"{name or 'a recurrent layer'}: the state it {what} is {str(state.dtype).removeprefix('torch.')} "
        f"{list(state.shape)}, but the wire format both ranks agreed on (from the segment's state_meta()) is "
        f"{fmt.describe()}; the peer would read a buffer of another size or dtype (gloo aborts the process, NCCL "
        "reads garbage). Make the kind's state_meta() describe the final state its kernel returns (same shape), "
        "and pass that state through ringmaster.recurrent.scan.to_wire before it is sent")


def to_wire(state: torch.Tensor, fmt: WireFormat, name: str | None = None) -> torch.Tensor:
    """``state`` cast to the wire format ``fmt`` (differentiable: the gradient comes back in ``state``'s
    dtype). A state of another shape cannot be cast: :class:`WireFormatError`, before any collective."""
    if tuple(state.shape) != fmt.shape:
        raise _mismatch(state, fmt, name, "passes on")
    return state.to(fmt.dtype)


def check_wire(state: torch.Tensor, fmt: WireFormat, name: str | None, what: str) -> torch.Tensor:
    """``state``, contiguous, if it has the wire format exactly; else :class:`WireFormatError` (the last check
    before a send or a receive is issued)."""
    if tuple(state.shape) != fmt.shape or state.dtype != fmt.dtype:
        raise _mismatch(state, fmt, name, what)
    return state.contiguous()


def probe_run(segment: Segment, state_in: torch.Tensor | None, name: str | None = None):
    """``segment.run(state_in)`` in wire's probe forward, its final state checked against the wire format the
    way the sequential pass sends it: a kind whose kernel's state cannot take that format fails at wire time,
    on every rank, naming the layer (the pass itself would fail on the sending rank only, its peer waiting)."""
    out, final = segment.run(state_in)
    fmt = wire_format(segment)
    check_wire(to_wire(final, fmt, name), fmt, name, "would send")
    return out, final


def chunk_ids(layout: str, size: int, rank: int) -> list[int]:
    """Global chunk indices (sequence order) of the chunks ``rank`` stores, in storage order."""
    return list(balancers.shard_chunks(balancers.check_layout(layout), size, rank))


def split_local(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    if n == 1:
        return [x]
    if x.shape[dim] % n:
        raise ValueError(f"a shard of length {x.shape[dim]} does not split into the layout's {n} chunks")
    return list(x.split(x.shape[dim] // n, dim=dim))


def compose_prefix(segment: Segment, maps: Sequence[torch.Tensor], upto: int | None = None) -> list:
    """Exclusive prefix over ``maps`` (sequence order): entry ``c`` is the state entering chunk ``c``
    (None for chunk 0, i.e. zeros). fp32, multiplications only."""
    states: list[torch.Tensor | None] = []
    state = None
    for c, packed in enumerate(maps[: len(maps) if upto is None else upto + 1]):
        states.append(state)
        state = segment.combine(state, hi(packed))
    return states


def simulate_scan(segments_in_order: Sequence[Segment]) -> list:
    """Single-process scan over segments listed in sequence order (what P ranks compute together):
    local maps, prefix, outputs. The unit tests compare this against the naive recurrence."""
    local = [seg.local_map() for seg in segments_in_order]
    states = compose_prefix(segments_in_order[0], [m for m, _ in local])
    return [seg.finish(aux, s) for seg, (_, aux), s in zip(segments_in_order, local, states)]


def simulate_sequential(segments_in_order: Sequence[Segment]) -> list:
    outs, state = [], None
    for seg in segments_in_order:
        out, state = seg.run(state)
        outs.append(out)
    return outs


# --------------------------------------------------------------------------- collectives


class _Tie(torch.autograd.Function):
    """``out`` unchanged, with ``deps`` made part of its graph (zero gradient). A collective's output
    must reach the loss on *every* rank, or its backward (a collective too) runs on some ranks only
    and the others hang: e.g. rank 0 uses none of the gathered maps (its prefix is zero)."""

    @staticmethod
    def forward(ctx, out, *deps):
        ctx.metas = [(d.shape, d.dtype, d.device) for d in deps]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        # the zeros depend on ``grad`` when compiled (comm.pinned): else the backward collective they feed has
        # no input from the backward and the compiler may hoist it into the forward, on this rank only
        return (grad, *[pinned(torch.zeros(shape, dtype=dtype, device=device), grad)
                        for shape, dtype, device in ctx.metas])


def tie(out, *deps):
    """Make ``deps`` (e.g. an all-gather's output) part of ``out``'s autograd graph at no cost."""
    if not torch.is_grad_enabled() or not any(d.requires_grad for d in deps):
        return out
    if isinstance(out, torch.Tensor):
        return _Tie.apply(out, *deps)
    return (_Tie.apply(out[0], *deps), *out[1:])


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None and group is not dist.group.WORLD else group_rank


class _Recv(torch.autograd.Function):
    """``state = recv(src)`` into a buffer of the wire format ``fmt``; backward sends the state's gradient
    back to ``src`` in the same format.

    ``token`` chains every p2p op of one layer call so that autograd runs their backwards in
    exactly the reverse order on every rank (no rank waits on a send the peer has not reached)."""

    @staticmethod
    def forward(ctx, token, fmt, src, group, name):
        ctx.src, ctx.group, ctx.fmt, ctx.name = src, group, fmt, name
        buf = torch.empty(fmt.shape, dtype=fmt.dtype, device=token.device)
        with timed_comm("recv", "forward", 0, "state_passing"):
            dist.recv(buf, src=src, group=group)
        return buf, token.detach().clone()

    @staticmethod
    def backward(ctx, grad_state, grad_token):
        grad_state = check_wire(grad_state, ctx.fmt, ctx.name, "sends back as its gradient")
        with timed_comm("send", "backward", grad_state.numel() * grad_state.element_size(), "state_passing"):
            dist.send(grad_state, dst=ctx.src, group=ctx.group)
        return grad_token, None, None, None, None


class _Send(torch.autograd.Function):
    """Send ``state`` (already in the wire format ``fmt``: checked here, before the send) to ``dst``; returns
    ``out`` unchanged plus a new token. Backward receives the state's gradient from ``dst`` in that format."""

    @staticmethod
    def forward(ctx, token, state, out, dst, group, fmt, name):
        state = check_wire(state, fmt, name, "sends")
        ctx.dst, ctx.group, ctx.fmt, ctx.device = dst, group, fmt, state.device
        with timed_comm("send", "forward", state.numel() * state.element_size(), "state_passing"):
            dist.send(state, dst=dst, group=group)
        return out, token.detach().clone()

    @staticmethod
    def backward(ctx, grad_out, grad_token):
        grad_state = torch.empty(ctx.fmt.shape, dtype=ctx.fmt.dtype, device=ctx.device)
        with timed_comm("recv", "backward", 0, "state_passing"):
            dist.recv(grad_state, src=ctx.dst, group=ctx.group)
        return grad_token, grad_state, grad_out, None, None, None, None


def sequential_pass(segments: Sequence[Segment], group, layout: str, name: str | None = None) -> list:
    """Chunk-to-chunk state passing in sequence order; ``segments`` in this rank's storage order; ``name``:
    the layer, for errors. Every passed state has the one wire format of :func:`wire_format`."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(segments):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(segments)} segments")
    owner = {c: r for r in range(P) for c in chunk_ids(layout, P, r)}
    last = P * len(ids) - 1
    grad = torch.is_grad_enabled()
    device = segments[0].state_meta()[2]
    fmt = wire_format(segments[0])
    token = torch.zeros((), device=device, requires_grad=True) if grad else torch.zeros((), device=device)
    outs: dict[int, Any] = {}
    finals: dict[int, torch.Tensor] = {}
    for j in sorted(range(len(ids)), key=lambda i: ids[i]):
        c, seg = ids[j], segments[j]
        state_in = None
        if c > 0:
            if owner[c - 1] == rank:
                state_in = finals[c - 1]
            else:
                state_in, token = _Recv.apply(token, fmt, _global(group, owner[c - 1]), group, name)
        out, final = seg.run(state_in)
        if c < last and owner[c + 1] != rank:
            out, token = _send_tied(token, to_wire(final, fmt, name), out, _global(group, owner[c + 1]), group, fmt,
                                    name)
        elif c < last:
            finals[c] = to_wire(final, fmt, name)
        outs[j] = out
    return [outs[j] for j in range(len(ids))]


def _send_tied(token, state, out, dst, group, fmt, name):
    """``_Send`` on a tensor output or the first tensor of a tuple output."""
    if isinstance(out, torch.Tensor):
        return _Send.apply(token, state, out, dst, group, fmt, name)
    first, token = _Send.apply(token, state, out[0], dst, group, fmt, name)
    return (first, *out[1:]), token


def scan_pass(segments: Sequence[Segment], group, layout: str) -> list:
    """Local maps -> one all-gather -> fp32 exclusive prefix in sequence order -> outputs."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(segments):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(segments)} segments")
    local = [seg.local_map() for seg in segments]
    stacked = torch.stack([hi(m) for m, _ in local])              # [n, ...]
    gathered = all_gather(stacked, group, tag="state_passing")           # [P, n, ...]
    by_chunk: dict[int, torch.Tensor] = {}
    for r, row in enumerate(gathered.unbind(0)):   # views (unbind, unlike indexing, runs on fake CUDA too)
        for c, packed in zip(chunk_ids(layout, P, r), row.unbind(0)):
            by_chunk[c] = packed
    maps = [by_chunk[c] for c in range(P * len(ids))]
    states = compose_prefix(segments[0], maps, upto=max(ids))
    outs = [seg.finish(aux, states[c]) for seg, (_, aux), c in zip(segments, local, ids)]
    outs[0] = tie(outs[0], gathered)
    return outs


def pass_state(segments: Sequence[Segment], strategy: str, group, layout: str, name: str | None = None) -> list:
    """``name``: the layer (its path), named by the errors."""
    if strategy == "scan":
        return scan_pass(segments, group, layout)
    if strategy == "sequential":
        return sequential_pass(segments, group, layout, name)
    raise ValueError(f"recurrent strategy {strategy!r}: use one of {STRATEGIES}")


