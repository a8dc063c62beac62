"""Packed rows and padding through recurrent layers: the state resets at every document start.

A chunk is cut at its document starts (:class:`DocumentSegment`); a chunk holding a start has
the map ``A = 0`` (its end state does not depend on the incoming state), so both strategies and
every layout stay unchanged around it. The document ids come from the ``ringmaster_batch`` kwarg
(or, for a mixer called without kwargs, from the model's step carrier, :mod:`ringmaster.sharding.carrier`);
the cuts themselves come from the batch's host runs (``CPBatch.runs``), never from the ids' values.
"""

from __future__ import annotations

from typing import Sequence

import torch

# by_parts: the kinds cut a documents batch into its split and whole parts with the step context's one helper
from ..sharding.documents import Runs, by_parts  # noqa: F401
from .scan import chunk_ids, tie

class DocumentSegment:
    """A segment whose tokens may belong to several documents (a packed row, or padding).

    The recurrence restarts from a zero state at every document start, exactly as if each
    document ran alone. ``pattern``: per row of the chunk's ``B`` rows, ``(a document starts on the chunk's
    first token, the document starts inside it)``, from the batch's host runs (``Runs.pattern``, through
    :func:`local_documents`); ``length``: the chunk's tokens.

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

    def __init__(self, base, pattern: Sequence[tuple], length: int):
        self.base = base
        self.dim = getattr(base, "seq_dim", 1)    # the token dim of the base's outputs ([b, d, l]: 2)
        patterns: dict[tuple, list[int]] = {}
        for r, key in enumerate(pattern):
            patterns.setdefault(key, []).append(r)
        self.length = length
        self.batch = len(pattern)
        self.groups = [(rows, reset, list(cuts)) for (reset, cuts), rows in patterns.items()]
        self.trivial = len(self.groups) == 1 and not self.groups[0][1] and not self.groups[0][2]
        order = [r for rows, _, _ in self.groups for r in rows]
        self._inverse = None
        if order != list(range(self.batch)):
            self._inverse = torch.empty(self.batch, dtype=torch.long)
            self._inverse[torch.tensor(order)] = torch.arange(self.batch)

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
            outs.append(torch.cat([y0, *rest], dim=self.dim) if rest else y0)
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
            outs.append(torch.cat(ys, dim=self.dim) if len(ys) > 1 else ys[0])
            finals.append(final)
        return self._tied(self._assemble(outs), state_in), self._assemble(finals)


class PiecesSegment:
    """:class:`DocumentSegment` as data: the chunk's documents (:class:`~ringmaster.sharding.documents.ChunkPieces`,
    made in the shard step) gathered into padded batches of pieces, one per group of piece lengths, each run by the
    unmodified kernel in one call (``base.with_tensors`` and ``base.packed_final``).
    The first piece of a row is left-aligned (it may continue the
    incoming state; the padding after it reaches no output), every later piece right-aligned behind padding, which
    must leave a document's start state exactly as it is.

    Zeros do for the kinds whose zero inputs keep a zero state zero (gated DeltaNet and KDA, Mamba2, Mamba1,
    lightning, RG-LRU). A lone piece the state enters and leaves fills its row, since padding after it would move
    the state it passes on, unless the segment's padding leaves *any* state as it is (``base.neutral_padding``:
    gated DeltaNet's ``g = beta = 0``, the Mamba step size 0, RG-LRU's ``a = 1``, mLSTM's gates, lightning's and
    RWKV's padding marked not ``live`` so their fixed decay skips it; not a Mamba step size clamped above 0 nor
    gates computed in the kernel): then the batch may pad it to a power of two too (``ChunkPieces.neutral``: a
    documents shard's split part, whose length is new per packing, when every layer's segment pads neutrally). The
    stabilised states pad with a neutral value per input instead: ``base.with_tensors(
    gather)`` calls ``gather(t, fill)`` (mLSTM: input gate ``-1e30`` and forget gate ``1e4``, so ``e^i = 0``,
    ``log f = 0`` and ``(C, n, m)`` stay put whatever they are; RWKV: key ``-1e30``, which leaves the WKV's "no
    state" ``(0, 0, -1e38)`` representing zero, with a finite denominator and no weight at the first real token,
    where a zero key would add ``e^0 v``). ``gather.starts`` (``[rows * S_g]`` bool: the padded slot starts a
    document) is there for a kind whose document start state is not the "no state" its maps are composed from
    (mLSTM: ``m = 0`` against ``-1e38``); ``base.start_state(state)``, when defined, is the state a document starts
    from (else zeros; RWKV: ``(0, 0, -1e38)``).

    The first piece of a row takes the incoming state (a document's start state when one starts on the chunk's
    first token), every later one a document's start state; the chunk's map is the first piece's when it is the
    row's only one and the state enters, else the reset map of the last piece's final state. Which tokens go where
    are index tensors, and the padded sizes (each group's slots per row and piece length) are sizes the block takes
    as dynamic (``ChunkPieces.groups``): a compiled block does not recompile for a new packing
    (a kernel that loops over the
    tokens in Python specialises on the piece length: one graph per power-of-two length at most)."""

    def __init__(self, base, pieces):
        if pieces.neutral and not getattr(base, "neutral_padding", False):
            raise RuntimeError(
                f"{type(base).__name__}: this batch's pieces are padded after a piece that passes its state on "
                "(CPBatch(pow2_pieces=True), made because every layer rm.wire's probe ran pads neutrally), but this "
                "call's padding would move the state (its kernel keywords differ from the probe's, or the batch is "
                "another runtime's); exactness would break, so it stops: compile with a static load_balance")
        self.base = base
        (rows, *_), _, device = base.state_meta()
        shapes = self._sizes(pieces)
        index, group, first, last, keep, whole = (t.to(device) for t in (pieces.index, pieces.group, pieces.first,
                                                                          pieces.last, pieces.keep, pieces.whole))
        if index.shape[0] != rows:   # one row of documents stands for every row of the batch
            index, group = index[:1].expand(rows, -1), group[:1].expand(rows, -1)
            first, last = first[:1].expand(rows, -1), last[:1].expand(rows, -1)
            keep, whole = keep[:1].expand(rows), whole[:1].expand(rows)
        self.rows, self.shapes, self.keep, self.whole = rows, shapes, keep, whole
        self.L = shapes[0][1]    # the longest group's piece length
        self.dim = getattr(base, "seq_dim", 1)    # the token dim of the base's inputs and outputs
        row = torch.arange(rows, device=device)
        # per group: each token's place in the group's padded tokens [rows * S * L], the other groups' tokens on one
        # spare place past the end (dropped); and each token's place in all groups' padded tokens, group after group
        self.flats, flat, base_token, base_slot = [], torch.zeros_like(index), 0, 0
        first_slot, last_slot = torch.zeros_like(first[:, 0]), torch.zeros_like(last[:, 0])
        self.first_in = []   # per group: the slot of each row's first piece, and whether it is in this group
        for g, (S, L) in enumerate(shapes):
            mine = group == g
            local = row[:, None] * (S * L) + index
            self.flats.append(torch.where(mine, local, rows * S * L).reshape(-1))
            flat = torch.where(mine, base_token + local, flat)
            first_slot = torch.where(first[:, 0] == g, base_slot + row * S + first[:, 1], first_slot)
            last_slot = torch.where(last[:, 0] == g, base_slot + row * S + last[:, 1], last_slot)
            self.first_in.append((row * S + first[:, 1].clamp(max=S - 1), first[:, 0] == g))
            base_token, base_slot = base_token + rows * S * L, base_slot + rows * S
        self.flat, self.first, self.last = flat.reshape(-1), first_slot, last_slot
        self.padded = [base.with_tensors(self._gather(g)) for g in range(len(shapes))]

    def _gather(self, g: int):
        """``gather(t, fill)`` of group ``g``: the token dim ``dim`` of ``t`` [rows, .., m, ..] ->
        [rows * S_g, .., L_g, ..], the padding ``fill``; ``gather.starts``: which of its slots start a document."""
        S, L = self.shapes[g]
        rows, flat = self.rows, self.flats[g]

        def gather(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            t = t.movedim(self.dim, 1)
            shape = (rows * S * L + 1, *t.shape[2:])
            padded = (t.new_zeros(shape) if fill == 0 else t.new_full(shape, fill)).index_copy(0, flat, t.flatten(0, 1))
            return padded[:-1].view(rows * S, L, *t.shape[2:]).movedim(1, self.dim)
        # the slots that start a document: all but a row's first piece where the state enters
        slot, here = self.first_in[g]
        gather.starts = torch.ones(rows * S, dtype=torch.bool, device=flat.device).index_copy(
            0, slot, ~(here & self.keep))
        return gather

    @staticmethod
    def _sizes(pieces) -> tuple:
        """Each group's slots per row and piece length, read from ``pieces.groups``' shapes: sizes a compiled block
        takes as dynamic (the Python ints ``pieces.shapes`` would specialise a graph on every new set)."""
        return tuple(tuple(t.shape[1:]) for t in pieces.groups)

    def state_meta(self):
        return self.base.state_meta()

    def combine(self, state, packed):
        return self.base.combine(state, packed)

    def _back(self, ys) -> torch.Tensor:   # per group [rows * S, ..., L, ...] -> [rows, ..., m, ...]
        ys = [y.movedim(self.dim, 1) for y in ys]
        flat = torch.cat([y.flatten(0, 1) for y in ys], dim=0)
        return flat.index_select(0, self.flat).view(self.rows, -1, *ys[0].shape[2:]).movedim(1, self.dim)

    def _states(self, state_in) -> list:
        """The incoming state of every slot of every group: a row's first piece's (a document's start state where
        ``keep`` is False), a document's start state elsewhere (zeros, or ``base.start_state``)."""
        if state_in is None:
            return [None] * len(self.shapes)
        start_state = getattr(self.base, "start_state", None)
        start = torch.zeros_like(state_in) if start_state is None else start_state(state_in)
        keep = self.keep.view(-1, *[1] * (state_in.dim() - 1))
        out = []
        for (S, _), (slot, here) in zip(self.shapes, self.first_in):
            states = start[:, None].expand(self.rows, S, *start.shape[1:]).flatten(0, 1)
            enters = keep & here.view(-1, *[1] * (state_in.dim() - 1))
            out.append(states.index_copy(0, slot, torch.where(enters, state_in, states.index_select(0, slot))))
        return out

    def local_map(self):
        maps, aux = zip(*(padded.local_map() for padded in self.padded))
        packed = torch.cat(maps, dim=0)
        first = packed.index_select(0, self.first)
        reset = self.base.state_map(self.base.packed_final(packed.index_select(0, self.last)))
        chunk = torch.where(self.whole.view(-1, *[1] * (first.dim() - 1)), first, reset.to(first.dtype))
        return chunk, aux

    def finish(self, aux, state_in):
        return self._back([_out(padded.finish(a, s)) for padded, a, s in zip(self.padded, aux, self._states(state_in))])

    def run(self, state_in):
        ys, finals = zip(*(_first(padded.run(s)) for padded, s in zip(self.padded, self._states(state_in))))
        return self._back(ys), torch.cat(finals, dim=0).index_select(0, self.last)


def document_segments(segments: Sequence, batch, path: str, size: int, rank: int, layout: str,
                      shape: tuple[int, int]) -> list:
    """The chunk segments (storage order) of a packed or padded batch, resetting at its document starts. Inside a
    compiled block, for kinds whose segments take padded inputs (``with_tensors``): a :class:`PiecesSegment` each,
    over the batch's chunk pieces. Otherwise (eager mode, where each piece runs as cut with no padding; a batch
    without pieces: no documents, pieces padded past :data:`~ringmaster.sharding.documents.PIECES_BUDGET` times
    the chunk) a :class:`DocumentSegment` each over :func:`local_documents`, whose cuts a compiled block reads as
    Python values (a recompile per packing). The segments as they are when every row is one document."""
    pieces = getattr(batch, "pieces", None)
    if (pieces is not None and torch.compiler.is_compiling() and len(pieces) == len(segments)
            and all(hasattr(seg, "with_tensors") for seg in segments)
            and global_documents(batch, path, size, *shape) is not None):   # checks the batch against the shape
        return [PiecesSegment(seg, p) for seg, p in zip(segments, pieces)]
    return with_documents(segments, local_documents(batch, path, size, rank, layout, shape, len(segments)))


def host_runs(batch) -> Runs:
    """The batch's host copy of its documents (``CPBatch.runs``, made in the shard step): the one source of the
    document cuts; a batch with document ids and no host copy is refused (nothing reads the ids' values)."""
    runs = recurrent_runs(batch)
    if runs is None:
        raise RuntimeError("a batch with document ids but no host runs (CPBatch.runs): build it with CPBatch, as the "
                           "shard step does, so the document cuts are never read back from the device")
    return runs


def recurrent_runs(batch) -> Runs | None:
    """The host runs the recurrent layers cut at (``CPBatch.recurrent_runs``: a run of padding is one document),
    else the batch's own; None without any."""
    return getattr(batch, "recurrent_runs", getattr(batch, "runs", None))


def _first(result) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outputs, final state)`` of a kernel call that returned them (as a tuple)."""
    return result[0], result[1]


def _out(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def global_documents(batch, path: str, size: int, rows: int, local_len: int) -> torch.Tensor | None:
    """The batch's global document ids ``[rows, S]`` for a layer holding ``local_len`` tokens of a CP
    group of ``size``, checked against that shape; None when every row is one document."""
    docs = getattr(batch, "recurrent_doc_ids", getattr(batch, "doc_ids", None))   # CPBatch: doc_ids unless padded
    if docs is None:
        return None
    seq_len = docs.shape[-1]
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
                    n_chunks: int) -> list[tuple[torch.Tensor, torch.Tensor | None, int, tuple]] | None:
    """For each chunk this rank stores (storage order): ``(docs [B, m], prev [B] | None, start, pattern)``
    from the global document ids, or None when every row is one document (nothing to reset). ``pattern``
    (per row: a document starts on the chunk's first token, the cuts inside it) comes from the batch's
    host runs: no device read."""
    B, local_len = shape
    docs = global_documents(batch, path, size, B, local_len)
    if docs is None:
        return None
    runs = host_runs(batch)
    m = local_len // n_chunks
    out = []
    for c in chunk_ids(layout, size, rank):
        start = c * m
        prev = docs[:, start - 1] if start > 0 else None
        out.append((docs[:, start:start + m], prev, start, runs.pattern(start, start + m, B)))
    return out


def with_documents(segments: Sequence, docs) -> list:
    """Wrap each segment in a :class:`DocumentSegment` (``docs`` from :func:`local_documents`)."""
    if docs is None:
        return list(segments)
    return [DocumentSegment(seg, pattern, d.shape[1]) for seg, (d, _, _, pattern) in zip(segments, docs)]
