"""The model's SDPA kernel over the whole sequence with no S x S mask: one call per query tile.

Ulysses hands the inner kernel the whole sequence (``[B, H/P, S, D]``). Plain causal rows need
no mask (the kernel's ``is_causal``), but sliding windows, packed documents and padding do, and
a dense ``[B, 1, S, S]`` mask is O(S^2); worse, SDPA turns a bool mask into a float one of the
query dtype and autograd keeps it for backward, in every layer. So the sequence is cut into
calls, each a query range and the key range it can see (positions are global, documents come
from ``CPBatch.doc_ids``):

* a document no window cuts, longer than ``TILE``: one square call (queries = keys = the
  document) with no mask, the kernel's own ``is_causal`` (square, so SDPA's top-left alignment
  is the right one);
* consecutive short documents (padding tokens are one-token documents): one call over at most
  ``TILE`` tokens with a block-diagonal bool mask;
* a document a window cuts: query tiles of ``TILE``, each against the keys it can see
  (``[max(doc start, t0 - w + 1), t1)`` causal, ``t1 + w - 1`` more for a bidirectional window),
  with a ``tile x keys`` bool mask. A tile is never called with ``is_causal`` unless it is square
  and uncut, so SDPA's top-left ``is_causal`` never meets a non-square call.

Every mask is at most ``TILE x (TILE + 2w)``, so the masks of one forward (kept for backward by
SDPA) total ``O(S * (TILE + w))`` bools / floats: linear in S. Rows with different document
structure (padded batches) are planned row by row. Each call is the kernel the model registered
(``ALL_ATTENTION_FUNCTIONS["sdpa"]``: its GQA handling, scale and dropout), so the result is the
dense-mask result up to summation order. Query and key ranges are cut by :class:`_Spans`, whose
backward adds every range's gradient into one buffer (slicing through autograd would allocate a
full-size zero gradient per call).

The plan is made on the host from the documents' host copy (``CPBatch.runs``, read once in the shard
step: no device read here) and, with the masks, cached in the forward's ``CPBatch`` for every layer. Not yet run on a GPU. On GPU the many small calls cost launches; the flash kernels' varlen and
``window_size`` path (no mask at all) is the production one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 256  # queries per masked call; masks are at most TILE x (TILE + 2 * window)


@dataclass(frozen=True)
class Call:
    """One kernel call: batch rows ``[r0, r1)``, queries ``[q0, q1)``, keys ``[k0, k1)``; ``masked``
    False means a square call (q range == k range) the kernel's own causal flag makes exact."""

    r0: int
    r1: int
    q0: int
    q1: int
    k0: int
    k1: int
    masked: bool


def needs_tiles(cpb, window) -> bool:
    """True when a dense mask would be needed: documents (packing, padding) or a sliding window."""
    return cpb.doc_ids is not None or window is not None


