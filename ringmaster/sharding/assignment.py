"""Length-aware CP (``load_balance="documents"``): which documents stay whole on one rank.

A packed row of many short documents and a few long ones is cut per batch, on the host, into

* the **split sub-row**: the long documents (longer than ``threshold``), concatenated in row order and
  cut over the P ranks in the backend's static layout (``contiguous`` or ``head_tail``); only these
  tokens travel (Ulysses' all-to-alls, Ring's K/V, the recurrent halos and states);
* **whole documents**: every other document, assigned whole to one rank, balanced by an estimated
  cost (attention's quadratic term plus the linear terms); they run the model's own kernels locally,
  with no communication.

Each rank's shard is its piece of the split sub-row followed by its whole documents (both in row
order). The sub-row's length must cut evenly over the group; when the long documents do not add up
to a multiple of ``P`` (``2P`` for ``head_tail``) the fewest short tokens that fix it (padding tokens
first: each is a document of one token) join the split sub-row, which is exact too (they are
documents like any other). Every rank computes the same :class:`Assignment` from the same full
batch; no collective decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from . import balancers

DOCUMENTS = "documents"
# the tokens a compiled runtime's whole part runs past its documents (Assignment.spare): two, so that a part is never
# 0 or 1 token long, sizes dynamo specialises
SPARE = 2


@dataclass(frozen=True)
class Cost:
    """The work and communication model the assignment balances by (relative units).

    The token at position ``t`` of its document costs ``1 + quadratic * (t + 1)`` (the linear layers, and its
    causal attention row), so a document of ``n`` tokens ``n + quadratic * n (n + 1) / 2``; a split token also
    costs ``comm`` (its share of the collectives). Defaults: ``quadratic = 1 / (6 * hidden)`` for a
    transformer layer (a causal attention row of ``t + 1`` keys is ``4 h (t + 1)`` FLOPs forward, against
    ``24 h^2`` for the projections and MLP) scaled by the fraction of layers that attend; ``comm`` the ratio
    of a token's collective time to its linear-layer time (0: communication is free)."""

    quadratic: float = 1.0 / (6 * 4096)
    comm: float = 0.25

    def doc(self, n: int) -> float:
        return n + self.quadratic * n * (n + 1) / 2

    @classmethod
    def for_model(cls, hidden: int | None, attention_fraction: float = 1.0, comm: float = 0.25) -> "Cost":
        h = hidden if hidden and hidden > 0 else 4096
        return cls(quadratic=max(attention_fraction, 0.0) / (6 * h), comm=comm)


@dataclass(frozen=True)
class DocumentPolicy:
    """How a runtime cuts batches under ``load_balance="documents"`` (fixed at setup; the assignment itself
    is per batch). ``split_layout``: the static layout of the split sub-row (``head_tail`` balances Ring's
    causal work; Ulysses and USP need ``contiguous``); ``threshold``: documents longer than it are split
    (None: the one :func:`choose_threshold` predicts fastest, per batch)."""

    split_layout: str = "contiguous"
    threshold: int | None = None
    cost: Cost = field(default_factory=Cost)
    heads_split: bool = True   # the split documents' attention is shared by heads (Ulysses), else by position
    # a compiled runtime's (Runtime.compiled): every batch keeps the same cases (Assignment.compiled)
    compiled: bool = False


