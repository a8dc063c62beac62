"""Causal depthwise conv1d under CP: each chunk gets a halo of ``kernel_size - 1`` inputs.

The halo is the last ``kernel_size - 1`` conv inputs (after the padding mask, before the
conv) of the chunk before it in *sequence order*, zeros for the first chunk. With a
``head_tail`` layout a rank's two chunks take their halos from two different ranks, so the
tails of every chunk travel in one small all-gather (``P · chunks · (k-1)`` columns, tiny next
to any attention layer); its backward (reduce-scatter) returns each halo's gradient to the
rank whose inputs it was. The conv itself is the model's own kernel (``causal-conv1d`` on GPU
when installed, the transformers torch fallback on CPU), run on ``[halo | chunk]`` with the
first ``kernel_size - 1`` outputs dropped. With causal-conv1d, neither its ``initial_states`` nor its
``seq_idx`` is needed (the halo is concatenated, document starts get zero gaps); verified on CPU against a
stand-in of the package (tests/test_kernel_standins.py), not yet run on a GPU.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather
from .context import LayerContext, check_call_kwargs
from ..sharding.documents import BATCH_KWARG
from .documents import by_parts, global_documents, recurrent_runs
from .scan import chunk_ids, split_local, tie


def _tail(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` columns of ``x [..., L]``, left-padded with zeros when ``L < width``. Index arithmetic on
    ``L``, no branch on it: a compiled block keeps one graph for a chunk shorter than the conv and a longer one."""
    if x.shape[-1] == 0:   # static in any graph: dynamo specialises sizes 0 and 1
        return x.new_zeros(*x.shape[:-1], width)
    idx = torch.arange(-width, 0, device=x.device) + x.shape[-1]
    return torch.where(idx >= 0, x.index_select(-1, idx.clamp(min=0)), 0)


def halos_from_tails(tails: Sequence[torch.Tensor], lengths: Sequence[int], width: int) -> list[torch.Tensor]:
    """``tails[c]``: chunk c's zero-padded tail (sequence order), ``lengths[c]`` its length.
    Returns the halo entering every chunk: the last ``width`` real inputs before it (zeros first).

    A tail's real columns are its last ``min(length, width)``. Over all tails side by side, ``count`` numbers the
    real columns; the halo of chunk c takes, for each of its ``width`` slots, the real column whose number is the
    count before chunk c less the slots to its right (a binary search of ``count``), zero where that number is
    below 1. One gather for every chunk, whatever the CP size; the lengths are sizes, maybe dynamic ones, and
    nothing branches on them, so a compiled block does not specialise on a chunk shorter than the conv."""
    n, ref = len(tails), tails[0]
    col = torch.arange(width, device=ref.device)
    real = torch.cat([col + lengths[j] >= width for j in range(n)])                     # [n * width]
    count = real.long().cumsum(0)                                                       # real columns up to each
    before = torch.cat([count.new_zeros(1), count[width - 1::width][:n - 1]])           # [n]: before each chunk
    number = before[:, None] - (width - 1 - col)                                        # [n, width]
    pos = torch.searchsorted(count, number.clamp(min=1))                                # its column
    pos = pos.clamp(max=n * width - 1)
    side = torch.cat(list(tails), dim=-1)                                               # [..., n * width]
    halos = side.index_select(-1, pos.reshape(-1)).unflatten(-1, (n, width))
    halos = torch.where(number >= 1, halos, 0)
    return list(halos.unbind(-2))


