"""The ring loop: every rank's queries meet every rank's K/V block, forward and backward.

Rotation ``alltoall`` ("p2p"): K/V blocks travel around the ring, one hop per step; the next
block is in flight while the current one computes. A hop is a *functional* all-to-all with one
non-empty split each way (:class:`_Ring`, ``comm.start_exchange``; the same collective torch's own
context parallel rotates with, ``permute_tensor``), chosen over isend/irecv because it is traceable:
``torch.compile(block, fullgraph=True)`` traces the whole ring, forward and backward (``P2POp`` and
``batch_isend_irecv`` break the graph, and torch's experimental p2p compilation is a global dynamo
flag a library should not set). In eager mode the hop is an ``AsyncCollectiveTensor``: issued before
the block computes, waited for after it, so the overlap is kept; compiled, the ``wait_tensor`` sits in
the graph and the compiler schedules it. Backward walks the same ring with dK/dV
partial sums travelling beside the blocks, so no rank ever holds more than two K/V blocks; both
hops are waited for only after the block's compute (:func:`_p2p_backward`), so a link latency up
to one block's compute is hidden (benchmarks/overlap.py measures it with injected latency).
Rotation ``allgather``: K/V are gathered once (O(S) resident); backward reduce-scatters dK/dV.

Blocks are planned per chunk pair from global positions (the layout's chunks), so causal,
sliding-window and head_tail layouts share one code path; pairs that are fully masked are
skipped, never computed.

K and V travel as one buffer: stacked (``[2, B, H, S, D]``) when their head dims agree, concatenated
along the head dim (``[B, H, S, D_qk + D_v]``) for MLA, where value heads are narrower. Gemma-2's
logit ``softcap`` is applied inside every block's scores by the kernel (forward and backward); the
LSE merge is unchanged by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...comm import _all_gather, _reduce_scatter, complete, diagnosed, start_exchange, timed_comm
from ...sharding import balancers, handle
from ...sharding.handle import StepHandle
from .. import work
from .kernels import kernel_name, kernel_named
from .masks import BlockMask, check_documents
from .merge import acc_dtype, merge, merge_sink, sink_grad

SKIP = "skip"


@dataclass(frozen=True)
class RingPlan:
    """Where this rank's tokens sit in the sequence and which keys each query may see."""

    layout: str
    size: int
    rank: int
    chunk: int                # tokens per layout chunk
    causal: bool = True
    window: int | None = None  # HF sliding_window: key visible iff 0 <= q - k < window
    docs: torch.Tensor | None = field(default=None, compare=False)  # [B, S] global document ids
    alibi: torch.Tensor | None = field(default=None, compare=False)  # ALiBi slopes [Hq] (bloom, mpt)
    runs: object | None = field(default=None, compare=False)  # the documents' host copy (sharding.documents.Runs)
    # under torch.compile: no pair or tile skipped by documents (the document masks come from ``docs`` on the
    # device), so the compiled graph does not depend on the packing; ``runs`` is then absent, except for a
    # flash-style block kernel, which cuts documents into varlen calls on the host (ring/hf.py)
    static_docs: bool = False
    # under torch.compile: the batch's opaque step handle (sharding.handle); the block pairs are then planned
    # from the host runs inside torch.ops.ringmaster.ring_block (pairs of disjoint documents skipped, as in
    # eager mode), and the traced loop reads no per-packing value
    handle: object | None = field(default=None, compare=False)

    def __post_init__(self):
        check_documents(self.docs, self.runs, self.static_docs, "RingPlan")

    def chunks(self, rank: int) -> list[int]:
        return balancers.shard_chunks(self.layout, self.size, rank)


