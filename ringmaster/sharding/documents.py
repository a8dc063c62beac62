"""Global document structure of a batch, captured before sharding, and the masks it implies.

A packed row holds several documents (position_ids restart at each, or explicit
``cu_seq_lens``); a padded row holds one document and padding. Both become one integer per
token, ``doc_ids [B, S]``, non-decreasing along the row: tokens attend (and recurrent state
flows) only within the same id. Padding tokens get an id of their own each, so they see
only themselves: they are never attended by real tokens, never produce NaN rows, and carry
label -100 so they are never counted.

The per-batch :class:`CPBatch` is the step context: built once per batch by the shard step from the
full batch, on the host. It holds the layout, the global document ids (on the batch's device) and
their host copy, :class:`Runs` (every document boundary as Python ints, read from the device once,
here), from which every mask plan, ring pair skip, block segment, tile skip, ``cu_seqlens``, and
recurrent document cut is derived without reading a tensor value in forward or backward (device
tensors it derives, masks and ``cu_seqlens``, are cached in the context: made once per batch). It travels to every layer
as the ``ringmaster_batch`` keyword argument (transformers forwards unknown kwargs to the attention and
linear-attention layers; a checkpoint captures it), and where a layer is called without kwargs, in the
model's one step carrier (:mod:`.carrier`). No module global holds per-batch state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from . import balancers
from .assignment import DOCUMENTS, SPARE
from .handle import StepHandle

BATCH_KWARG = "ringmaster_batch"


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids that increase where a row's positions do not continue by +1."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    start = torch.ones_like(pos[:, :1], dtype=torch.bool)
    restart = torch.cat([start, pos[:, 1:] != pos[:, :-1] + 1], dim=1)
    return restart.long().cumsum(-1) - 1


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[1, S]`` ids from flash-style cumulative lengths of one packed row."""
    cu = cu_seqlens.reshape(-1).long()
    if int(cu[0]) != 0 or int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seq_lens must start at 0 and end at the sequence length {seq_len}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths).unsqueeze(0)


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document (what RoPE needs for a packed row)."""
    S = doc_ids.shape[-1]
    idx = torch.arange(S, device=doc_ids.device).expand_as(doc_ids)
    start = torch.cat([torch.ones_like(doc_ids[:, :1], dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], 1)
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def chunk_doc_ids(doc_ids: torch.Tensor | None, seq_len: int, chunk: int, device=None) -> torch.Tensor:
    """``doc_ids`` refined by fixed-length chunks (llama4's ``attention_chunk_size``): a new id starts
    where the document changes or where a token's position *inside its document* crosses a multiple
    of ``chunk``. Computed from the global row, never from a shard's local length. This is HF's rule
    (``chunked_overlay``): chunks counted from the row start minus left padding, or from each
    document's start in a packed row (its position_ids restart at 0)."""
    if chunk < 1:
        raise ValueError(f"attention_chunk_size must be >= 1, got {chunk}")
    if doc_ids is None:
        return (torch.arange(seq_len, device=device) // chunk).unsqueeze(0)
    pos = positions_from_doc_ids(doc_ids)
    first = torch.ones_like(doc_ids[:, :1], dtype=torch.bool)
    new = torch.cat([first, (doc_ids[:, 1:] != doc_ids[:, :-1]) | (pos[:, 1:] // chunk != pos[:, :-1] // chunk)], 1)
    return new.long().cumsum(-1) - 1


def batch_documents(batch: Mapping[str, Any], seq_len: int, keep_one: bool = False) -> torch.Tensor | None:
    """The batch's ``doc_ids [B, S]``, or None when every row is one unpadded sequence. ``keep_one``: rows that
    number their positions (``position_ids``) and hold one document each keep their ids (zeros): a packed batch
    whose rows happen to be one document each is then no case of its own (a compiled runtime's blocks would compile
    the plain rows' graph for it); without position_ids a batch is plain rows either way."""
    cu = batch.get("cu_seq_lens_q", batch.get("cu_seqlens"))
    pos = batch.get("position_ids")
    mask = batch.get("attention_mask")
    doc = None
    if isinstance(cu, torch.Tensor):
        doc = doc_ids_from_cu_seqlens(cu, seq_len)
    elif isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] > 1:  # not a VLM's 3-row mrope
        doc = doc_ids_from_positions(pos)
        if not keep_one and bool((doc[:, -1] == 0).all()):
            doc = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool((mask != 0).all()):
        if mask.dtype != torch.bool and int(mask.max()) > 1:  # axolotl-style packed ids (1, 1, 2, 2, ...; 0 = pad)
            real_doc = mask.long()
        else:
            real_doc = doc if doc is not None else torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
        pad = mask == 0
        # each padding token its own document; ids stay non-decreasing along the row
        bump = pad.long() + torch.cat([torch.zeros_like(pad[:, :1]), pad[:, :-1]], 1).long()
        doc = real_doc + bump.cumsum(-1)
    return doc


def row_cu_seqlens(runs, row: int, seq_len: int) -> torch.Tensor:
    """Row ``row``'s global ``cu_seqlens`` on the host (int64) from the batch's host runs: its document starts and
    the row's end, or one document spanning the row (``runs`` None). The one place host runs become them
    (flash varlen, :meth:`CPBatch.varlen_bounds`; FLA's CP context, ``recurrent/fla_cp``)."""
    return torch.tensor([*(runs.row(row) if runs is not None else (0,)), seq_len], dtype=torch.long)


def rows_cu_seqlens(runs, rows: int, seq_len: int) -> torch.Tensor:
    """The host ``cu_seqlens`` (int64) of ``rows`` rows flattened into one (row-major): each row's
    :func:`row_cu_seqlens` shifted to where the row starts (never a document across two rows), and the end."""
    cut = [row_cu_seqlens(runs, r, seq_len)[:-1] + r * seq_len for r in range(rows)]
    return torch.cat([*cut, torch.tensor([rows * seq_len])])


def bisect_right(seq: tuple[int, ...], x: int) -> int:
    """``bisect.bisect_right`` in plain Python: torch.compile traces it (the C builtin is a graph break)."""
    lo, hi = 0, len(seq)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < seq[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def bisect_left(seq: tuple[int, ...], x: int) -> int:
    """``bisect.bisect_left`` in plain Python (see :func:`bisect_right`)."""
    lo, hi = 0, len(seq)
    while lo < hi:
        mid = (lo + hi) // 2
        if seq[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Runs:
    """The host copy of a batch's document structure: per row, the global start of every run of equal
    document ids (ids are non-decreasing along a row, so a run is one document; a padding token is a
    run of its own). Read from the device once, in the shard step (:meth:`from_doc_ids`); every mask
    plan, segment cut, ``cu_seqlens`` and skip decision in forward and backward is derived from it
    on the host, so no layer reads a tensor value. One row stands for every row of the batch."""

    seq_len: int
    starts: tuple[tuple[int, ...], ...]   # per row: sorted run starts, the first one 0

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor) -> "Runs":
        """One host read of the change points of ``doc_ids [B, S]``."""
        d = doc_ids.reshape(-1, doc_ids.shape[-1])
        rows: list[list[int]] = [[0] for _ in range(d.shape[0])]
        if d.shape[-1] > 1:
            for r, t in (d[:, 1:] != d[:, :-1]).nonzero().tolist():
                rows[r].append(t + 1)
        return cls(d.shape[-1], tuple(tuple(r) for r in rows))

    @property
    def rows(self) -> int:
        return len(self.starts)

    def row(self, r: int) -> tuple[int, ...]:
        return self.starts[r if self.rows > 1 else 0]

    @property
    def uniform(self) -> bool:
        """Every row has the same documents."""
        return all(s == self.starts[0] for s in self.starts)

    def bounds(self, r: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of row ``r``'s runs."""
        st = self.row(r)
        return list(zip(st, (*st[1:], self.seq_len)))

    def run_of(self, r: int, t: int) -> int:
        """The index (in row ``r``) of the run holding token ``t``."""
        return bisect_right(self.row(r), t) - 1

    def spans(self, r: int, t0: int, t1: int) -> list[tuple[int, int, int]]:
        """``(run index, start, stop)`` of the runs of row ``r`` meeting ``[t0, t1)``, clipped to it."""
        st = self.row(r)
        first, last = self.run_of(r, t0), self.run_of(r, t1 - 1)
        return [(i, max(st[i], t0), min(st[i + 1] if i + 1 < len(st) else self.seq_len, t1))
                for i in range(first, last + 1)]

    def cuts(self, r: int, t0: int, t1: int) -> tuple[int, ...]:
        """Run starts of row ``r`` strictly inside ``(t0, t1)``, relative to ``t0``."""
        st = self.row(r)
        return tuple(s - t0 for s in st[bisect_right(st, t0):bisect_left(st, t1)])

    def starts_at(self, r: int, t: int) -> bool:
        st = self.row(r)
        i = bisect_left(st, t)
        return i < len(st) and st[i] == t

    def pattern(self, t0: int, t1: int, rows: int | None = None) -> tuple[tuple[bool, tuple[int, ...]], ...]:
        """Per row (``rows`` of them, default this copy's; one row stands for all), how the chunk ``[t0, t1)`` is
        cut at its document starts: ``(a document starts on its first token (never at the row's start: no state
        enters there), the run starts inside it relative to t0)``. What the recurrent kinds' resets run by."""
        return tuple((t0 > 0 and self.starts_at(r, t0), self.cuts(r, t0, t1))
                     for r in range(self.rows if rows is None else rows))

    def disjoint(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """No row shares a document between tokens ``[q0, q1)`` and ``[k0, k1)``."""
        for r in range(self.rows):
            qa, qb = self.run_of(r, q0), self.run_of(r, q1 - 1)
            ka, kb = self.run_of(r, k0), self.run_of(r, k1 - 1)
            if not (kb < qa or ka > qb):
                return False
        return True

    def longest(self) -> int:
        return max(e - s for r in range(self.rows) for s, e in self.bounds(r))

    def chunked(self, chunk: int) -> "Runs":
        """The runs cut again every ``chunk`` tokens from each run's start (:func:`chunk_doc_ids`)."""
        rows = []
        for r in range(self.rows):
            rows.append(tuple(t for s, e in self.bounds(r) for t in range(s, e, chunk)))
        return Runs(self.seq_len, tuple(rows))

    @classmethod
    def whole(cls, seq_len: int, rows: int = 1) -> "Runs":
        return cls(seq_len, tuple((0,) for _ in range(rows)))


# a rank's padded pieces may hold at most this many times its chunk's tokens (one long document and several
# short ones pad every piece to the long one); past it a compiled block cuts the chunk in Python (a recompile)
PIECES_BUDGET = 4


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (``n >= 1``): sizes a compiled graph specialises on, in few values."""
    return 1 << max(0, n - 1).bit_length()


# where one padded batch would pass the budget, the pieces come in this many groups by length (a piece longer than
# half the longest in the first, then each next group half as long, the rest in the last), each group its own padded
# batch and kernel call: padding every piece to the longest costs the piece count times it (8-16x a chunk's tokens
# on realistic packings, past the budget on 182-200 of 200 rows: ``benchmarks/pieces_budget.py``); in four groups
# none passes it there
PIECE_GROUPS = 4


@dataclass(frozen=True)
class ChunkPieces:
    """One chunk of this rank's shard (``m`` tokens) cut at its document starts, as data.

    The pieces go into one padded batch, or, where that would pass :data:`PIECES_BUDGET` and the kernels take the
    length as a size (``of(groups=PIECE_GROUPS)``), into :data:`PIECE_GROUPS` padded batches by length: a piece
    longer than half the longest piece (of any row of any of the rank's chunks) in group 0, longer than a quarter in
    group 1, and so on, the rest in the last group. Group ``g`` gives every row ``S_g`` slots of ``L_g`` tokens
    (``L_g`` a power of two, the same for
    all of a rank's chunks; at least 2 each, so no size is 0 or 1: an empty group is two slots of padding); a compiled
    block reads the sizes from ``groups``, marked dynamic, so a new packing is no new graph. The first piece of a row
    is left-aligned in its slot (it may continue the incoming state; padding after it reaches no output), every later
    piece right-aligned (zero inputs before it keep a zero state zero). Built on the host in the shard step from the
    host runs; the recurrent kernels gather their inputs by ``index`` and ``group`` and run once per group, with no
    per-packing Python value (``recurrent.documents.PiecesSegment``); the conv inserts ``n - 1`` gaps."""

    n: int                  # the most pieces of any row (a power of two, at least 2): the conv's gaps
    shapes: tuple           # per group (slots per row, piece length), host ints
    index: torch.Tensor     # [rows, m] int64: each token's position in its row's slots of its group (slot * L_g + i)
    group: torch.Tensor     # [rows, m] int64: each token's group
    first: torch.Tensor     # [rows, 2] int64: the group and slot of each row's first piece
    last: torch.Tensor      # [rows, 2] int64: the group and slot of each row's last piece
    keep: torch.Tensor      # [rows] bool: no document starts on the chunk's first token (the state enters)
    whole: torch.Tensor     # [rows] bool: one piece that the state enters (the chunk's map is that piece's)
    # a piece the state passes on may have padding after it (a power-of-two length where the state enters and leaves:
    # ``of(neutral=True)``): only kernels whose padding leaves any state as it is may run these pieces
    neutral: bool
    # an empty [0, n, L]: the piece count as a size a compiled block may mark dynamic (the conv's gaps)
    sizes: torch.Tensor
    # per group an empty [0, S_g, L_g]: its slots per row and piece length as sizes a compiled block marks dynamic
    groups: tuple

    @property
    def L(self) -> int:
        """Group 0's piece length (the longest)."""
        return self.shapes[0][1]

    @classmethod
    def of(cls, runs: "Runs", starts, m: int, device, local: bool = False, neutral: bool = False,
           groups: int = 1) -> "tuple[ChunkPieces, ...] | None":
        """The pieces of the chunks at global ``starts`` (``m`` tokens each), one padded size per group for all of
        them: one set of sizes per batch and rank. None past :data:`PIECES_BUDGET` (the padded slots of a row, all
        groups, against ``m``). A chunk of one document that the state crosses is pieces too (its one piece, and
        padding): whether this rank's chunks happen to hold no document start is no case of its own for a compiled
        block (measured: a flag for it was one more graph per hybrid, late in a run). ``local``: no state enters or
        leaves the chunks (the whole documents' part); ``neutral``: the kernels' padding leaves any state as it is
        (every wired layer's segment has ``neutral_padding``: a documents shard's split part, whose length is new per
        packing). Either way the pieces' lengths are powers of two, so a kernel that branches on them (a chunked
        scan's padding to its chunk size, a loop over the tokens in Python) sees few values. ``groups``: how many
        groups by length the pieces may come in where one would pass the budget (:data:`PIECE_GROUPS` for kernels that
        take the length as a size, ``RecurrentWiring.piece_groups``; 1: those past the budget are None)."""
        chunks = []
        for start in starts:
            pattern = runs.pattern(start, start + m)
            chunks.append(([[0, *cuts, m] for _, cuts in pattern], [not reset for reset, _ in pattern]))
        lengths = [[[e - s for s, e in zip(b, b[1:])] for b in bounds] for bounds, _ in chunks]
        # one group while it fits the budget (few documents per chunk: one kernel call, as before the groups); the
        # groups where it does not (each group count a case a compiled block compiles once)
        layout = _group_layout(lengths, 1, m, local or neutral)
        if layout is None and groups > 1:
            layout = _group_layout(lengths, groups, m, local or neutral)
        if layout is None:
            return None
        groups, grouped, slots, sizes = layout
        # at least 2: dynamo specialises a size of 1
        n = max(2, bucket(max(len(row) for chunk in lengths for row in chunk)))
        out = []
        for (bounds, keep), chunk, chunk_groups in zip(chunks, lengths, grouped):
            index, group, first, last = [], [], [], []
            for row, row_groups in zip(chunk, chunk_groups):
                seen = [0] * groups
                places = []
                for i, (x, g) in enumerate(zip(row, row_groups)):
                    slot, seen[g] = seen[g], seen[g] + 1
                    places.append((g, slot))
                    shift = 0 if i == 0 else sizes[g] - x            # the first piece left, every later one right
                    index.append(torch.arange(x) + slot * sizes[g] + shift)
                    group.append(torch.full((x,), g))
                first.append(places[0])
                last.append(places[-1])
            rows = len(chunk)
            whole = [len(row) == 1 and k for row, k in zip(chunk, keep)]
            # the chunk's length (a documents part's varies per packing) as a size a compiled block may mark dynamic
            out.append(cls(n, tuple(zip(slots, sizes)),
                           _dynamic(_on(device, torch.cat(index).view(rows, m), torch.long), 1),
                           _dynamic(_on(device, torch.cat(group).view(rows, m), torch.long), 1),
                           _on(device, first, torch.long), _on(device, last, torch.long),
                           _on(device, keep, torch.bool), _on(device, whole, torch.bool), neutral and not local,
                           _dynamic(_dynamic(torch.empty(0, n, sizes[0], device=device), 1), 2),
                           tuple(_dynamic(_dynamic(torch.empty(0, sl, L, device=device), 1), 2)
                                 for sl, L in zip(slots, sizes))))
        return tuple(out)


def _group_layout(lengths, groups: int, m: int, pow2: bool):
    """``(groups, each piece's group, slots per row of each group, piece length of each group)`` for the pieces'
    ``lengths`` (per chunk, per row) in ``groups`` groups by length, or None past :data:`PIECES_BUDGET`. ``pow2``: a
    power of two, whatever the length (``local`` or ``neutral``); else a lone piece the state enters and leaves fills
    its slot (no padding after it moves the state it passes on). An empty group is two slots of two tokens."""
    top = bucket(max(x for chunk in lengths for row in chunk for x in row))

    def group_of(x: int) -> int:
        g = 0
        while g < groups - 1 and x <= top >> (g + 1):
            g += 1
        return g

    grouped = [[[group_of(x) for x in row] for row in chunk] for chunk in lengths]
    slots, longest = [2] * groups, [0] * groups   # at least 2: dynamo specialises a size of 1
    for chunk, chunk_groups in zip(lengths, grouped):
        for row, row_groups in zip(chunk, chunk_groups):
            for g in range(groups):
                slots[g] = max(slots[g], row_groups.count(g))
            for x, g in zip(row, row_groups):
                longest[g] = max(longest[g], x)
    sizes = [2 if not x else max(2, bucket(x)) if pow2 else max(min(2, m), min(m, bucket(x))) for x in longest]
    if sum(sl * L for sl, L in zip(slots, sizes)) > PIECES_BUDGET * m:
        return None
    return groups, grouped, slots, sizes


class CPBatch:
    """What every CP layer needs to know about the whole batch, for one forward pass."""

    def __init__(self, rank: int, size: int, layout: str, seq_len: int, doc_ids: torch.Tensor | None = None,
                 rows: Mapping[str, Any] | None = None, runs: Runs | None = None, assignment=None,
                 origin: torch.Tensor | None = None, pieces: bool = True, token_mask: torch.Tensor | None = None,
                 recurrent_doc_ids: torch.Tensor | None = None, row_pieces: bool = False, heads_upto: tuple = (),
                 pow2_pieces: bool = False, piece_groups: int = 1, heads_len: int | None = None):
        self.rank, self.size, self.seq_len = rank, size, seq_len
        # every wired recurrent layer pads its pieces neutrally (RecurrentWiring.pow2_pieces): a documents shard's split
        # part runs as pieces a power of two long, so its length, new per packing, is no size a kernel loops over
        self._pow2_pieces = pow2_pieces
        # how many groups by length the recurrent pieces come in (RecurrentWiring.piece_groups: ChunkPieces.of)
        self._piece_groups = piece_groups
        # recurrent="auto": for each row length up to which a layer runs heads, whether this batch's rows are that
        # short, decided here on the host (a compiled block reads the bool, never the length: heads_rows)
        # (``heads_len``: the length it compares instead of seq_len: a compiled runtime's split part compares its row's,
        # the same every batch, so the choice is no case of its own: split_part)
        self._heads_upto = tuple(heads_upto)
        self._heads_rows = {t: 0 < (seq_len if heads_len is None else heads_len) <= t for t in self._heads_upto}
        # this rank's shard of the batch's own attention_mask [B, local] (None without one): the token weights of a
        # per-sequence statistic (the MoE router loss, sharding.router); attention never reads it (doc_ids do)
        self.token_mask = token_mask
        # load_balance="documents": the batch's Assignment (sharding.assignment); its layers run two parts,
        # split_part() over the group and whole_part() locally. None: a static layout
        self.assignment = assignment
        # whether a documents batch's whole part runs SPARE tokens of their own past its documents (Assignment.spare: a
        # compiled runtime's): by_parts pads the whole part's inputs with them (a bool, and the module's constant: an
        # int attribute would be a size of its own to dynamo, taken for the whole part's when they are equal)
        self.spare = assignment is not None and assignment.spare > 0
        self.layout = DOCUMENTS if assignment is not None else balancers.check_layout(layout)
        # a part of a documents batch: the row position of each token of its (sub-)row, host int64
        self.origin = origin
        # a part of a documents batch, as a Python bool a compiled block may read (reading ``origin`` would make the
        # host tensor, whose length is new per packing, an input the graph guards on)
        self.is_part = origin is not None
        self.doc_ids = doc_ids
        # the host copy of the documents: built here, in the shard step (the only read of doc_ids' values)
        self.runs = runs if runs is not None or doc_ids is None else Runs.from_doc_ids(doc_ids)
        # the documents the recurrent layers reset at: the same, except that a run of padding is one document (the
        # shard step's sharding.batch.padding_merged), so a padded row's chunk is a few pieces, not one per token
        self.recurrent_doc_ids = recurrent_doc_ids if recurrent_doc_ids is not None else doc_ids
        self.recurrent_runs = Runs.from_doc_ids(recurrent_doc_ids) if recurrent_doc_ids is not None else self.runs
        # the full rows' input_ids / attention_mask when the batch brought no position_ids: what an
        # absolute position rule needs (sharding.positions); None otherwise
        self.rows = rows
        # the step's base seed for dropout: drawn by the shard step (sharding.rng.step_seed), each rank's
        # forward forks its random state from it and the CP rank (sharding.rng); None: drawn at the forward
        self.rng_seed: int | None = None
        # the token-mixing check's runs (per_token(), architectures.mixing): CP attention answers per
        # token (no collective), so the attention module's own code around it is checked too
        self.stand_in = False
        self._cache: dict = {}
        # what compiled blocks hand to ringmaster's custom ops instead of reading the host facts (.handle)
        self.handle = StepHandle(self)
        # whether ChunkPieces.of found some chunk (or the whole rows) past PIECES_BUDGET: a compiled block cuts it in
        # Python (set by _chunk_pieces / _row_pieces; read by past_the_budget)
        self._past_budget = False
        # this rank's chunks cut at their document starts, as data for the recurrent kernels (made here, in the
        # shard step: a compiled block reads no per-packing Python value); None without documents
        self.pieces = self._chunk_pieces() if pieces else None
        # recurrent="heads" (row_pieces: the shard step's runtime runs it, or auto runs it on some layer for rows this
        # short: heads_rows): the whole rows cut at their document
        # starts, as data, for the kernels that run whole rows for their heads (recurrent.heads); None otherwise
        self.row_pieces = self._row_pieces() if pieces and (row_pieces or any(self._heads_rows.values())) else None
        # load_balance="documents": the two parts, made here (the shard step, on the host), never in forward, and
        # the whole part's length (its spare tokens included) as the size of an empty tensor: a compiled block reads it
        # as a size it may mark dynamic, not as a Python constant of this packing (the split share: the shard's length
        # less the whole documents'; a size never 0 or 1 in a compiled runtime, and in a row of one document not the
        # shard's length, which dynamo would take for the same size)
        self._row_pieces_wanted = row_pieces   # the parts inherit it
        self.parts = (self.split_part(), self.whole_part()) if assignment is not None else None
        self.whole_marker = None if assignment is None else \
            _dynamic(torch.empty(0, assignment.whole_len(rank) + assignment.spare), 1)

    def _chunk_pieces(self) -> "tuple[ChunkPieces, ...] | None":
        if self.recurrent_runs is None or self.assignment is not None:
            return None
        parts = self.size * balancers.chunks_per_rank(self.layout)
        if self.seq_len % parts:
            return None
        m = self.seq_len // parts
        device = self.doc_ids.device if self.doc_ids is not None else torch.device("cpu")
        part = self.is_part   # a part of a load_balance="documents" shard
        starts = [c * m for c in balancers.shard_chunks(self.layout, self.size, self.rank)]
        pieces = ChunkPieces.of(self.recurrent_runs, starts, m, device, local=part and self.size == 1,
                                neutral=part and self._pow2_pieces, groups=self._piece_groups)
        self._past_budget |= pieces is None
        return pieces

    def _row_pieces(self) -> "ChunkPieces | None":
        if self.recurrent_runs is None or self.assignment is not None or self.size == 1:
            return None
        device = self.doc_ids.device if self.doc_ids is not None else torch.device("cpu")
        pieces = ChunkPieces.of(self.recurrent_runs, [0], self.seq_len, device, local=True, groups=self._piece_groups)
        self._past_budget |= pieces is None
        return None if pieces is None else pieces[0]

    def past_the_budget(self) -> bool:
        """Whether some recurrent chunk of this batch (or of a ``load_balance="documents"`` part) holds documents but
        has no pieces: they would pad past :data:`PIECES_BUDGET` times its tokens, so a compiled block cuts it in
        Python, and this packing recompiles it (decided here, on the host, from what the shard step built)."""
        return self._past_budget or any(part is not None and part.past_the_budget() for part in self.parts or ())

    def heads_rows(self, up_to: int) -> bool:
        """Whether this batch's rows are at most ``up_to`` tokens long (``recurrent="auto"``: a layer runs heads on
        them), from the host comparison made when the batch was built for the wired lengths."""
        rows = self._heads_rows.get(up_to)
        return (0 < self.seq_len <= up_to) if rows is None else rows

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], row_pieces: bool = False, heads_upto: tuple = (),
                  pow2_pieces: bool = False, piece_groups: int = 1) -> "CPBatch":
        """``row_pieces``: make :attr:`row_pieces` (the runtime runs ``recurrent="heads"``); ``heads_upto``: the row
        lengths up to which the runtime's layers run heads (:meth:`heads_rows`); ``pow2_pieces``: every wired layer
        pads its pieces neutrally (a documents shard's split part as pieces a power of two long)."""
        return cls(meta["rank"], meta["size"], meta["layout"], meta["seq_len"], meta.get("doc_ids"), meta.get("rows"),
                   meta.get("runs"), meta.get("assignment"), token_mask=meta.get("token_mask"),
                   recurrent_doc_ids=meta.get("recurrent_doc_ids"), row_pieces=row_pieces, heads_upto=heads_upto,
                   pow2_pieces=pow2_pieces, piece_groups=piece_groups)

    # -- load_balance="documents" (sharding.assignment) ------------------------------------------------
    @property
    def split_share(self) -> int:
        """Tokens of this rank's shard that belong to the split sub-row (the first ones): all of them in a
        static layout."""
        a = self.assignment
        return a.split_share if a is not None else self.seq_len // self.size

    def per_token(self) -> "CPBatch":
        """This batch for the token-mixing check's runs: the same facts, CP attention standing in per token."""
        other = copy.copy(self)
        other.stand_in = True
        other.handle = StepHandle(other)
        return other

    @property
    def local_len(self) -> int:
        """Tokens of this rank's shard: ``seq_len / size`` in a static layout; under ``load_balance="documents"``
        its share of the split sub-row plus its whole documents (uneven over the group)."""
        a = self.assignment
        return a.local_len(self.rank) if a is not None else self.seq_len // self.size

    def split_part(self) -> "CPBatch | None":
        """Under ``load_balance="documents"``: the split sub-row (the long documents) as a batch of its own,
        cut over the group in the backend's static layout; None when nothing is split. Built once per batch."""
        a = self.assignment
        if a is None or not a.split_len:
            return None
        if "split" not in self._cache:
            runs = Runs(a.split_len, (a.split_starts(),))
            part = CPBatch(self.rank, self.size, a.split_layout, a.split_len, self._part_ids(runs), runs=runs,
                           origin=a.sub_row, row_pieces=self._row_pieces_wanted, heads_upto=self._heads_upto,
                           pow2_pieces=self._pow2_pieces, piece_groups=self._piece_groups,
                           heads_len=self.seq_len if a.compiled else None)
            part.rng_seed = self.rng_seed
            self._cache["split"] = part
        return self._cache["split"]

    def whole_part(self) -> "CPBatch | None":
        """Under ``load_balance="documents"``: this rank's whole documents as a batch of one rank (rank 0 of
        1: its layers run with no collective); None when the rank holds none. Built once per batch.
        A compiled runtime's (:attr:`Assignment.compiled`) runs :data:`~.assignment.SPARE` tokens past them, a
        document of their own (their row position 0): every rank has a whole part, never of one token
        (:func:`by_parts`)."""
        a = self.assignment
        if a is None or not (a.whole_len(self.rank) or a.spare):
            return None
        if "whole" not in self._cache:
            n = a.whole_len(self.rank)
            starts = (*a.whole_starts(self.rank), n) if a.spare and n else a.whole_starts(self.rank) or (0,)
            runs = Runs(n + a.spare, (starts,))
            origin = torch.cat([a.local_index(self.rank)[a.split_share:], torch.zeros(a.spare, dtype=torch.long)])
            part = CPBatch(0, 1, "contiguous", runs.seq_len, self._part_ids(runs), runs=runs,
                           origin=origin, piece_groups=self._piece_groups)
            part.rng_seed = self.rng_seed
            self._cache["whole"] = part
        return self._cache["whole"]

    def _part_ids(self, runs: Runs) -> torch.Tensor:
        """``[1, L]`` document ids of a part, from its host runs (no device read)."""
        ends = (*runs.row(0)[1:], runs.seq_len)
        lengths = torch.tensor([e - s for s, e in zip(runs.row(0), ends)], dtype=torch.long)
        ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).unsqueeze(0)
        device = self.doc_ids.device if self.doc_ids is not None else torch.device("cpu")
        return _dynamic(_on(device, ids, torch.long), 1)   # a part's length changes per packing

    def local_positions(self, device=None) -> torch.Tensor:
        """The row position of each token of this rank's shard, in the order the shard stores them: what a
        per-token rule of the row (a position table, a temperature) reads. For a part of a documents batch,
        the positions in the original row."""
        key = ("positions", str(device))
        if key not in self._cache:
            if self.assignment is not None:
                pos = self.assignment.local_index(self.rank)
            else:
                pos = balancers.shard_positions(self.seq_len, self.size, self.rank, self.layout)
                if self.origin is not None:
                    pos = self.origin[pos]
            self._cache[key] = _on(device or "cpu", pos, torch.long)
        return self._cache[key]

    def chunked(self, chunk: int) -> "CPBatch":
        """This batch as chunked-attention layers see it: the same rank, layout and length, with
        documents cut into ``chunk``-token pieces from global positions (:func:`chunk_doc_ids`).
        Built once per forward and chunk size; every backend (Ulysses sdpa tiles, flex BlockMask,
        flash varlen, the Ring block plans) then masks chunks as documents."""
        key = ("chunked", chunk)
        if key not in self._cache:
            docs = chunk_doc_ids(self.doc_ids, self.seq_len, chunk)
            runs = (self.runs or Runs.whole(self.seq_len)).chunked(chunk)
            self._cache[key] = CPBatch(self.rank, self.size, self.layout, self.seq_len, docs, self.rows, runs,
                                       origin=self.origin, pieces=False)   # attention only, made in forward
            self._cache[key].rng_seed = self.rng_seed
        return self._cache[key]

    @property
    def packed(self) -> bool:
        return self.doc_ids is not None

    def docs_on(self, device) -> torch.Tensor | None:
        if self.doc_ids is None:
            return None
        if self.doc_ids.device == torch.device(device):   # no cache lookup: a compiled block would guard on it
            return self.doc_ids
        key = ("docs", str(device))
        if key not in self._cache:
            self._cache[key] = self.doc_ids.to(device)
        return self._cache[key]

    def dense_mask(self, causal: bool, window: int | None, device, materialize: bool = False) -> torch.Tensor | None:
        """Bool ``[B|1, 1, S, S]`` (True = attend) over the whole sequence, in sequence order,
        or None when plain causal attention is exact and the kernel can do causal by itself
        (``materialize=False``). Built once per forward and kind. O(S^2): only eager attention (an
        S x S kernel anyway) and tests use it; sdpa runs tiles (attention/tiled.py), flex a BlockMask."""
        if self.doc_ids is None and window is None and not materialize:
            return None
        key = ("dense", causal, window, str(device))
        if key not in self._cache:
            docs = self.docs_on(device)
            # the ids' length, not the Python seq_len: a documents part's length is a size a compiled block keeps dynamic
            pos = torch.arange(self.seq_len if docs is None else docs.shape[-1], device=device)
            d = pos[:, None] - pos[None, :]
            m = (d >= 0) if causal else torch.ones_like(d, dtype=torch.bool)
            if window is not None:
                m = m & (d < window) if causal else m & (d.abs() < window)
            m = m[None, None]
            if docs is not None:
                m = m & (docs[:, None, :, None] == docs[:, None, None, :])
            self._cache[key] = m
        return self._cache[key]

    def varlen_bounds(self, batch_size: int, device) -> tuple[torch.Tensor, int]:
        """Flash varlen boundaries of all ``batch_size`` rows flattened into one (row-major): each
        row's documents (padding tokens: one each) in order, never one across two rows (each row's
        :func:`row_cu_seqlens`, shifted to where the row starts); and the longest document. Built once per
        forward."""
        key = ("varlen", batch_size, str(device))
        if key not in self._cache:
            S = self.seq_len
            cu = rows_cu_seqlens(self.runs, batch_size, S)
            self._cache[key] = (_on(device, cu, torch.int32), S if self.runs is None else self.runs.longest())
        return self._cache[key]

    def recurrent_bounds(self, rows: int, device=None) -> torch.Tensor:
        """The recurrent layers' ``cu_seqlens`` (int64) of ``rows`` whole rows flattened into one (a run of padding
        is one document: :attr:`recurrent_runs`), on the host (``device`` None) or a copy on ``device``: what a
        varlen recurrent kernel takes (``recurrent="heads"``). Made once per batch, not per layer."""
        key = ("recurrent_bounds", rows, None if device is None else str(device))
        if key not in self._cache:
            self._cache[key] = (rows_cu_seqlens(self.recurrent_runs, rows, self.seq_len) if device is None
                                else _on(device, self.recurrent_bounds(rows), torch.long))
        return self._cache[key]

    def recurrent_seq_idx(self, rows: int, device) -> torch.Tensor:
        """The document index of every token of ``rows`` whole rows flattened into one, ``[1, rows * S]`` int32 on
        ``device`` (mamba-ssm's ``seq_idx``), from :meth:`recurrent_bounds`. Made once per batch."""
        key = ("recurrent_seq_idx", rows, str(device))
        if key not in self._cache:
            cu = self.recurrent_bounds(rows)
            lengths = cu[1:] - cu[:-1]
            index = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths)[None]
            self._cache[key] = _on(device, index, torch.int32)
        return self._cache[key]


def by_parts(batch: CPBatch, call: Callable, tensors: Sequence[torch.Tensor | None], dims: Sequence[int], out_dim: int,
             whole: Callable | None = None):
    """A documents batch (``load_balance="documents"``) through a layer's CP kernel, attention or recurrent alike:
    ``call(part, *cut)`` for the split documents (the shard's first ``split_share`` tokens, run over the group) and
    ``whole(part, *cut)`` (default ``call``) for this rank's whole documents (the rest, a batch of one rank: no
    collective), each tensor cut along its sequence dim ``dims[i]``; the outputs (a tensor, or a tuple whose first
    element is the output and the rest None) are concatenated along ``out_dim``. Every rank runs the split part
    first, so the collectives line up. The one place a documents shard is cut into its parts.
    A compiled runtime's whole part (:attr:`CPBatch.spare`) runs its inputs with ``SPARE`` zero tokens past them (a
    document of their own), whose outputs are dropped."""
    spare = SPARE if batch.spare else 0
    m = batch.whole_marker.shape[1]   # this rank's whole documents' tokens and the spare ones, as a size
    # both parts are cut from the shard padded by the spare tokens: the split part its first tokens, the whole part the
    # last m (all of them when nothing is split). On a compiled runtime neither is then a tensor of 0 tokens nor the
    # whole of the one it is cut from, sizes dynamo would specialise at the first packing (measured: a rank with no
    # whole document, its split part the whole shard, specialised the marker to 2 in an attention block's graph)
    padded = [None if t is None else pad_tokens(t, d, spare) for t, d in zip(tensors, dims)]
    outs = []
    for part, split in zip(batch.parts, (True, False)):
        if part is None:
            continue
        cut = [None if t is None else t.narrow(d, 0, t.shape[d] - m) if split else t.narrow(d, t.shape[d] - m, m)
               for t, d in zip(padded, dims)]
        outs.append((call if split or whole is None else whole)(part, *cut))
    first = [o[0] if isinstance(o, tuple) else o for o in outs]
    out = first[0] if len(first) == 1 else torch.cat(first, dim=out_dim)
    if spare:   # the whole part's spare tokens dropped after the concatenation (no tensor of 0 tokens)
        out = out.narrow(out_dim, 0, out.shape[out_dim] - spare)
    if isinstance(outs[0], tuple):
        return (out, *[None] * (len(outs[0]) - 1))
    return out


def pad_tokens(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` with ``n`` zero tokens past its end along ``dim`` (0: ``t``): :func:`by_parts`' spare tokens, and a
    documents shard padded to the longest for ``gather_sequence``."""
    if not n:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _dynamic(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` marked dynamic for torch.compile when dynamo is loaded (a size that changes per batch)."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.maybe_mark_dynamic(t, dim)
    return t


def _on(device, values, dtype) -> torch.Tensor:
    """A small host-built tensor on ``device``: built in host memory, copied without waiting. Never a view: dynamo
    gives a view's base sizes of their own, unmarked, which duck sizing unifies with any equal size of the first
    packing (a pieces index of ``[1, m]`` with the hidden states' length: one more graph when they differ)."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)   # pinning copies: never a view
    t = t.to(device)
    return t.clone() if t._is_view() else t
