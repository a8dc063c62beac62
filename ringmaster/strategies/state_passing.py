"""Exact cross-rank state passing for recurrent layers (Mamba2 mixers, gated DeltaNet).

A shard of a recurrent layer needs the state the earlier shards leave behind. Every layer
ringmaster handles is *affine in its incoming state* over a stretch of tokens::

    S_end = A · S_start + b        (A: per-head scalar decay for Mamba2,
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
(or, for a mixer called without kwargs, from a pre-hook on its enclosing layer).

Products of decays are only ever multiplied, never divided. The layer adapters
(:mod:`.mamba`, :mod:`.linear_attn`) describe one chunk of their kernel as a ``Segment``;
this module only knows segments, layouts and collectives.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from ..architectures import STATEFUL_PATTERN
from ..profiling import timed_comm

class UnsupportedLayerError(RuntimeError):
    """A layer ringmaster cannot make exact under CP (fail closed, never silently wrong).
    ``ringmaster.UnsupportedLayerError`` / ``ringmaster.wiring.UnsupportedLayerError`` are this class."""

STRATEGIES = ("scan", "sequential")


# --------------------------------------------------------------------------- segments


class Segment(Protocol):
    """One contiguous stretch of tokens of one recurrent kernel call."""

    def local_map(self) -> tuple[torch.Tensor, Any]:
        """``(packed map (A, b) in fp32, aux)`` with a zero incoming state."""

    def combine(self, state: torch.Tensor | None, packed: torch.Tensor) -> torch.Tensor:
        """``A · state + b`` (``b`` when ``state`` is None), fp32."""

    def finish(self, aux: Any, state_in: torch.Tensor | None) -> Any:
        """The segment's outputs for incoming state ``state_in`` (None: zero), from ``aux``."""

    def run(self, state_in: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
        """``(outputs, final state)`` computed directly from ``state_in`` (the sequential path)."""

    def state_meta(self) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
        """Shape, dtype and device of the state tensor this segment passes on."""


def state_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or float64 when an input is float64: maps, prefixes and states never go below fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def hi(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def chunk_ids(layout: str, size: int, rank: int) -> list[int]:
    """Global chunk indices (sequence order) of the chunks ``rank`` stores, in storage order."""
    from .. import balancers

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
        return (grad, *[torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.metas])


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
    """``state = recv(src)``; backward sends the state's gradient back to ``src``.

    ``token`` chains every p2p op of one layer call so that autograd runs their backwards in
    exactly the reverse order on every rank (no rank waits on a send the peer has not reached)."""

    @staticmethod
    def forward(ctx, token, shape, dtype, src, group):
        ctx.src, ctx.group = src, group
        buf = torch.empty(shape, dtype=dtype, device=token.device)
        with timed_comm("recv", "forward", 0, "state_passing"):
            dist.recv(buf, src=src, group=group)
        return buf, token.detach().clone()

    @staticmethod
    def backward(ctx, grad_state, grad_token):
        grad_state = grad_state.contiguous()
        with timed_comm("send", "backward", grad_state.numel() * grad_state.element_size(), "state_passing"):
            dist.send(grad_state, dst=ctx.src, group=ctx.group)
        return grad_token, None, None, None, None


class _Send(torch.autograd.Function):
    """Send ``state`` to ``dst``; returns ``out`` unchanged plus a new token. Backward receives the
    state's gradient from ``dst``."""

    @staticmethod
    def forward(ctx, token, state, out, dst, group):
        ctx.dst, ctx.group = dst, group
        ctx.meta = (state.shape, state.dtype, state.device)
        state = state.contiguous()
        with timed_comm("send", "forward", state.numel() * state.element_size(), "state_passing"):
            dist.send(state, dst=dst, group=group)
        return out, token.detach().clone()

    @staticmethod
    def backward(ctx, grad_out, grad_token):
        shape, dtype, device = ctx.meta
        grad_state = torch.empty(shape, dtype=dtype, device=device)
        with timed_comm("recv", "backward", 0, "state_passing"):
            dist.recv(grad_state, src=ctx.dst, group=ctx.group)
        return grad_token, grad_state, grad_out, None, None


def sequential_pass(segments: Sequence[Segment], group, layout: str) -> list:
    """Chunk-to-chunk state passing in sequence order; ``segments`` in this rank's storage order."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(segments):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(segments)} segments")
    owner = {c: r for r in range(P) for c in chunk_ids(layout, P, r)}
    last = P * len(ids) - 1
    grad = torch.is_grad_enabled()
    device = segments[0].state_meta()[2]
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
                shape, dtype, _ = seg.state_meta()
                state_in, token = _Recv.apply(token, shape, dtype, _global(group, owner[c - 1]), group)
        out, final = seg.run(state_in)
        if c < last and owner[c + 1] != rank:
            out, token = _send_tied(token, hi(final), out, _global(group, owner[c + 1]), group)
        else:
            finals[c] = hi(final)
        outs[j] = out
    return [outs[j] for j in range(len(ids))]


def _send_tied(token, state, out, dst, group):
    """``_Send`` on a tensor output or the first tensor of a tuple output."""
    if isinstance(out, torch.Tensor):
        return _Send.apply(token, state, out, dst, group)
    first, token = _Send.apply(token, state, out[0], dst, group)
    return (first, *out[1:]), token


def scan_pass(segments: Sequence[Segment], group, layout: str) -> list:
    """Local maps -> one all-gather -> fp32 exclusive prefix in sequence order -> outputs."""
    from ..comm import all_gather

    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(segments):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(segments)} segments")
    local = [seg.local_map() for seg in segments]
    stacked = torch.stack([hi(m) for m, _ in local])              # [n, ...]
    gathered = all_gather(stacked, group, tag="state_passing")           # [P, n, ...]
    by_chunk: dict[int, torch.Tensor] = {}
    for r in range(P):
        for j, c in enumerate(chunk_ids(layout, P, r)):
            by_chunk[c] = gathered[r, j]
    maps = [by_chunk[c] for c in range(P * len(ids))]
    states = compose_prefix(segments[0], maps, upto=max(ids))
    outs = [seg.finish(aux, states[c]) for seg, (_, aux), c in zip(segments, local, ids)]
    outs[0] = tie(outs[0], gathered)
    return outs


def pass_state(segments: Sequence[Segment], strategy: str, group, layout: str) -> list:
    if strategy == "scan":
        return scan_pass(segments, group, layout)
    if strategy == "sequential":
        return sequential_pass(segments, group, layout)
    raise ValueError(f"recurrent strategy {strategy!r}: use one of {STRATEGIES}")


# --------------------------------------------------------------------------- documents


class DocumentSegment:
    """A segment whose tokens may belong to several documents (a packed row, or padding).

    The recurrence restarts from a zero state at every document start, exactly as if each
    document ran alone. ``docs [B, m]``: the global document id of each token of the chunk;
    ``prev [B]``: the id of the token just before the chunk in sequence order (None for the
    first chunk of the sequence, whose incoming state is zero anyway).

    The chunk is cut at its document starts into pieces, each run by the unmodified kernel (any
    kernel: no ``seq_idx`` support needed). The first piece continues the incoming state unless a
    document starts exactly at the chunk's first token; every later piece starts from zero. The
    chunk's affine map is then a "reset" map: ``A = 0`` (the incoming state cannot reach the end
    of the chunk) and ``b`` = the last piece's final state, so the scan's prefix composition and
    the sequential hand-over stay unchanged. Rows with different cut patterns (B > 1 with padding)
    are run in groups of identical patterns.

    ``base`` must provide, besides the :class:`Segment` methods, ``sub(rows, start, stop)`` (the
    same kind of segment over some batch rows and a token range) and ``state_map(final)`` (the
    packed map ``(A=0, b=final)``)."""

    def __init__(self, base, docs: torch.Tensor, prev: torch.Tensor | None):
        self.base = base
        B, m = docs.shape
        inner = docs[:, 1:] != docs[:, :-1]
        at_start = (docs[:, 0] != prev) if prev is not None else torch.zeros(B, dtype=torch.bool, device=docs.device)
        patterns: dict[tuple, list[int]] = {}
        for r in range(B):
            key = (bool(at_start[r]), tuple((inner[r].nonzero().flatten() + 1).tolist()))
            patterns.setdefault(key, []).append(r)
        self.length = m
        self.batch = B
        self.groups = [(rows, reset, list(cuts)) for (reset, cuts), rows in patterns.items()]
        self.trivial = len(self.groups) == 1 and not self.groups[0][1] and not self.groups[0][2]
        order = [r for rows, _, _ in self.groups for r in rows]
        self._inverse = None
        if order != list(range(B)):
            self._inverse = torch.empty(B, dtype=torch.long)
            self._inverse[torch.tensor(order)] = torch.arange(B)

    # the prefix composition and the state's layout are the base segment's
    def state_meta(self):
        return self.base.state_meta()

    def combine(self, state, packed):
        return self.base.combine(state, packed)

    def _rows(self, rows: list[int]):
        return None if len(rows) == self.batch else rows

    def _pieces(self, rows: list[int], cuts: list[int]) -> list:
        bounds = [0, *cuts, self.length]
        return [self.base.sub(self._rows(rows), a, b) for a, b in zip(bounds, bounds[1:])]

    def _select(self, state: torch.Tensor | None, rows: list[int]):
        if state is None or len(rows) == self.batch:
            return state
        return state.index_select(0, torch.tensor(rows, device=state.device))

    def _assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out if self._inverse is None else out.index_select(0, self._inverse.to(out.device))

    def local_map(self):
        if self.trivial:
            return self.base.local_map()
        packed, aux = [], []
        for rows, reset, cuts in self.groups:
            pieces = self._pieces(rows, cuts)
            if reset:                       # a document starts on the chunk's first token
                first = _first(pieces[0].run(None))
                head = (None, first[0])
                final = first[1]
            else:
                p0, a0 = pieces[0].local_map()
                head, final = (a0, None), None
            rest = []
            for piece in pieces[1:]:
                out, final = _first(piece.run(None))
                rest.append(out)
            packed.append(p0 if (not reset and not cuts) else self.base.state_map(final))
            aux.append((pieces[0], reset, head, rest))
        return self._assemble(packed), aux

    def finish(self, aux, state_in):
        if self.trivial:
            return self.base.finish(aux, state_in)
        outs = []
        for (rows, _, _), (piece, reset, (a0, y0), rest) in zip(self.groups, aux):
            if not reset:
                y0 = _out(piece.finish(a0, self._select(state_in, rows)))
            outs.append(torch.cat([y0, *rest], dim=1) if rest else y0)
        return self._tied(self._assemble(outs), state_in)

    def _tied(self, out, state_in):
        """A document that starts on the chunk's first token ignores the incoming state; keep it in the
        graph anyway (zero gradient), so the backward of the collective or p2p receive that produced it
        runs on this rank too (else the sending rank waits for a gradient forever)."""
        if state_in is None or not any(reset for _, reset, _ in self.groups):
            return out
        return tie(out, state_in)

    def run(self, state_in):
        if self.trivial:
            return self.base.run(state_in)
        outs, finals = [], []
        for rows, reset, cuts in self.groups:
            pieces = self._pieces(rows, cuts)
            y, final = _first(pieces[0].run(None if reset else self._select(state_in, rows)))
            ys = [y]
            for piece in pieces[1:]:
                y, final = _first(piece.run(None))
                ys.append(y)
            outs.append(torch.cat(ys, dim=1) if len(ys) > 1 else ys[0])
            finals.append(final)
        return self._tied(self._assemble(outs), state_in), self._assemble(finals)


def _first(result) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outputs, final state)`` of a kernel call that returned them (as a tuple)."""
    return result[0], result[1]


def _out(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def take_batch(kwargs: dict, ctx: "LayerContext"):
    """The ``ringmaster_batch`` of this call, removed from ``kwargs`` (the kernels never see it):
    the kwarg itself when the layer forwarded it, else what the enclosing layer's pre-hook saw."""
    from ..documents import BATCH_KWARG

    batch = kwargs.pop(BATCH_KWARG, None)
    return batch if batch is not None else ctx.batch


def global_documents(batch, path: str, size: int, rows: int, local_len: int) -> torch.Tensor | None:
    """The batch's global document ids ``[rows, S]`` for a layer holding ``local_len`` tokens of a CP
    group of ``size``, checked against that shape; None when every row is one document."""
    docs = getattr(batch, "doc_ids", None) if batch is not None else None
    if docs is None:
        return None
    seq_len = int(docs.shape[-1])
    if getattr(batch, "size", size) != size or seq_len != local_len * size:
        raise RuntimeError(
            f"{path}: the batch's document ids describe {seq_len} tokens over CP size {getattr(batch, 'size', '?')}, "
            f"but this layer holds {local_len} tokens of a CP group of size {size}; pass the batch through "
            "context_parallel_region / ContextParallelContextManager once per forward")
    if docs.shape[0] != rows:
        if docs.shape[0] != 1:
            raise RuntimeError(f"{path}: document ids for {docs.shape[0]} rows, the layer got {rows}")
        docs = docs.expand(rows, -1)
    return docs


def local_documents(batch, path: str, size: int, rank: int, layout: str, shape: tuple[int, int],
                    n_chunks: int) -> list[tuple[torch.Tensor, torch.Tensor | None, int]] | None:
    """For each chunk this rank stores (storage order): ``(docs [B, m], prev [B] | None, start)`` from
    the global document ids, or None when every row is one document (nothing to reset)."""
    B, local_len = shape
    docs = global_documents(batch, path, size, B, local_len)
    if docs is None:
        return None
    m = local_len // n_chunks
    out = []
    for c in chunk_ids(layout, size, rank):
        start = c * m
        prev = docs[:, start - 1] if start > 0 else None
        out.append((docs[:, start:start + m], prev, start))
    return out


def with_documents(segments: Sequence, docs) -> list:
    """Wrap each segment in a :class:`DocumentSegment` (``docs`` from :func:`local_documents`)."""
    if docs is None:
        return list(segments)
    return [DocumentSegment(seg, d.to(_device(seg)), None if p is None else p.to(_device(seg)))
            for seg, (d, p, _) in zip(segments, docs)]


def _device(seg) -> torch.device:
    return seg.state_meta()[2]


# --------------------------------------------------------------------------- per-layer context


@dataclass
class LayerContext:
    """What a wired layer knows: its path and CP group. Layout and strategy are read from the
    active runtime on every call (they are per-run settings, never stored in module globals)."""

    path: str
    group: Any = None
    # the ``ringmaster_batch`` the enclosing layer was last called with (set by an instance-local
    # forward pre-hook; only used when the kernels are called without it): see :func:`take_batch`
    batch: Any = field(default=None, repr=False)

    def resolve(self) -> tuple[Any, int, str, str]:
        """``(group, size, layout, strategy)`` for this call."""
        from ..runtime import active

        rt = active(required=False)
        group = self.group if self.group is not None else (rt.cp_group if rt is not None else None)
        if group is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        size = dist.get_world_size(group) if group is not None else 1
        layout = rt.shard_load_balance if rt is not None else "contiguous"
        strategy = getattr(rt.config, "recurrent", "auto") if rt is not None else "auto"
        if strategy == "auto":
            strategy = "sequential" if size <= 2 else "scan"
        return group, size, layout, strategy


def check_call_kwargs(path: str, kwargs: dict) -> None:
    """Refuse packing metadata that describes the *local* shard or the full row in kernel terms
    (``cu_seqlens``/``seq_idx``): under CP the document structure comes from the global document
    ids of the ``ringmaster_batch`` kwarg (see :class:`DocumentSegment`); these would be ambiguous."""
    for key in ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{path}: {key} reached the recurrent kernel under CP; pass packed rows through "
                "context_parallel_region / ContextParallelContextManager (position_ids restarting per document, "
                "or cu_seq_lens in the full batch), which carry the global document boundaries to every layer"
            )


def call_guard(ctx: LayerContext) -> Callable[[tuple, dict], None]:
    """Checks before every forward of a wired layer ``forward(hidden_states, cache, attention_mask)``:
    no cache under CP (training runs use_cache=False), and a padding mask cut like the shard."""
    def guard(args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
        if cache is not None and ctx.resolve()[1] > 1:
            raise RuntimeError(f"{ctx.path}: the model was called with a cache under CP; "
                               "run it with use_cache=False in training")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if isinstance(mask, torch.Tensor) and isinstance(hidden, torch.Tensor) and mask.dim() == 2 \
                and mask.shape[-1] != hidden.shape[1]:
            raise ValueError(f"{ctx.path}: the padding mask has {mask.shape[-1]} positions but the shard has "
                             f"{hidden.shape[1]}; shard the attention_mask with the batch")
    return guard


# --------------------------------------------------------------------------- interception


class _Overlay(dict):
    """Globals for a re-bound forward: our replacements first, then the live module namespace."""

    def __init__(self, base: dict, replacements: dict):
        super().__init__(replacements)
        self._base = base
        self.setdefault("__builtins__", base.get("__builtins__", builtins))

    def __missing__(self, key):
        return self._base[key]


def _rebuild_chain(fn: Callable, innermost_globals: dict) -> Callable:
    """Copy ``fn`` (a chain of functools.wraps decorators around a plain function) so the innermost
    function looks up its globals in ``innermost_globals``; each wrapper is copied with its closure
    cell that held the next function replaced. Nothing shared (the class, the module) is touched."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, innermost_globals, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__dict__.update(fn.__dict__)
        return new
    new_inner = _rebuild_chain(inner, innermost_globals)
    cells = fn.__closure__ or ()
    hits = [i for i, cell in enumerate(cells) if cell.cell_contents is inner]
    if len(hits) != 1:
        raise TypeError(f"cannot see through the decorator {fn.__qualname__} around {inner.__qualname__}")
    closure = tuple(types.CellType(new_inner) if i == hits[0] else cell for i, cell in enumerate(cells))
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    new.__wrapped__ = new_inner
    return new


def interceptable(module, path: str, required: Sequence[str]) -> Callable:
    """The class forward of ``module`` if it calls every kernel in ``required`` by module-global name
    (so re-binding those names reaches it); raises naming the layer otherwise."""
    cls = type(module)
    if "forward" in vars(module):
        raise UnsupportedLayerError(
            f"layer {path!r} ({cls.__name__}) has an instance-level forward (a hub kernel via kernelize(), or "
            "another patch) that would bypass ringmaster's state passing; load the model without use_kernels / "
            "that patch, or unwire the other tool first"
        )
    forward = cls.forward
    inner = inspect.unwrap(forward)
    names = set(inner.__code__.co_names)
    missing = [name for name in required if name not in names]
    if missing:
        raise UnsupportedLayerError(
            f"layer {path!r} ({cls.__name__}) does not call {missing} from its forward (a different transformers "
            "version or a replaced forward); ringmaster cannot route its sequence kernels through the state "
            "passing, so CP would be silently wrong. Declare it with another strategy or leave CP off"
        )
    if "__builtins__" not in inner.__globals__:
        raise UnsupportedLayerError(f"layer {path!r}: its forward has no module namespace to re-bind")
    return forward


def rebind_forward(module, path: str, replacements: dict[str, Callable], required: Sequence[str],
                   guard: Callable[[tuple, dict], None] | None = None) -> Callable[[], None]:
    """Give ``module`` (this instance only) a copy of its class forward whose kernel names resolve to
    ``replacements``; returns the undo. ``guard(args, kwargs)`` runs before every call."""
    forward = interceptable(module, path, required)
    inner = inspect.unwrap(forward)
    rebound = _rebuild_chain(forward, _Overlay(inner.__globals__, replacements))
    bound = types.MethodType(rebound, module)

    if guard is not None:
        @functools.wraps(rebound)
        def guarded(*args, **kwargs):
            guard(args, kwargs)
            return bound(*args, **kwargs)
        module.forward = guarded
    else:
        module.forward = bound
    module._ringmaster_recurrent = path

    def restore() -> None:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_ringmaster_recurrent", None)

    return restore


# --------------------------------------------------------------------------- wiring


KINDS = ("mamba2", "gated_deltanet")
# kinds whose wired layers reset state and conv halo at document starts (packed / padded rows)
DOCUMENT_AWARE_KINDS = ("mamba2", "gated_deltanet")


def stateful_layers(model) -> list[tuple[str, str]]:
    """``(path, class name)`` of every innermost module that carries state along the sequence: a class
    name matching the stateful pattern, or a module holding SSM parameters (``A_log``/``dt_bias``)."""
    found = []
    for path, module in model.named_modules():
        cls = type(module).__name__
        direct = module.__dict__.get("_parameters", {})
        if STATEFUL_PATTERN.search(cls) or "A_log" in direct or "dt_bias" in direct:
            found.append((path, cls))
    # name the mixer itself, not the decoder layer around it (JambaMambaDecoderLayer > JambaMambaMixer)
    def inside(q: str, p: str) -> bool:
        return q != p and (p == "" or q.startswith(p + "."))

    return [(p, c) for p, c in found if not any(inside(q, p) for q, _ in found)]


def _declared(model) -> tuple[list[tuple[str, Any, str]], list[tuple[str, str]]]:
    """``([(path, module, kind)], [(path, cls) unknown stateful])`` from the model's family spec."""
    from ..architectures import get_architecture

    try:
        spec = get_architecture(model)
        known = spec.recurrent_classes
        ignore = set(spec.ignore_classes)
    except ValueError:
        known, ignore = {}, set()
    modules = dict(model.named_modules())
    layers, unknown = [], []
    for path, cls in stateful_layers(model):
        if cls in known:
            layers.append((path, modules[path], known[cls]))
        elif cls not in ignore:
            unknown.append((path, cls))
    return layers, unknown


def unsupported_message(path: str, cls: str, model_type: str | None = None) -> str:
    who = f"model_type {model_type!r}" if model_type else "this model's family"
    return (
        f"layer {path!r} ({cls}) carries recurrent state along the sequence and {who} does not declare how to "
        "pass it across CP ranks; sharding it would train silently wrong. ringmaster passes state exactly for "
        "Mamba2 mixers ('mamba2') and gated-DeltaNet layers ('gated_deltanet') that call the transformers "
        "kernels; a Mamba1 selective scan (jamba, falcon_mamba, mamba) or another recurrence is not supported. "
        "If the layer is one of those two kinds, declare it in an ArchitectureSpec "
        f"(recurrent_classes={{{cls!r}: 'mamba2' | 'gated_deltanet'}}) and register it with "
        "rm.register_architecture(spec, override=True); otherwise use a CP size of 1 for this model"
    )


def _adapter(kind: str):
    if kind == "mamba2":
        from .mamba import wire_mamba2_layer

        return wire_mamba2_layer
    if kind == "gated_deltanet":
        from .linear_attn import wire_gated_deltanet_layer

        return wire_gated_deltanet_layer
    raise UnsupportedLayerError(f"recurrent strategy {kind!r} is unknown; ringmaster knows {KINDS}")


def check_recurrent_layers(model, layers: Sequence[tuple[str, Any, str]] | None = None) -> list:
    """Validate without changing anything: every stateful layer is declared and interceptable."""
    if layers is None:
        layers, unknown = _declared(model)
        if unknown:
            path, cls = unknown[0]
            raise UnsupportedLayerError(unsupported_message(path, cls, getattr(model.config, "model_type", None)))
    for path, module, kind in layers:
        _adapter(kind)  # raises on an unknown kind
        from .linear_attn import REQUIRED as GDN_REQUIRED
        from .mamba import REQUIRED as MAMBA_REQUIRED

        interceptable(module, path, MAMBA_REQUIRED if kind == "mamba2" else GDN_REQUIRED)
    return list(layers)


@dataclass
class RecurrentWiring:
    layers: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    _restores: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        for undo in reversed(self._restores):
            undo()
        self._restores.clear()
        self.layers.clear()
        self.kinds.clear()


def wire_recurrent_layers(model, group=None, layers=None) -> RecurrentWiring:
    """Route every declared recurrent layer of ``model`` through exact cross-rank state passing.

    ``group``: the CP process group (default: the active runtime's at call time). Fails closed,
    before touching anything, on a stateful layer the family does not declare. The returned
    handle's ``restore()`` puts every layer's original forward back."""
    if layers is None:
        layers = check_recurrent_layers(model)
    else:
        layers = check_recurrent_layers(model, [(p, m, k) for p, m, k in layers])
    wiring = RecurrentWiring()
    modules = dict(model.named_modules())
    try:
        for path, module, kind in layers:
            ctx = LayerContext(path, group)
            wiring._restores.append(_adapter(kind)(module, ctx))
            wiring._restores.append(_batch_hook(modules.get(path.rpartition(".")[0], model), ctx))
            wiring.layers.append(path)
            wiring.kinds.append(kind)
    except Exception:
        wiring.restore()
        raise
    return wiring


def _batch_hook(parent, ctx: LayerContext) -> Callable[[], None]:
    """An instance-local forward pre-hook on the module enclosing a wired layer (its decoder layer)
    that records the call's ``ringmaster_batch`` in ``ctx``: the document ids then reach the layer's
    kernels even when the decoder layer calls the mixer without forwarding its kwargs. Set on every
    call (None when absent), so no batch outlives the forward that brought it (gradient checkpointing
    replays the decoder layer, hook included)."""
    from ..documents import BATCH_KWARG

    def hook(module, args, kwargs):
        ctx.batch = kwargs.get(BATCH_KWARG)
        return None

    handle = parent.register_forward_pre_hook(hook, with_kwargs=True)

    def restore() -> None:
        handle.remove()
        ctx.batch = None

    return restore


def recurrent_plan(models, size: int):
    """``(gated_deltanet_mixers, kda_mixers, mamba2_mixers)`` that need state passing at CP ``size``
    (lists of modules; all empty at size 1). Raises on a stateful layer ringmaster cannot pass."""
    gdn, kda, mamba = [], [], []
    if size <= 1:
        return gdn, kda, mamba
    for model in models:
        for path, module, kind in check_recurrent_layers(model):
            (mamba if kind == "mamba2" else gdn).append(module)
    return gdn, kda, mamba


def decode_only_without_cp(ctx: LayerContext, namespace: dict, name: str):
    """Cached single-token decoding kernels: the original at CP size 1, refused under CP."""
    def call(*args, **kwargs):
        if ctx.resolve()[1] > 1:
            raise RuntimeError(f"{ctx.path}: {name} (cached decoding) is not supported under CP; "
                               "run the model with use_cache=False")
        return namespace[name](*args, **kwargs)
    return call