def exchange_halos(chunks: Sequence[torch.Tensor], width: int, group, layout: str,
                   lengths: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Halos for this rank's ``chunks`` (storage order, each ``[..., L_j]``).

    ``lengths``: every chunk's length in *sequence order* over the whole group; default: all
    chunks as long as this rank's (the equal split :func:`ringmaster.shard.shard_tensor` makes)."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    if len(ids) != len(chunks):
        raise ValueError(f"layout {layout!r} stores {len(ids)} chunks per rank, got {len(chunks)}")
    if lengths is None:
        lengths = [chunks[0].shape[-1]] * (P * len(ids))
    stacked = torch.stack([_tail(c, width) for c in chunks])          # [n, ..., width]
    gathered = all_gather(stacked, group, tag="conv_halo")            # [P, n, ..., width]
    tails = [None] * (P * len(ids))
    for r in range(P):
        for j, c in enumerate(chunk_ids(layout, P, r)):
            tails[c] = gathered[r, j]
    halos = halos_from_tails(tails, lengths, width)
    mine = [halos[c] for c in ids]
    mine[0] = tie(mine[0], gathered)  # the first rank uses no tail, but must join the backward collective
    return mine


def conv_with_halo(kernel: Callable, x: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor, bias=None,
                   activation=None, **kwargs) -> torch.Tensor:
    """The model's own causal conv on ``[halo | x]``, first ``halo`` outputs dropped."""
    width = halo.shape[-1]
    out = kernel(torch.cat([halo.to(x.dtype), x], dim=-1), weight, bias, activation=activation, **kwargs)
    return out[..., width:]


def conv_with_documents(kernel: Callable, x: torch.Tensor, halo: torch.Tensor, docs: torch.Tensor, start: int,
                        weight: torch.Tensor, bias=None, activation=None, runs=None, gaps: int | None = None,
                        **kwargs) -> torch.Tensor:
    """The model's own causal conv on one chunk ``x [b, c, m]`` (global positions ``[start, start+m)``)
    of a packed row: no tap reaches across a document start, as if every document ran alone.

    ``docs [b, S]``: global document ids. The halo keeps only the inputs of the document the chunk
    starts in; inside the chunk ``width`` zero columns are inserted before every document start,
    so one kernel call on ``[halo | x with gaps]`` computes every output (read back at the real
    positions): a masked conv with any kernel, ``causal-conv1d``'s included, no ``seq_idx`` needed.
    ``gaps``: at least the most document starts inside the chunk of any row (the batch's chunk pieces give a
    power of two: a compiled block sees few values), else counted from ``runs``, the batch's host copy of its
    documents (one of the two is required: the ids' values are never read back)."""
    width = halo.shape[-1]
    b, ch, m = x.shape
    d = docs[:, start:start + m].to(x.device)
    hpos = torch.arange(start - width, start, device=x.device)
    hdoc = docs.to(x.device)[:, hpos.clamp(min=0)]
    keep = (hdoc == d[:, :1]) & (hpos >= 0)                               # [b, width]
    halo = halo.to(x.dtype) * keep[:, None, :].to(x.dtype)
    # [b, m]: document starts up to each column (diff with the first column prepended: no size m - 1, which a
    # compiled block would specialise on at m = 2)
    starts = (torch.diff(d, dim=-1, prepend=d[:, :1]) != 0).long().cumsum(-1)
    # the most document starts inside the chunk of any row: from the host runs (``runs``, made in the shard step)
    if gaps is None:
        if runs is None:
            raise RuntimeError("conv_with_documents needs the batch's host runs (CPBatch.runs) or the gap count")
        gaps = max(len(runs.cuts(r, start, start + m)) for r in range(b))
    if gaps == 0:
        return conv_with_halo(kernel, x, halo, weight, bias, activation, **kwargs)
    pos = (width + torch.arange(m, device=x.device) + width * starts)[:, None, :].expand(b, ch, m)
    ext = torch.cat([halo, x.new_zeros(b, ch, m + width * gaps)], dim=-1)
    ext = ext.scatter(-1, pos, x)
    out = kernel(ext, weight, bias, activation=activation, **kwargs)
    return out.gather(-1, pos)


def conv_documents(batch, path: str, size: int, x: torch.Tensor) -> torch.Tensor | None:
    """The global document ids ``[b, S]`` of a packed/padded batch for a conv over ``x [b, c, S/size]``,
    or None when every row is one document."""
    return global_documents(batch, path, size, x.shape[0], x.shape[-1])


def cp_causal_conv1d(kernel: Callable, x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, *,
                     group, layout: str, lengths: Sequence[int] | None = None, docs: torch.Tensor | None = None,
                     runs=None, pieces=None, **kwargs) -> torch.Tensor:
    """``causal_conv1d_fn`` for a CP shard ``x [b, c, l]`` (``weight [c, k]``), exact across ranks.

    ``docs [b, S]`` (global document ids of a packed or padded batch): no tap crosses a document
    start (see :func:`conv_with_documents`); works at CP size 1 too. ``runs``: the batch's host copy of
    its documents (``CPBatch.runs``), so no document structure is read from ``docs``' values; ``pieces``: the
    batch's chunk pieces (``CPBatch.pieces``), whose bucketed piece counts size the gaps instead."""
    width = weight.shape[-1] - 1
    P = 1 if group is None else dist.get_world_size(group)
    if width == 0 or (docs is None and P == 1):
        return kernel(x, weight, bias, activation=activation, **kwargs)
    if P == 1:
        halo = x.new_zeros(*x.shape[:-1], width)
        return conv_with_documents(kernel, x, halo, docs, 0, weight, bias, activation, runs=runs,
                                   gaps=_gaps(pieces, 0), **kwargs)
    rank = dist.get_rank(group)
    ids = chunk_ids(layout, P, rank)
    chunks = split_local(x, len(ids), dim=-1)
    halos = exchange_halos(chunks, width, group, layout, lengths)
    if docs is None:
        outs = [conv_with_halo(kernel, c, h, weight, bias, activation, **kwargs) for c, h in zip(chunks, halos)]
    else:
        sizes = list(lengths) if lengths is not None else [chunks[0].shape[-1]] * (P * len(ids))
        outs = [conv_with_documents(kernel, c, h, docs, sum(sizes[:i]), weight, bias, activation, runs=runs,
                                    gaps=_gaps(pieces if lengths is None else None, j), **kwargs)
                for j, (i, c, h) in enumerate(zip(ids, chunks, halos))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _gaps(pieces, j: int) -> int | None:
    """The bucketed gap count of this rank's chunk ``j`` from the batch's chunk pieces; None without them."""
    if pieces is None or j >= len(pieces):
        return None
    return pieces[j].sizes.shape[1] - 1


def probe_conv(ctx, kernel: Callable, x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **kwargs):
    """The conv under ``wire``'s probe: the layer's own kernel with a random (or zero) halo."""
    width = weight.shape[-1] - 1
    if ctx.probe.record_only:   # layer_costs: the kernel never runs, only the shapes go on to the scan's kernel
        return x
    halo = ctx.probe.state("conv", (*x.shape[:-1], width), x.dtype, x.device)
    return conv_with_halo(kernel, x, x.new_zeros(*x.shape[:-1], width) if halo is None else halo, weight, bias,
                          activation, **kwargs)


def cp_conv_kernel(ctx: LayerContext, namespace: dict, name: str) -> Callable:
    """``causal_conv1d_fn`` for one wired layer (a short conv, a Mamba mixer's conv): the halo of the
    previous shard, no tap across a document start, the layer's own kernel (looked up per call) on
    ``[halo | chunk]``; the wire probe's call goes to :func:`probe_conv`."""
    def conv(x, weight, bias=None, activation=None, **kwargs):
        kernel = namespace[name]
        batch = ctx.take_batch(kwargs)
        if ctx.probe is not None:
            return probe_conv(ctx, kernel, x, weight, bias, activation, **kwargs)
        if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, whole part
            return by_parts(batch, lambda part, x_: conv(x_, weight, bias, activation, **{**kwargs, BATCH_KWARG: part}),
                            (x,), (-1,), -1)
        group, size, layout, _ = ctx.resolve(batch)
        if size > 1:
            check_call_kwargs(ctx.path, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k != "seq_idx"}
        return cp_causal_conv1d(kernel, x, weight, bias, activation, group=group if size > 1 else None,
                                layout=layout, docs=conv_documents(batch, ctx.path, size, x),
                                runs=recurrent_runs(batch), pieces=getattr(batch, "pieces", None), **kwargs)
    return conv

