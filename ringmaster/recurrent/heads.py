"""``recurrent="heads"``: head-parallel recurrent layers.

Instead of passing state between the ranks' sequence shards (``scan``, ``sequential``, ``fla_cp``), one fused
all-to-all turns each per-token kernel input from (this rank's tokens, every head) into (the whole sequence,
``H/P`` heads); the layer's own kernel runs unchanged over whole rows, and one all-to-all turns its output back.
Heads (or channels) of these layers never mix inside the kernel, so nothing crosses a rank and no state is
passed: what runs is the kernel the model runs without CP, on the same tokens, in the same order.

* Any static layout: the chunks each rank stores (``contiguous``: one; ``head_tail``: chunks ``r`` and
  ``2P-1-r``) are put back in sequence order after the first all-to-all and returned to storage order before
  the second, inside the same two collectives. A ``load_balance="documents"`` batch runs its split part through
  here and its whole documents locally (:func:`~ringmaster.sharding.documents.by_parts`).
* Packed and padded rows: the whole row's document starts come from the batch's host runs, and the kernel is run
  per document (:class:`~ringmaster.recurrent.documents.DocumentSegment` over the whole row).
* Inputs shared by a group of heads (gated DeltaNet's q/k under grouped value heads, Mamba2's B/C when
  ``n_groups`` < P) are replicated to one group per rank before the exchange (:func:`grouped`); per-head
  parameters the kernel takes (Mamba2's A, D, dt_bias) are sliced to this rank's heads (:func:`local_heads`),
  their gradients summed over the group by the data-parallel reduction like every other parameter's.
* A head count that P does not divide is refused at the first call, naming the counts and the sizes that work.

The layers' short convolutions keep their halo exchange (K-1 tokens from the previous shard): exact, and far
fewer bytes than moving the conv's input and output through two more all-to-alls.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import all_to_all
from ..errors import UnsupportedLayerError
from .documents import DocumentSegment, PiecesSegment, global_documents, host_runs
from .scan import chunk_ids

STRATEGY = "heads"


def _sizes_that_work(count: int, limit: int = 16) -> list[int]:
    return [p for p in range(2, limit + 1) if count % p == 0]


def check_heads(path: str, what: str, count: int, P: int) -> None:
    """Refuse a head (or channel) count that the CP size does not divide, naming both and the sizes that work."""
    if count % P:
        raise UnsupportedLayerError(
            f"{path}: recurrent='heads' splits the layer's {count} {what} over the {P} CP ranks, and {P} does not "
            f"divide {count}; use a CP size among {_sizes_that_work(count) or '(none)'}, or recurrent='scan' / "
            "'sequential' (state passing has no such constraint)")


def grouped(path: str, t: torch.Tensor, heads: int, P: int, what: str) -> torch.Tensor:
    """``t [b, l, G, ...]`` shared by groups of the layer's ``heads`` heads (head ``i`` reads group
    ``i // (heads / G)``), repeated so that the head split gives each rank the groups its heads read: as it is when
    ``P`` divides ``G``; each group repeated ``P / G`` times when ``G`` divides ``P`` (one group per rank)."""
    G = t.shape[2]
    check_groups(path, heads, G, P, what)
    return t if G % P == 0 else t.repeat_interleave(P // G, dim=2)


def check_groups(path: str, heads: int, G: int, P: int, what: str) -> None:
    """Refuse ``G`` groups of ``what`` (read by groups of the layer's ``heads`` heads) that neither split over nor
    replicate to ``P`` ranks (:func:`grouped`), naming the sizes that work."""
    check_heads(path, "heads", heads, P)
    if heads % G:
        raise UnsupportedLayerError(f"{path}: {heads} heads do not fall into {G} groups of {what}")
    if G % P == 0 or P % G == 0:
        return
    sizes = sorted(set(_sizes_that_work(G)) | {p for p in range(2, 17) if p % G == 0 and heads % p == 0})
    raise UnsupportedLayerError(
        f"{path}: recurrent='heads' needs the layer's {G} {what} groups and the CP size {P} to divide one another; "
        f"use a CP size among {sizes}, or recurrent='scan' / 'sequential'")


def local_heads(t: torch.Tensor | None, group, dim: int = 0) -> torch.Tensor | None:
    """This rank's slice of a per-head parameter (``dim``: the head dim): heads ``rank * H/P`` to ``(rank+1) * H/P``."""
    if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    n = t.shape[dim] // P
    return t.narrow(dim, rank * n, n)


def _order(layout: str, P: int) -> tuple[list[int], list[int]] | None:
    """``(stored, global_to_received)``: the global chunk at each received position (ranks in order, each rank's
    chunks in storage order), and its inverse; None when they are already in sequence order (contiguous)."""
    stored = [c for r in range(P) for c in chunk_ids(layout, P, r)]
    if stored == list(range(len(stored))):
        return None
    inverse = [0] * len(stored)
    for pos, c in enumerate(stored):
        inverse[c] = pos
    return stored, inverse


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def to_heads(tensors: Sequence[torch.Tensor], group, layout: str) -> list[torch.Tensor]:
    """Each ``[b, l, H_i, ...]`` (this rank's ``l`` tokens in storage order, every head) -> ``[b, S, H_i/P, ...]``
    (the whole sequence in order, this rank's heads: ``rank * H_i/P`` onwards), one all-to-all per dtype."""
    P = dist.get_world_size(group)
    b, l = tensors[0].shape[:2]
    n = len(chunk_ids(layout, P, 0))
    order = _order(layout, P)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _by_dtype(tensors):
        flat = [tensors[i].reshape(b, l, P, -1) for i in idx]          # head groups: rank j gets group j
        widths = [f.shape[-1] for f in flat]
        x = (flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)).permute(2, 0, 1, 3)   # [P (dst), b, l, F]
        y = all_to_all(x, group, tag="heads_in")                                             # [P (src), b, l, F]
        F = y.shape[-1]
        y = y.reshape(P, b, n, l // n, F).permute(1, 0, 2, 3, 4).reshape(b, P * n, l // n, F)
        if order is not None:
            y = y.index_select(1, torch.tensor(order[1], device=y.device))
        y = y.reshape(b, P * l, F)
        for i, part in zip(idx, y.split(widths, dim=-1)):
            t = tensors[i]
            out[i] = part.reshape(b, P * l, t.shape[2] // P, *t.shape[3:])
    return out


def to_sequence(out: torch.Tensor, group, layout: str) -> torch.Tensor:
    """``[b, S, h, ...]`` (the whole sequence, this rank's heads) -> ``[b, l, h * P, ...]`` (this rank's tokens in
    storage order, every head), one all-to-all: :func:`to_heads` backwards."""
    P = dist.get_world_size(group)
    b, S, h = out.shape[:3]
    rest = out.shape[3:]
    n = len(chunk_ids(layout, P, 0))
    l = S // P
    order = _order(layout, P)
    y = out.reshape(b, P * n, l // n, -1)
    if order is not None:
        y = y.index_select(1, torch.tensor(order[0], device=y.device))
    y = y.reshape(b, P, l, -1).permute(1, 0, 2, 3)                      # [P (dst: its tokens), b, l, F]
    z = all_to_all(y, group, tag="heads_out")                          # [P (src: its heads), b, l, F]
    return z.permute(1, 2, 0, 3).reshape(b, l, P * h, *rest)


def run_heads(path: str, group, layout: str, batch, tensors: Sequence[torch.Tensor], build, heads: int,
              what: str = "heads", shared: dict | None = None, token_dim: int = 1,
              varlen: Callable | None = None) -> torch.Tensor:
    """A recurrent kernel in head-parallel form: ``tensors`` (each ``[b, l, H_i, ...]``: this rank's tokens, every
    head) to whole rows for this rank's heads (:func:`to_heads`; ``shared``: index -> what, the tensors read by
    groups of the ``heads`` heads, :func:`grouped`), ``build(*whole)`` the kind's segment over them, run over whole
    rows with the batch's document resets (:func:`whole_rows`), and its output (token dim ``token_dim``, heads
    right after it once the token dim is moved to 1) back to this rank's tokens (:func:`to_sequence`).
    ``varlen(flat, batch)``: the kernel over every row's documents in one call (each whole tensor flattened to one
    row ``[1, b * S, ...]``; the boundaries of every document of every row from ``batch.recurrent_bounds(b)`` or
    ``batch.recurrent_seq_idx``), for a kernel with its own varlen mode (flash-linear-attention's, mamba-ssm's):
    used for packed and padded rows in eager mode."""
    P = dist.get_world_size(group)
    check_heads(path, what, heads, P)
    shared = shared or {}
    tensors = [grouped(path, t, heads, P, shared[i]) if i in shared else t for i, t in enumerate(tensors)]
    out = whole_rows(build, to_heads(tensors, group, layout), batch, path, varlen)
    return to_sequence(out.movedim(token_dim, 1), group, layout).movedim(1, token_dim)


def whole_rows(build, whole: Sequence[torch.Tensor], batch, path: str, varlen: Callable | None = None):
    """The kernel's outputs over whole rows (``whole``: each ``[B, S, ...]``), the state reset at every document
    start of the batch's host runs (packed and padded rows):
    - no documents: ``build(*whole).run(None)``;
    - inside a compiled block, the documents as the batch's whole-row pieces (``CPBatch.row_pieces``, made in the
      shard step: :class:`~ringmaster.recurrent.documents.PiecesSegment`), so a new packing is new data, not a new
      graph;
    - in eager mode, every document in one ``varlen`` call where the kernel has one, else each document cut
      exactly (:class:`~ringmaster.recurrent.documents.DocumentSegment`)."""
    B, S = whole[0].shape[:2]
    segment = build(*whole)
    docs = None if batch is None else global_documents(batch, path, batch.size, B, S // batch.size)
    if docs is not None and torch.compiler.is_compiling():
        pieces = getattr(batch, "row_pieces", None)
        if pieces is not None and hasattr(segment, "with_tensors"):
            segment = PiecesSegment(segment, pieces)
        else:
            segment = DocumentSegment(segment, host_runs(batch).pattern(0, S, B), S)
    elif docs is not None and varlen is not None:
        out = varlen([t.reshape(1, B * S, *t.shape[2:]) for t in whole], batch)
        return out.reshape(B, S, *out.shape[2:])
    elif docs is not None:
        segment = DocumentSegment(segment, host_runs(batch).pattern(0, S, B), S)
    out = segment.run(None)
    return out[0] if isinstance(out, tuple) else out