def _pair_band(a: int, b: int, c: int, causal: bool, window: int | None):
    """Query chunk ``a`` against key chunk ``b`` (chunk length ``c``): SKIP, or the band
    ``(lo, hi)`` of local ``i - j`` the pair keeps (``None`` = unbounded).

    Globally a key is visible iff ``0 <= q - k`` (causal) and ``q - k < window``; with
    ``q - k = (a - b) * c + i - j`` that is ``-(a - b) * c <= i - j <= window - 1 - (a - b) * c``."""
    if causal and b > a:
        return SKIP
    if window is not None and not causal:
        raise NotImplementedError("ring attention supports sliding windows only for causal attention")
    off = (a - b) * c
    lo = -off if causal else None
    hi = None if window is None else window - 1 - off
    if lo is not None and lo <= -(c - 1):
        lo = None  # every key of an earlier chunk precedes every query
    if hi is not None:
        if hi < -(c - 1):
            return SKIP  # the window ends before this key chunk
        if hi >= c - 1:
            hi = None
    return lo, hi


def _docs_disjoint(plan: RingPlan, a: int, b: int) -> bool:
    """No row shares a document between the two chunks, decided from the host runs (no device read)."""
    c = plan.chunk
    return plan.runs.disjoint(a * c, (a + 1) * c, b * c, (b + 1) * c)


def block_pairs(plan: RingPlan, src: int, device, rel: torch.Tensor | None = None) -> list[tuple[int, int, BlockMask]]:
    """(query chunk index, key chunk index, mask) for this rank's queries vs ``src``'s block. ``rel``: this
    rank's query rows' relative-bias profiles ``[B, H, S/P, E]`` (Inkling), cut per query chunk."""
    c = plan.chunk
    pairs = []
    for qi, a in enumerate(plan.chunks(plan.rank)):
        for kj, b in enumerate(plan.chunks(src)):
            band = _pair_band(a, b, c, plan.causal, plan.window)
            if band == SKIP:
                continue
            docs = {}
            if plan.docs is not None:
                if not plan.static_docs and _docs_disjoint(plan, a, b):
                    continue
                docs = dict(q_docs=plan.docs[:, a * c:(a + 1) * c], k_docs=plan.docs[:, b * c:(b + 1) * c])
            if rel is not None:
                docs.update(rel_logits=rel[..., qi * c:(qi + 1) * c, :], rel_offset=(a - b) * c)
            pairs.append((qi, kj, BlockMask(c, c, lo=band[0], hi=band[1], alibi_slopes=plan.alibi,
                                            alibi_offset=(b - a) * c, runs=plan.runs, q_start=a * c,
                                            k_start=b * c, static_docs=plan.static_docs, **docs)))
    return pairs


@dataclass(frozen=True)
class _KV:
    """How K and V share one buffer: stacked when their head dims agree, else side by side (MLA)."""

    dk: int
    dv: int

    def pack(self, k, v):
        return torch.stack([k, v]).contiguous() if self.dk == self.dv else torch.cat([k, v], dim=-1).contiguous()

    def k(self, kv):
        return kv[0] if self.dk == self.dv else kv[..., :self.dk]

    def v(self, kv):
        return kv[1] if self.dk == self.dv else kv[..., self.dk:]


def _sl(x: torch.Tensor, i: int, c: int) -> torch.Tensor:
    return x[..., i * c:(i + 1) * c, :]


class _Ring:
    """The ring's neighbours on the CP group: send to rank+1, receive from rank-1.

    A hop is one functional all-to-all with a single non-empty split each way (``comm.start_exchange``:
    what torch's own context parallel does with ``permute_tensor``): it traces under ``torch.compile``
    where ``isend``/``irecv``/``P2POp`` break the graph, and in eager mode it is still in flight while the
    caller computes (an ``AsyncCollectiveTensor``, waited for in :meth:`wait`). Messages are matched by
    issue order, the same on every rank (``channel`` is kept for callers; tags are a p2p notion)."""

    def __init__(self, group, after: torch.Tensor | None = None):
        self.group, self.after = group, after   # after: backward's dout, every hop stays in backward (comm.pinned)
        P, r = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (r + 1) % P, (r - 1) % P   # group ranks

    def start(self, tensor: torch.Tensor, phase: str, tag: str, channel: int = 0):
        """Issue the hop; returns ``(recv, works, meta)``: ``recv`` is ``tensor``-shaped, in flight until
        :meth:`wait` (``works``: the in-flight buffers; empty when already complete)."""
        flat, _ = start_exchange([(self.next, tensor)], [(self.prev, tensor.shape)], self.group, tensor,
                                 after=self.after)
        nbytes = tensor.numel() * tensor.element_size()
        return flat.view(tensor.shape), [flat], (phase, nbytes, tag)

    def wait(self, pending):
        recv, works, (phase, nbytes, tag) = pending
        with diagnosed("p2p", tag, self.group), timed_comm("p2p", phase, nbytes, tag):
            for flat in works:
                recv = complete(flat).view(recv.shape)
        return recv


