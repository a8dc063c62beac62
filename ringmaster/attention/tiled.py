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
step: no device read here) and, with the masks, cached in the forward's ``CPBatch`` for every layer.

Compiled (``torch.compile`` tracing a decoder block), the same plan runs inside one custom op,
``torch.ops.ringmaster.sdpa_tiles`` (and its backward op), which takes the batch's opaque
:attr:`CPBatch.handle <ringmaster.sharding.documents.CPBatch>` and plans on the host when the graph runs:
a new packing is new data for the same graph, never a recompile. Each call of the plan runs torch's
fused attention ops with its structured mask (:class:`.ring.masks.BlockMask`: band and documents from
the host runs, dense only per tile of query rows) and returns the log-sum-exp, which the backward op
takes back: the same calls as eager mode, forward and backward, no recomputation. Not yet run on a GPU. On GPU the many small calls cost launches; the flash kernels' varlen and
``window_size`` path (no mask at all) is the production one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import work
from .ring.aten import AtenKernel
from .ring.masks import BlockMask
from ..sharding import handle
from ..sharding.documents import Runs
from ..sharding.handle import StepHandle

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
    :func:`plan`; returns ``[B, S, h, D]`` as the kernel would for the whole sequence. Compiled: the same
    calls through :func:`compiled_tiles` (no per-packing Python value in the graph)."""
    if torch.compiler.is_compiling() and handle.AVAILABLE:
        return compiled_tiles(module, q, k, v, cpb, causal, window, kwargs, tile)
    B = q.shape[0]
    calls = plan(cpb, causal, window, B, tile)
    call_masks = masks(cpb, causal, window, B, q.device, tile)
    qs = _Spans.apply(q, tuple((c.r0, c.r1, c.q0, c.q1) for c in calls))
    kspans = tuple((c.r0, c.r1, c.k0, c.k1) for c in calls)
    ks, vs = _Spans.apply(k, kspans), _Spans.apply(v, kspans)
    for qi, ki in zip(qs, ks):
        work.issued(qi, ki)
    outs = [fn(module, qi, ki, vi, m, **kwargs)[0] for qi, ki, vi, m in zip(qs, ks, vs, call_masks)]
    rows: list[list[torch.Tensor]] = []
    last = None
    for c, o in zip(calls, outs):  # calls are in (row, position) order: rows of pieces to concatenate
        if (c.r0, c.r1) != last:
            rows.append([])
            last = (c.r0, c.r1)
        rows[-1].append(o)
    return torch.cat([torch.cat(parts, dim=1) for parts in rows], dim=0)


# ---- compiled: the plan as data (torch.ops.ringmaster.sdpa_tiles) ------------------------------------------

def call_block_mask(call: Call, cpb, causal: bool, window, docs: torch.Tensor | None):
    """:class:`.ring.masks.BlockMask` of one call in the call's own coordinates: the causal / window band
    from global positions, the documents with their host runs (tiles are skipped or left unmasked from the
    host copy, never from mask values)."""
    shift = call.k0 - call.q0          # global i - j = local i - j - shift
    lo = shift if causal else (None if window is None else shift - window + 1)
    hi = None if window is None else shift + window - 1
    sq, sk = call.q1 - call.q0, call.k1 - call.k0
    if not call.masked:
        return BlockMask(sq, sk, lo=0 if causal else None)
    q_docs = k_docs = runs = None
    if docs is not None:
        rows = docs[call.r0:call.r1] if docs.shape[0] > 1 else docs
        q_docs, k_docs = rows[:, call.q0:call.q1], rows[:, call.k0:call.k1]
        runs = cpb.runs if cpb.runs.rows == 1 or call.r1 - call.r0 == cpb.runs.rows else \
            Runs(cpb.seq_len, tuple(cpb.runs.row(r) for r in range(call.r0, call.r1)))
    return BlockMask(sq, sk, lo=lo, hi=hi, q_docs=q_docs, k_docs=k_docs, runs=runs, q_start=call.q0,
                     k_start=call.k0)


def _plan_masks(cpb, causal: bool, window, batch: int, device, tile):
    key = ("sdpa_tile_blocks", causal, window, batch, tile, str(device))
    if key not in cpb._cache:
        calls = plan(cpb, causal, window, batch, tile)
        docs = cpb.docs_on(device)
        cpb._cache[key] = [(c, call_block_mask(c, cpb, causal, window, docs)) for c in calls]
    return cpb._cache[key]


def _window(window: int) -> int | None:
    return None if window < 0 else window


def _tiles_forward(q, k, v, step, causal, window, scale, tile):
    kernel = AtenKernel()
    B, h, S, _ = q.shape
    out = q.new_empty(B, h, S, v.shape[-1])
    lse = torch.empty(B, h, S, dtype=torch.float32, device=q.device)
    for c, m in _plan_masks(step.batch, causal, _window(window), B, q.device, tile):
        rows, qs, ks = slice(c.r0, c.r1), slice(c.q0, c.q1), slice(c.k0, c.k1)
        work.issued(q[rows, :, qs], k[rows, :, ks])
        o, l = kernel.forward(q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], scale, m)
        out[rows, :, qs] = o.to(out.dtype)
        lse[rows, :, qs] = l.float()
    return out, lse


def _tiles_backward(dout, q, k, v, out, lse, step, causal, window, scale, tile):
    kernel = AtenKernel()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for c, m in _plan_masks(step.batch, causal, _window(window), q.shape[0], q.device, tile):
        rows, qs, ks = slice(c.r0, c.r1), slice(c.q0, c.q1), slice(c.k0, c.k1)
        gq, gk, gv = kernel.backward(dout[rows, :, qs], q[rows, :, qs], k[rows, :, ks], v[rows, :, ks],
                                     out[rows, :, qs], lse[rows, :, qs], scale, m)
        dq[rows, :, qs] += gq
        dk[rows, :, ks] += gk
        dv[rows, :, ks] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


if handle.AVAILABLE:
    @torch.library.custom_op("ringmaster::sdpa_tiles", mutates_args=())
    def _sdpa_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepHandle, causal: bool,
                    window: int, scale: float, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _tiles_forward(q, k, v, step, causal, window, scale, tile)

    @_sdpa_tiles.register_fake
    def _(q, k, v, step, causal, window, scale, tile):
        B, h, S, _ = q.shape
        return q.new_empty(B, h, S, v.shape[-1]), q.new_empty(B, h, S, dtype=torch.float32)

    @torch.library.custom_op("ringmaster::sdpa_tiles_backward", mutates_args=())
    def _sdpa_tiles_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, step: StepHandle, causal: bool, window: int,
                             scale: float, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _tiles_backward(dout, q, k, v, out, lse, step, causal, window, scale, tile)

    @_sdpa_tiles_backward.register_fake
    def _(dout, q, k, v, out, lse, step, causal, window, scale, tile):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    handle.differentiable(_sdpa_tiles, _sdpa_tiles_backward)


def compiled_tiles(module, q, k, v, cpb, causal: bool, window, kwargs: dict, tile: int | None = None):
    """:func:`tiled_attention` inside a compiled block: the plan's calls through ``torch.ops.ringmaster.sdpa_tiles``
    with the batch's opaque handle; returns ``[B, S, h, D]``."""
    dropout = kwargs.get("dropout") or 0.0
    if dropout:
        raise NotImplementedError(
            f"{type(module).__name__}: attention dropout ({dropout}) inside a compiled block under CP with sdpa on "
            "packed or windowed rows: the compiled tile op has no dropout; set the config's attention dropout to "
            "0, or run the blocks uncompiled")
    scale = kwargs.get("scaling")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    window = -1 if window is None else int(window)
    out, _ = torch.ops.ringmaster.sdpa_tiles(q, k, v, cpb.handle, causal, window, scale,
                                             TILE if tile is None else tile)
    return out.transpose(1, 2)