@dataclass(frozen=True)
class Assignment:
    """One batch's document assignment (the same on every rank). Spans are ``(start, stop)`` of the row."""

    seq_len: int
    size: int
    split_layout: str                                   # how the split sub-row is cut: contiguous | head_tail
    threshold: int
    split: tuple[tuple[int, int], ...]                  # the split sub-row's documents, in row order
    whole: tuple[tuple[tuple[int, int], ...], ...]      # per rank: its whole documents, in row order
    cost: Cost = field(default_factory=Cost)
    heads_split: bool = True                            # Ulysses: the split attention shared by heads
    # for a compiled runtime: every batch has the same cases, so a compiled block sees new data, not a new case:
    # something is split where anything can be, the split share at least 2 tokens where it can be
    # (choose_threshold), and every rank runs a whole part, with SPARE tokens of their own past its documents
    # (CPBatch.whole_part): a rank with no whole document, or one of one token, is no case of its own
    compiled: bool = False

    @property
    def spare(self) -> int:
        """Tokens of their own (one document, zeros in, dropped out) every rank's whole part runs past its
        documents: :data:`SPARE` for a compiled runtime, else none."""
        return SPARE if self.compiled else 0

    @property
    def split_len(self) -> int:
        return sum(e - s for s, e in self.split)

    @property
    def split_share(self) -> int:
        """Tokens of the split sub-row each rank holds (the first ones of its shard)."""
        return self.split_len // self.size

    def whole_len(self, rank: int) -> int:
        return sum(e - s for s, e in self.whole[rank])

    def local_len(self, rank: int) -> int:
        return self.split_share + self.whole_len(rank)

    @property
    def max_local_len(self) -> int:
        return max(self.local_len(r) for r in range(self.size))

    @cached_property
    def sub_row(self) -> torch.Tensor:
        """Row positions of the split sub-row, in its order (host, int64)."""
        return _positions(self.split)

    def local_index(self, rank: int) -> torch.Tensor:
        """Row positions of ``rank``'s shard, in the order it stores them (host, int64)."""
        mine = self.sub_row[balancers.shard_positions(self.split_len, self.size, rank, self.split_layout)] \
            if self.split_len else self.sub_row
        return torch.cat([mine, _positions(self.whole[rank])])

    @cached_property
    def gathered(self) -> torch.Tensor:
        """Row position of each token of the shards of ranks 0..P-1 concatenated (host, int64)."""
        return torch.cat([self.local_index(r) for r in range(self.size)])

    @cached_property
    def gathered_order(self) -> torch.Tensor:
        """The permutation that puts the concatenated shards (:attr:`gathered`) back in row order (host, int64):
        computed once per assignment."""
        return torch.argsort(self.gathered)

    def split_starts(self) -> tuple[int, ...]:
        return _starts(self.split)

    def whole_starts(self, rank: int) -> tuple[int, ...]:
        return _starts(self.whole[rank])

    # -- the figures the benchmark and the planner report --------------------------------------------
    def work(self) -> tuple[float, ...]:
        """Estimated compute per rank (:class:`Cost` units): its whole documents, and its part of the split
        documents' work (:func:`split_work`)."""
        shared = split_work(self.split, self.size, self.split_layout, self.cost, self.heads_split)
        return tuple(shared[r] + sum(self.cost.doc(e - s) for s, e in self.whole[r]) for r in range(self.size))

    @property
    def work_max_over_mean(self) -> float:
        w = self.work()
        mean = sum(w) / len(w)
        return max(w) / mean if mean else 1.0

    @property
    def split_fraction(self) -> float:
        """The share of the row's tokens that travel (1.0 is a static layout)."""
        return self.split_len / self.seq_len if self.seq_len else 0.0

    def describe(self) -> str:
        longs = len(self.split)
        return (f"documents: {longs} split ({self.split_len} of {self.seq_len} tokens, {self.split_fraction:.0%}), "
                f"{sum(len(w) for w in self.whole)} whole on their ranks; threshold {self.threshold}; "
                f"work max/mean {self.work_max_over_mean:.3f}")


def _positions(spans) -> torch.Tensor:
    if not spans:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in spans])


def _starts(spans) -> tuple[int, ...]:
    out, t = [], 0
    for s, e in spans:
        out.append(t)
        t += e - s
    return tuple(out)


def split_work(split, size: int, layout: str, cost: Cost, heads_split: bool) -> list[float]:
    """Each rank's part of the split documents' work: an equal share when their attention is split by heads
    (Ulysses), else the causal rows of the sub-row positions its shard holds (Ring, USP: a packed sub-row
    is not balanced by ``head_tail`` alone)."""
    lengths = [e - s for s, e in split]
    L = sum(lengths)
    if not L:
        return [0.0] * size
    if heads_split:
        return [sum(cost.doc(n) for n in lengths) / size] * size
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    row = 1.0 + cost.quadratic * (pos + 1)
    return [float(row[balancers.shard_positions(L, size, r, layout)].sum()) for r in range(size)]


def _fix_residue(short: list[tuple[int, int]], need: int, m: int) -> list[tuple[int, int]] | None:
    """The fewest tokens of ``short`` documents whose lengths add up to ``need`` mod ``m`` (None: none)."""
    if need % m == 0:
        return []
    # smallest documents first: one-token padding documents fix any residue at once
    pool = sorted(short, key=lambda d: (d[1] - d[0], d[0]))
    for limit in (min(len(pool), 4 * m), len(pool)):
        best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
        for i in range(limit):
            n = pool[i][1] - pool[i][0]
            for res, (tot, items) in list(best.items()):
                r2 = (res + n) % m
                if r2 not in best or best[r2][0] > tot + n:
                    best[r2] = (tot + n, items + (i,))
            if need in best:
                break
        if need in best:
            return [pool[i] for i in best[need][1]]
    return None


def assign(docs: list[tuple[int, int]], seq_len: int, size: int, split_layout: str, threshold: int,
           cost: Cost | None = None, heads_split: bool = True, compiled: bool = False,
           split: tuple[tuple[int, int], ...] | None = None) -> Assignment:
    """The assignment of one row's documents ``[(start, stop), ...]`` (in row order, covering the row);
    ``compiled``: :attr:`Assignment.compiled`; ``split``: the documents to split instead of those longer than
    ``threshold`` (then only reported)."""
    cost = cost or Cost()
    split_layout = balancers.check_layout(split_layout)
    if threshold < 1:
        raise ValueError(f"documents_threshold={threshold} must be >= 1 (a document longer than it is split over "
                         "the group)")
    m = size * balancers.chunks_per_rank(split_layout)
    long = [d for d in docs if (d[1] - d[0] > threshold if split is None else d in split)]
    short = [d for d in docs if d not in long]
    need = -sum(e - s for s, e in long) % m
    extra = _fix_residue(short, need, m)
    if extra is None:   # nothing short adds up: every document is split (a static layout)
        long, short = list(docs), []
    elif extra:
        taken = set(extra)
        long = sorted(long + extra)
        short = [d for d in short if d not in taken]
    # whole documents: longest processing time first, onto the least-loaded rank (ties: the lowest rank)
    loads = split_work(long, size, split_layout, cost, heads_split)
    mine: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    for d in sorted(short, key=lambda d: (-cost.doc(d[1] - d[0]), d[0])):
        r = min(range(size), key=lambda i: (loads[i], i))
        loads[r] += cost.doc(d[1] - d[0])
        mine[r].append(d)
    return Assignment(seq_len, size, split_layout, threshold, tuple(long), tuple(tuple(sorted(w)) for w in mine), cost,
                      heads_split, compiled)