def _forward_block(kernel, plan, q, kv, src, scale, acc, lay: _KV, softcap, rel=None):
    c = plan.chunk
    k, v = lay.k(kv), lay.v(kv)
    if plan.handle is not None:   # compiled: the pairs planned from the host runs inside the op
        o, lse = torch.ops.ringmaster.ring_block(q, k, v, plan.handle, *_op_args(plan, kernel, scale, softcap), src, 0)
        for qi in range(len(acc)):
            acc[qi] = merge(*(acc[qi] or (None, None)), _sl(o, qi, c), lse[..., qi * c:(qi + 1) * c])
        return
    for qi, kj, mask in block_pairs(plan, src, q.device, rel):
        work.issued(_sl(q, qi, c), _sl(k, kj, c))
        o, lse = kernel.forward(_sl(q, qi, c), _sl(k, kj, c), _sl(v, kj, c), scale, mask, softcap=softcap)
        acc[qi] = merge(*(acc[qi] or (None, None)), o, lse)


def _backward_block(kernel, plan, q, kv, src, scale, dout, out, lse, dq, dkv, lay: _KV, softcap, rel=None,
                    drel=None):
    pairs = _OpPairs(src, 0) if plan.handle is not None else block_pairs(plan, src, q.device, rel)
    _backward_pairs(kernel, plan, q, kv, pairs, scale, dout, out, lse, dq, dkv, lay, softcap, drel)


def _own_split(pairs):
    """The own block's pairs as (early, late): the off-diagonal pairs first, the diagonal ones last.

    The own block needs no communication, so the p2p backward splits it to cover both ends of the
    ring: ``early`` runs while the first K/V hop is in flight, ``late`` while the last dK/dV hop brings
    this rank's own dK/dV home. head_tail's own block is one full off-diagonal pair and two causal
    diagonals, about half the work each way; a contiguous shard's single diagonal pair all runs late
    (the first K/V hop is then not covered)."""
    early = [p for p in pairs if p[0] != p[1]]
    late = [p for p in pairs if p[0] == p[1]]
    return early, late


def _backward_pairs(kernel, plan, q, kv, pairs, scale, dout, out, lse, dq, dkv, lay: _KV, softcap, drel=None):
    c = plan.chunk
    k, v, dk, dv = lay.k(kv), lay.v(kv), lay.k(dkv), lay.v(dkv)
    if isinstance(pairs, _OpPairs):   # compiled: the pairs planned from the host runs inside the op
        gq, gk, gv = torch.ops.ringmaster.ring_block_backward(dout, q, k, v, out, lse, plan.handle,
                                                              *_op_args(plan, kernel, scale, softcap), pairs.src,
                                                              pairs.select)
        dq.add_(gq.to(dq.dtype))
        dk.add_(gk.to(dkv.dtype))
        dv.add_(gv.to(dkv.dtype))
        return
    for qi, kj, mask in pairs:
        dq_i, dk_j, dv_j, *drel_i = kernel.backward(_sl(dout, qi, c), _sl(q, qi, c), _sl(k, kj, c), _sl(v, kj, c),
                                                    _sl(out, qi, c), lse[..., qi * c:(qi + 1) * c], scale, mask,
                                                    softcap=softcap)
        if drel is not None:  # the relative bias's share of this block (the kernel returns it with rel_logits)
            _sl(drel, qi, c).add_(drel_i[0].to(drel.dtype))
        _sl(dq, qi, c).add_(dq_i.to(dq.dtype))
        _sl(dk, kj, c).add_(dk_j.to(dkv.dtype))
        _sl(dv, kj, c).add_(dv_j.to(dkv.dtype))