def plan_row(runs, causal: bool, window: int | None, r0: int, r1: int, tile: int) -> list[Call]:
    """The calls covering the queries of rows ``[r0, r1)`` (which share ``runs``), in sequence order."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    calls: list[Call] = []
    group: list[int] | None = None  # [start, stop, documents] of short documents batched together

    def flush():
        nonlocal group
        if group is not None:
            s, e, n = group
            calls.append(Call(r0, r1, s, e, s, e, masked=n > 1))
            group = None

    for s, e in runs:
        n = e - s
        if window is not None and n > window:  # the window cuts inside this document: tiles
            flush()
            for t0 in range(s, e, tile):
                t1 = min(t0 + tile, e)
                k0 = max(s, t0 - window + 1)
                k1 = t1 if causal else min(e, t1 + window - 1)
                square = k0 == t0 and k1 == t1 and t1 - t0 <= window
                calls.append(Call(r0, r1, t0, t1, k0, k1, masked=not square))
        elif n > tile:  # a long document: the kernel's own causal flag, no mask
            flush()
            calls.append(Call(r0, r1, s, e, s, e, masked=False))
        else:
            if group is not None and e - group[0] > tile:
                flush()
            group = [s, e, 1] if group is None else [group[0], e, group[2] + 1]
    flush()
    return calls


def plan(cpb, causal: bool, window, batch: int, tile: int | None = None) -> list[Call]:
    """Calls for the whole batch: one plan shared by all rows when their documents agree, else per row."""
    tile = TILE if tile is None else tile
    key = ("sdpa_tiles", causal, window, batch, tile)
    if key in cpb._cache:
        return cpb._cache[key]
    S = cpb.seq_len
    runs = cpb.runs   # the documents' host copy, made in the shard step: no device read here
    if runs is None:
        calls = plan_row([(0, S)], causal, window, 0, batch, tile)
    elif runs.uniform:
        calls = plan_row(runs.bounds(0), causal, window, 0, batch, tile)
    else:
        if runs.rows != batch:
            raise ValueError(f"the batch's document ids have {runs.rows} rows, attention got {batch}")
        calls = [c for r in range(batch) for c in plan_row(runs.bounds(r), causal, window, r, r + 1, tile)]
    cpb._cache[key] = calls
    return calls


def call_mask(call: Call, causal: bool, window, docs: torch.Tensor | None, device) -> torch.Tensor:
    """Bool ``[rows|1, 1, q, k]`` (True = attend) of one call, from global positions and document ids:
    the same rule as ``CPBatch.dense_mask`` restricted to the call's ranges."""
    qp = torch.arange(call.q0, call.q1, device=device)[:, None]
    kp = torch.arange(call.k0, call.k1, device=device)[None, :]
    # compared by broadcast (bool results only, no [q, k] int64 difference)
    ok = (kp <= qp) if causal else torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=device)
    if window is not None:
        ok = ok & (kp > qp - window) if causal else ok & (kp > qp - window) & (kp < qp + window)
    ok = ok[None]
    if docs is not None:
        rows = docs[call.r0:call.r1] if docs.shape[0] > 1 else docs
        ok = ok & (rows[:, call.q0:call.q1, None] == rows[:, None, call.k0:call.k1])
    return ok[:, None]


def masks(cpb, causal: bool, window, batch: int, device, tile: int | None = None) -> list[torch.Tensor | None]:
    """Every call's mask (None for unmasked calls), built once per forward and shared by all layers."""
    tile = TILE if tile is None else tile
    key = ("sdpa_tile_masks", causal, window, batch, tile, str(device))
    if key not in cpb._cache:
        calls = plan(cpb, causal, window, batch, tile)
        docs = cpb.docs_on(device)
        cpb._cache[key] = [call_mask(c, causal, window, docs, device) if c.masked else None for c in calls]
    return cpb._cache[key]


class _Spans(torch.autograd.Function):
    """Views ``x[r0:r1, :, a:b]`` of ``[B, H, S, D]``; backward adds each view's gradient into one buffer."""

    @staticmethod
    def forward(ctx, x, spans):
        ctx.shape, ctx.spans = x.shape, spans
        return tuple(x[r0:r1, :, a:b] for r0, r1, a, b in spans)

    @staticmethod
    def backward(ctx, *grads):
        dx = None
        for (r0, r1, a, b), g in zip(ctx.spans, grads):
            if g is None:
                continue
            if dx is None:
                dx = g.new_zeros(ctx.shape)
            dx[r0:r1, :, a:b] += g
        return dx, None


def tiled_attention(fn, module, q, k, v, cpb, causal: bool, window, kwargs: dict,
                    tile: int | None = None) -> torch.Tensor:
    """``fn`` (an attention-interface kernel) over q ``[B, h, S, D]``, k/v ``[B, hk, S, D]`` in calls of
    :func:`plan`; returns ``[B, S, h, D]`` as the kernel would for the whole sequence."""
    B = q.shape[0]
    calls = plan(cpb, causal, window, B, tile)
    call_masks = masks(cpb, causal, window, B, q.device, tile)
    qs = _Spans.apply(q, tuple((c.r0, c.r1, c.q0, c.q1) for c in calls))
    kspans = tuple((c.r0, c.r1, c.k0, c.k1) for c in calls)
    ks, vs = _Spans.apply(k, kspans), _Spans.apply(v, kspans)
    outs = [fn(module, qi, ki, vi, m, **kwargs)[0] for qi, ki, vi, m in zip(qs, ks, vs, call_masks)]
    rows: list[list[torch.Tensor]] = []
    last = None
    for c, o in zip(calls, outs):  # calls are in (row, position) order: rows of pieces to concatenate
        if (c.r0, c.r1) != last:
            rows.append([])
            last = (c.r0, c.r1)
        rows[-1].append(o)
    return torch.cat([torch.cat(parts, dim=1) for parts in rows], dim=0)