def predicted_time(a: Assignment) -> float:
    """What :func:`choose_threshold` minimises: the slowest rank's work plus the split tokens' share of the
    collectives (:class:`Cost` units)."""
    return max(a.work()) + a.cost.comm * a.split_share


def candidate_thresholds(docs: list[tuple[int, int]], seq_len: int, size: int) -> list[int]:
    """The thresholds worth comparing: the row length (nothing split), every distinct document length at least
    ``seq_len / (8 size)`` but the longest (each splits the documents longer than it), ``seq_len / (8 size)``, and
    one below the shortest document (everything split: the static layout, so the choice is never predicted worse
    than it)."""
    lengths = sorted({e - s for s, e in docs if (e - s) * 8 * size >= seq_len}, reverse=True)
    everything = max(min(e - s for s, e in docs) - 1, 1)
    if not lengths:
        return [seq_len, everything]
    return [seq_len] + lengths[1:] + [max(seq_len // (8 * size), 1), everything]


def choose_threshold(docs: list[tuple[int, int]], seq_len: int, size: int, split_layout: str,
                     cost: Cost | None = None, heads_split: bool = True, compiled: bool = False) -> Assignment:
    """The assignment whose :func:`predicted_time` is smallest over the candidate thresholds: every
    distinct document length at least ``seq_len / (8 size)`` (smaller ones are never worth splitting), and
    the row length (nothing split). Ties: the larger threshold (less communication). ``compiled``
    (:attr:`Assignment.compiled`): the fastest of those whose split share is at least 2 tokens, where one is
    (the everything-split candidate is, on any row of 2 tokens per rank), the longest document alone split a
    candidate too: nothing split, or a split share of one token, would be a case of its own for a compiled block."""
    cost = cost or Cost()
    best = None
    candidates = [assign(docs, seq_len, size, split_layout, t, cost, heads_split, compiled)
                  for t in candidate_thresholds(docs, seq_len, size)]
    if compiled:
        longest = max(docs, key=lambda d: (d[1] - d[0], -d[0]))
        candidates.append(assign(docs, seq_len, size, split_layout, max(longest[1] - longest[0] - 1, 1), cost,
                                 heads_split, compiled, split=(longest,)))
    for a in candidates:
        key = (compiled and a.split_share < 2, predicted_time(a))
        if best is None or key[0] < best[0][0] or (key[0] == best[0][0] and key[1] < best[0][1] - 1e-9):
            best = (key, a)
    return best[1]


def plan_documents(runs, seq_len: int, size: int, split_layout: str, threshold: int | None,
                   cost: Cost | None = None, heads_split: bool = True, compiled: bool = False) -> Assignment:
    """The batch's assignment from its host document runs (:class:`~.documents.Runs`; None: one document),
    with a fixed ``threshold`` or, for ``None``, the one :func:`choose_threshold` predicts fastest; ``compiled``:
    :attr:`Assignment.compiled`."""
    if runs is not None and not runs.uniform:
        raise ValueError(
            "load_balance='documents' assigns documents per row, and this batch's rows hold different documents; "
            "pack each micro-batch into one row (batch size 1, e.g. axolotl's sample_packing with "
            "micro_batch_size: 1) or use load_balance='auto'")
    docs = [(0, seq_len)] if runs is None else runs.bounds(0)
    if threshold is None:
        return choose_threshold(docs, seq_len, size, split_layout, cost, heads_split, compiled)
    return assign(docs, seq_len, size, split_layout, threshold, cost, heads_split, compiled)


def policy_of(runtime) -> DocumentPolicy | None:
    """The policy ``runtime``'s batches are cut by under ``load_balance="documents"`` (None otherwise): the
    split documents in Ring's ``head_tail`` layout for pure Ring, else ``contiguous``; the config's threshold;
    the model's cost figures (``runtime.cost``, set by ``rm.wire``); whether the runtime is compiled."""
    if runtime is None or runtime.shard_load_balance != DOCUMENTS:
        return None
    plan = runtime.config
    split = "head_tail" if plan.ulysses_size == 1 and plan.ring_size > 1 else "contiguous"
    return DocumentPolicy(split, plan.documents_threshold, runtime.cost or Cost(), heads_split=plan.ring_size == 1,
                          compiled=runtime.compiled)