def _p2p_backward(kernel, plan, group, q, kv, scale, dout, out, lse, dq, lay: _KV, softcap, rel=None, drel=None):
    """The p2p ring backward with every hop in flight behind a block's compute; returns this rank's dK|dV.

    Step ``s`` (1..P-1) holds the K/V block of rank ``r - s``: its K/V hop to ``r + 1`` starts before the
    block's compute, and the block's dK/dV go into a fresh buffer. The partial sum for that block, sent
    by rank ``r - 1`` at the end of its step ``s - 1``, is only waited for *after* the compute, added, and
    sent on asynchronously (channel 1): so neither hop is waited for while there is compute to do. The
    partial sum starts at the first rank after the owner (the owner's own share stays home), so a block's
    dK/dV make P-1 hops, the last one into its owner, hidden behind the owner's ``late`` pairs
    (:func:`_own_split`). Resident: two K/V blocks and four fp32 dK/dV buffers (home, the one computed,
    the one received, the one being sent)."""
    P, acc = plan.size, dq.dtype
    home = torch.zeros(kv.shape, dtype=acc, device=q.device)
    if plan.handle is not None:   # compiled: the op selects the own block's early and late pairs
        early, late = _OpPairs(plan.rank, 1), _OpPairs(plan.rank, 2)
    else:
        early, late = _own_split(block_pairs(plan, plan.rank, q.device, rel))
    ring = _Ring(group, after=dout) if P > 1 else None
    pending_kv = ring.start(kv, "backward", "ring_kv") if ring else None
    _backward_pairs(kernel, plan, q, kv, early, scale, dout, out, lse, dq, home, lay, softcap, drel)
    pending_dkv = None
    for step in range(1, P):
        cur = ring.wait(pending_kv)
        pending_kv = ring.start(cur, "backward", "ring_kv") if step < P - 1 else None
        part = torch.zeros(kv.shape, dtype=acc, device=q.device)
        _backward_block(kernel, plan, q, cur, (plan.rank - step) % P, scale, dout, out, lse, dq, part, lay,
                        softcap, rel, drel)
        if pending_dkv is not None:  # the earlier ranks' share of this block, sent during our compute
            part.add_(ring.wait(pending_dkv))
        pending_dkv = ring.start(part, "backward", "ring_dkv", channel=1)
    _backward_pairs(kernel, plan, q, kv, late, scale, dout, out, lse, dq, home, lay, softcap, drel)
    if pending_dkv is not None:  # every other rank's share of our own block
        home.add_(ring.wait(pending_dkv))
    return home


@dataclass(frozen=True)
class _OpPairs:
    """The pairs of ``src``'s block that ``torch.ops.ringmaster.ring_block(_backward)`` plans inside the op:
    ``select`` 0 all, 1 the own block's early (off-diagonal) pairs, 2 its late (diagonal) ones."""

    src: int
    select: int


def _op_args(plan: RingPlan, kernel, scale, softcap) -> tuple:
    """The plan's per-model facts as the ops' arguments (the per-packing ones stay behind the handle)."""
    return (plan.layout, plan.size, plan.rank, plan.chunk, plan.causal, -1 if plan.window is None else plan.window,
            float(scale), kernel_name(kernel), float(softcap or 0.0))


def _host_pairs(step, layout, size, rank, chunk, causal, window, src, select, device):
    """Inside the ops: the eager plan of ``src``'s block, from the batch's host runs."""
    batch = step.batch
    plan = RingPlan(layout=layout, size=size, rank=rank, chunk=chunk, causal=causal,
                    window=None if window < 0 else window, docs=batch.docs_on(device), runs=batch.runs)
    pairs = block_pairs(plan, src, device)
    if select:
        early, late = _own_split(pairs)
        pairs = early if select == 1 else late
    return pairs


def _ring_block(q, k, v, step, layout, size, rank, chunk, causal, window, scale, impl, softcap, src, select):
    kernel = kernel_named(impl)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q), device=q.device)
    acc = {}
    for qi, kj, mask in _host_pairs(step, layout, size, rank, chunk, causal, window, src, select, q.device):
        work.issued(_sl(q, qi, chunk), _sl(k, kj, chunk))
        o, l = kernel.forward(_sl(q, qi, chunk), _sl(k, kj, chunk), _sl(v, kj, chunk), scale, mask,
                              softcap=softcap or None)
        acc[qi] = merge(*(acc.get(qi) or (None, None)), o, l)
    for qi, (o, l) in acc.items():
        _sl(out, qi, chunk).copy_(o)
        lse[..., qi * chunk:(qi + 1) * chunk].copy_(l)
    return out, lse


def _ring_block_backward(dout, q, k, v, out, lse, step, layout, size, rank, chunk, causal, window, scale, impl,
                         softcap, src, select):
    kernel = kernel_named(impl)
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for qi, kj, mask in _host_pairs(step, layout, size, rank, chunk, causal, window, src, select, q.device):
        gq, gk, gv = kernel.backward(_sl(dout, qi, chunk), _sl(q, qi, chunk), _sl(k, kj, chunk), _sl(v, kj, chunk),
                                     _sl(out, qi, chunk), lse[..., qi * chunk:(qi + 1) * chunk], scale, mask,
                                     softcap=softcap or None)
        _sl(dq, qi, chunk).add_(gq.to(acc))
        _sl(dk, kj, chunk).add_(gk.to(acc))
        _sl(dv, kj, chunk).add_(gv.to(acc))
    return dq, dk, dv


if handle.AVAILABLE:
    @torch.library.custom_op("ringmaster::ring_block", mutates_args=())
    def _ring_block_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepHandle, layout: str, size: int,
                       rank: int, chunk: int, causal: bool, window: int, scale: float, impl: str, softcap: float,
                       src: int, select: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _ring_block(q, k, v, step, layout, size, rank, chunk, causal, window, scale, impl, softcap, src,
                           select)

    @_ring_block_op.register_fake
    def _(q, k, v, step, layout, size, rank, chunk, causal, window, scale, impl, softcap, src, select):
        return (q.new_empty(*q.shape[:-1], v.shape[-1], dtype=acc_dtype(q)),
                q.new_empty(q.shape[:-1], dtype=acc_dtype(q)))

    @torch.library.custom_op("ringmaster::ring_block_backward", mutates_args=())
    def _ring_block_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, step: StepHandle, layout: str, size: int,
                                rank: int, chunk: int, causal: bool, window: int, scale: float, impl: str,
                                softcap: float, src: int, select: int
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _ring_block_backward(dout, q, k, v, out, lse, step, layout, size, rank, chunk, causal, window, scale,
                                    impl, softcap, src, select)

    @_ring_block_backward_op.register_fake
    def _(dout, q, k, v, out, lse, step, layout, size, rank, chunk, causal, window, scale, impl, softcap, src,
          select):
        acc = acc_dtype(q)
        return (q.new_empty(q.shape, dtype=acc), k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc))


def _finish(acc, q, sinks, dv: int):
    parts_out, parts_lse = [], []
    for item, qc in zip(acc, q.split(q.shape[-2] // len(acc), dim=-2)):
        if item is None:  # no visible key at all (cannot happen for causal: the diagonal is always seen)
            item = (qc.new_zeros((*qc.shape[:-1], dv), dtype=acc_dtype(qc)),
                    qc.new_full(qc.shape[:-1], float("-inf"), dtype=acc_dtype(qc)))
        parts_out.append(item[0])
        parts_lse.append(item[1])
    out, lse = torch.cat(parts_out, dim=-2), torch.cat(parts_lse, dim=-1)
    if sinks is not None:
        out, lse = merge_sink(out, lse, sinks)
    return out, lse


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: RingPlan, group, kernel, rotate: str, scale: float, softcap, rel=None):
        P = plan.size
        lay = _KV(k.shape[-1], v.shape[-1])
        kv = lay.pack(k, v)
        acc = [None] * len(plan.chunks(plan.rank))
        if rotate == "allgather":
            kv_all = _all_gather(kv, group, "forward", "ring_kv")
            for src in range(P):
                _forward_block(kernel, plan, q, kv_all[src], src, scale, acc, lay, softcap, rel)
        else:
            ring, cur, kv_all = _Ring(group), kv, None
            for step in range(P):
                pending = ring.start(cur, "forward", "ring_kv") if step < P - 1 else None
                _forward_block(kernel, plan, q, cur, (plan.rank - step) % P, scale, acc, lay, softcap, rel)
                if pending is not None:
                    cur = ring.wait(pending)
        out, lse = _finish(acc, q, sinks, v.shape[-1])
        saved = [q, k, v, out, lse] + ([sinks] if sinks is not None else []) + ([rel] if rel is not None else []) \
            + ([kv_all] if kv_all is not None else [])
        ctx.save_for_backward(*saved)
        ctx.has_rel = rel is not None
        ctx.has_sinks, ctx.plan, ctx.group, ctx.kernel, ctx.rotate, ctx.scale = (
            sinks is not None, plan, group, kernel, rotate, scale)
        ctx.lay, ctx.softcap = lay, softcap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sinks = rest.pop(0) if ctx.has_sinks else None
        rel = rest.pop(0) if ctx.has_rel else None
        plan, group, kernel, scale, lay, softcap = ctx.plan, ctx.group, ctx.kernel, ctx.scale, ctx.lay, ctx.softcap
        P = plan.size
        acc = acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        drel = None if rel is None else torch.zeros(rel.shape, dtype=acc, device=q.device)
        if ctx.rotate == "allgather":
            kv_all = rest[0]
            dkv_all = torch.zeros(kv_all.shape, dtype=acc, device=q.device)
            for src in range(P):
                _backward_block(kernel, plan, q, kv_all[src], src, scale, dout, out, lse, dq, dkv_all[src], lay,
                                softcap, rel, drel)
            dkv = _reduce_scatter(dkv_all, group, "backward", "ring_dkv")
        else:
            dkv = _p2p_backward(kernel, plan, group, q, lay.pack(k, v), scale, dout, out, lse, dq, lay, softcap, rel,
                                drel)
        dsinks = None
        if sinks is not None:
            dsinks = sink_grad(sinks, lse.to(acc), dout, out)   # per head [H] or per token [B, H, S]
        return (dq.to(q.dtype), lay.k(dkv).to(k.dtype), lay.v(dkv).to(v.dtype), dsinks,
                None, None, None, None, None, None, None if rel is None else drel.to(rel.dtype))


def ring_attention(q, k, v, group, plan: RingPlan, kernel, rotate: str = "alltoall", scale: float | None = None,
                   sinks: torch.Tensor | None = None, softcap: float | None = None,
                   rel: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sharded sequence.

    q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` in the layout of ``plan``; returns
    ``[B, Hq, S/P, D_v]``. ``sinks`` (``[Hq]``) adds gpt-oss style attention sinks; ``softcap`` caps
    every score at ``softcap * tanh(s / softcap)`` (Gemma-2). v's head dim may be narrower than
    q/k's (MLA). ``rel`` (``[B, Hq, S/P, E]``, this rank's query rows) adds Inkling's relative position bias
    ``rel[.., i, q_pos - k_pos]`` for distances in ``[0, E)``, inside each block (the kernel must return its
    gradient: the math kernel). A kernel that cannot run the call refuses here, before any collective.
    """
    if rotate not in ("alltoall", "allgather"):
        raise ValueError(f"rotate={rotate!r}: use 'alltoall' (p2p) or 'allgather'")
    kernel.check(q, v, softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, sinks, plan, group, kernel, rotate, scale, softcap, rel)
