"""Ring attention on the contiguous layout with DistFlashAttn's balanced schedule.

Each rank holds one contiguous span (so recurrent layers and packed rows see the sequence in
order), and the causal work is balanced by *who computes which block*, not by the cut
(:func:`ringmaster.sharding.balancers.distflash_schedule`): at every step each rank computes one
block, either its own queries against an incoming K/V block, or, for a rank that would
otherwise idle, a busier rank's queries against its own K/V, returning the partial
``(out, lse)`` to the queries' owner, which merges it (fp32 LSE merge). Backward runs the same
schedule: each block's backward gets the *merged* output and LSE (exact for every block kernel),
dQ of a lent block travels back to the queries' owner, dK/dV of a fetched block back to the
K/V's owner.

Messages are point to point, the next step's inputs in flight while the current step computes, so a
rank holds at most two foreign blocks: memory stays O(S/P). Each point of the schedule posts one
functional all-to-all per message kind that any rank moves there (``comm.start_exchange``: every rank
derives the same kinds, sizes and dtypes from the global schedule), which ``torch.compile`` traces
(isend/irecv and ``P2POp`` break the graph); in eager mode it is in flight until :meth:`_Exchange.wait`.
Causal attention only: a sliding window or non-causal attention is refused before any
collective (use load_balance='none'). Packed rows: each block is masked by "same document";
a block whose rows share no document is skipped by both its computer and its owners (every
rank decides from the same global document ids). Not yet run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...comm import anchor, complete, diagnosed, finish_exchange, start_exchange, timed_comm
from ...sharding import balancers, handle
from ...sharding.handle import StepHandle
from .. import work
from .kernels import kernel_name, kernel_named
from .masks import BlockMask, check_documents
from .merge import acc_dtype, merge, merge_sink, sink_grad

SKIP = "skip"
# message kinds: one collective per kind at each point of the schedule (each kind has one dtype)
CH_KV, CH_Q, CH_OUT, CH_DQ, CH_DKV = 10, 11, 12, 13, 14


def _windowed(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(t in ("sliding_attention", "chunked_attention") for t in layer_types)
    return bool(getattr(config, "sliding_window", None))


def check_model(model, text_config, attention_paths) -> None:
    """Refuse, at wire time, a model distflash cannot run exactly: sliding-window, chunked or
    non-causal attention (the schedule covers the causal lower triangle only)."""
    found = []
    if _windowed(text_config):
        found.append(f"{type(text_config).__name__} declares sliding-window/chunked attention layers")
    modules = dict(model.named_modules())
    for path in attention_paths:
        module = modules[path]
        if getattr(module, "sliding_window", None):
            found.append(f"{path} ({type(module).__name__}) has sliding_window={module.sliding_window}")
        elif getattr(module, "is_causal", True) is False:
            found.append(f"{path} ({type(module).__name__}) is not causal")
    if found:
        raise ValueError(
            f"load_balance='distflash' balances causal full attention only, but {found[0]}; use load_balance='none' "
            "(or 'head_tail' without packed rows / recurrent layers)"
        )


def check_call(causal: bool, window: int | None, seq_len: int) -> None:
    """The per-call guard (before any collective), for runtimes set up without ``rm.wire``."""
    if not causal:
        raise NotImplementedError("load_balance='distflash' schedules causal attention only, this layer is not "
                                  "causal; use load_balance='none'")
    if window is not None and window < seq_len:
        raise NotImplementedError(
            f"load_balance='distflash' does not support sliding windows (sliding_window={window} < sequence "
            f"length {seq_len}); use load_balance='none'"
        )


@dataclass(frozen=True)
class DistFlashPlan:
    """This rank's place in the schedule, and the batch's document ids (packed rows)."""

    size: int
    rank: int
    chunk: int                 # tokens per rank
    docs: torch.Tensor | None = field(default=None, compare=False)  # [B, S] global document ids
    runs: object | None = field(default=None, compare=False)  # the documents' host copy (sharding.documents.Runs)
    # under torch.compile: every task runs, its document mask from ``docs`` on the device (tasks of disjoint
    # documents are not skipped), so the graph does not depend on the packing; ``runs`` is then absent, except
    # for a flash-style block kernel, which cuts documents into varlen calls on the host (ring/hf.py)
    static_docs: bool = False
    # under torch.compile with packed rows: the batch's opaque step handle (sharding.handle); each task then runs
    # inside torch.ops.ringmaster.distflash_task(_backward), which skips a task of disjoint documents from the host
    # runs as eager mode does (the messages still move: the graph does not depend on the packing)
    handle: object | None = field(default=None, compare=False)

    def __post_init__(self):
        check_documents(self.docs, self.runs, self.static_docs, "DistFlashPlan")

    def steps(self):
        return balancers.distflash_schedule(self.size)


def active_tasks(plan: DistFlashPlan) -> list[list[bool]]:
    """``active[s][r]``: whether rank ``r``'s task at step ``s`` has any visible key. Decided from
    global facts only (schedule, chunk, document ids), so every rank agrees which messages exist."""
    steps = plan.steps()
    active = [[task.rows(plan.chunk)[1] > task.rows(plan.chunk)[0] for task in step] for step in steps]
    if plan.docs is None or plan.static_docs:
        return active
    for s, step in enumerate(steps):
        for r, task in enumerate(step):
            if active[s][r]:   # from the host runs: no device read
                active[s][r] = not _disjoint(plan, task)
    return active


def _disjoint(plan: DistFlashPlan, task) -> bool:
    """Task ``task``'s queries and keys share no document (from the host runs: no device read; a row without
    documents: never)."""
    if plan.runs is None:
        return False
    c = plan.chunk
    a, b = task.rows(c)
    return plan.runs.disjoint(task.q * c + a, task.q * c + b, task.kv * c, task.kv * c + c)


def _op_plan(step: StepHandle, size: int, rank: int, chunk: int, device) -> DistFlashPlan:
    """Inside the ops: the eager plan, from the batch's host runs."""
    batch = step.batch
    return DistFlashPlan(size=size, rank=rank, chunk=chunk, docs=batch.docs_on(device), runs=batch.runs)


def _task(plan: DistFlashPlan, s: int):
    return plan.steps()[s][plan.rank]


def _task_forward(q, k, v, step, size, rank, chunk, s, scale, impl):
    plan = _op_plan(step, size, rank, chunk, q.device)
    task = _task(plan, s)
    if _disjoint(plan, task):   # as eager mode skips it: no kernel call, a partial that merges to nothing
        return (q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=acc_dtype(q)),
                q.new_full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q)))
    work.issued(q, k)
    o, lse = kernel_named(impl).forward(q, k, v, scale, task_mask(plan, task))
    return o.to(acc_dtype(q)), lse.to(acc_dtype(q))


def _task_backward(dout, q, k, v, out, lse, step, size, rank, chunk, s, scale, impl):
    plan = _op_plan(step, size, rank, chunk, q.device)
    task = _task(plan, s)
    if _disjoint(plan, task):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    g = kernel_named(impl).backward(dout, q, k, v, out, lse, scale, task_mask(plan, task))
    return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype)


if handle.AVAILABLE:
    @torch.library.custom_op("ringmaster::distflash_task", mutates_args=())
    def _task_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepHandle, size: int, rank: int,
                 chunk: int, s: int, scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _task_forward(q, k, v, step, size, rank, chunk, s, scale, impl)

    @_task_op.register_fake
    def _(q, k, v, step, size, rank, chunk, s, scale, impl):
        return (q.new_empty(*q.shape[:-1], v.shape[-1], dtype=acc_dtype(q)),
                q.new_empty(q.shape[:-1], dtype=acc_dtype(q)))

    @torch.library.custom_op("ringmaster::distflash_task_backward", mutates_args=())
    def _task_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, step: StepHandle, size: int, rank: int, chunk: int, s: int,
                          scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _task_backward(dout, q, k, v, out, lse, step, size, rank, chunk, s, scale, impl)

    @_task_backward_op.register_fake
    def _(dout, q, k, v, out, lse, step, size, rank, chunk, s, scale, impl):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_task(plan: DistFlashPlan, kernel, s: int, task, q, k, v, scale):
    """One task's partial ``(out, lse)``: compiled with packed rows, inside the op (which skips a task of disjoint
    documents from the host runs); else the kernel under the task's mask (active_tasks skipped those already)."""
    if plan.handle is not None:
        return torch.ops.ringmaster.distflash_task(q, k, v, plan.handle, plan.size, plan.rank, plan.chunk, s,
                                                   float(scale), kernel_name(kernel))
    work.issued(q, k)
    return kernel.forward(q, k, v, scale, task_mask(plan, task))


def _backward_task(plan: DistFlashPlan, kernel, s: int, task, dout, q, k, v, out, lse, scale):
    if plan.handle is not None:
        return torch.ops.ringmaster.distflash_task_backward(dout, q, k, v, out, lse, plan.handle, plan.size,
                                                            plan.rank, plan.chunk, s, float(scale), kernel_name(kernel))
    return kernel.backward(dout, q, k, v, out, lse, scale, task_mask(plan, task))


def task_mask(plan: DistFlashPlan, task):
    """The block kernel's mask for ``task``: None (every key visible) or a structured
    :class:`.masks.BlockMask` (the causal band of a diagonal block, cut by documents for packed rows),
    so each provider masks with its own kernel's means and nothing ``[rows, c]`` is built here."""
    c = plan.chunk
    a, b = task.rows(c)
    # local i - j = global q - k - (q - kv) * c - a: the diagonal block keeps i - j >= -a; an earlier
    # key chunk is wholly visible (its last key precedes the first query)
    lo = -a if task.diagonal else None
    if plan.docs is None:
        return None if lo is None else BlockMask(b - a, c, lo=lo)
    return BlockMask(b - a, c, lo=lo, q_docs=plan.docs[:, task.q * c + a:task.q * c + b],
                     k_docs=plan.docs[:, task.kv * c:task.kv * c + c], runs=plan.runs, q_start=task.q * c + a,
                     k_start=task.kv * c, static_docs=plan.static_docs)


class _Exchange:
    """Point-to-point messages inside the CP group: one functional all-to-all per message kind, waited for later."""

    def __init__(self, group, device, after: torch.Tensor | None = None):
        # after: the phase's input (q forward, dout backward): every exchange stays in its phase (comm.pinned)
        self.group, self.device, self.after = group, device, after
        self.unread: list[torch.Tensor] = []   # results of collectives that brought this rank nothing

    def post(self, sends, recvs, kinds: dict, phase: str, tag: str):
        """``sends``: ``[(group rank, tensor, kind)]``; ``recvs``: ``[(group rank, shape, kind)]``; ``kinds``:
        ``{kind: dtype}`` for every kind *any* rank of the group moves at this point (from the global schedule,
        so every rank posts the same collectives, with the same wire dtype). Returns a pending handle (None
        when nothing moves anywhere)."""
        if not kinds:
            return None
        flights = []
        for kind, dtype in kinds.items():
            like = torch.empty(0, dtype=dtype, device=self.device)
            mine = [(peer, t.to(dtype)) for peer, t, k in sends if k == kind]
            order = [i for i, (_, _, k) in enumerate(recvs) if k == kind]
            flat, layout = start_exchange(mine, [recvs[i][:2] for i in order], self.group, like, after=self.after)
            flights.append((flat, layout, order))
        nbytes = sum(t.numel() * t.element_size() for _, t, _ in sends)
        return flights, len(recvs), (phase, nbytes, tag)

    def wait(self, pending) -> list[torch.Tensor]:
        if pending is None:
            return []
        flights, n, (phase, nbytes, tag) = pending
        got = [None] * n
        with diagnosed("p2p", tag, self.group), timed_comm("p2p", phase, nbytes, tag):
            for flat, layout, order in flights:
                if not order:
                    self.unread.append(complete(flat))
                for i, t in zip(order, finish_exchange(flat, layout)):
                    got[i] = t
        return got

    def anchor(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` depending on every exchange this rank only sent on (``comm.anchor``: kept under compile)."""
        return anchor(x, self.unread)


def _moves(step, active) -> tuple[bool, bool]:
    """(some K/V block, some query block) travels to another rank at this step: global facts."""
    kv = any(on and task.kv != x for x, (task, on) in enumerate(zip(step, active)))
    q = any(on and task.q != x for x, (task, on) in enumerate(zip(step, active)))
    return kv, q


def _rows(x: torch.Tensor, task, c: int) -> torch.Tensor:
    a, b = task.rows(c)
    return x[..., a:b, :] if x.dim() == 4 else x[..., a:b]


def _inputs(plan, step, active, me, local: dict, like: dict):
    """The sends and receives that bring step ``step``'s inputs to the ranks computing it.

    ``local[kind](task)``: the tensor this rank sends for ``task`` (kind "kv" or "q");
    ``like[kind](task)``: the shape it arrives in."""
    sends, recvs = [], []
    for x, task in enumerate(step):
        if x == me or not active[x]:
            continue
        if task.kv == me:
            sends.append((x, local["kv"](task), CH_KV))
        if task.q == me:
            sends.append((x, local["q"](task), CH_Q))
    task = step[me]
    if active[me]:
        if task.kv != me:
            recvs.append((task.kv, like["kv"](task), CH_KV))
        if task.q != me:
            recvs.append((task.q, like["q"](task), CH_Q))
    return sends, recvs


def _received(task, me, bufs):
    """Split what a step's receives delivered into (kv, q) (None for what is local)."""
    bufs = list(bufs)
    kv = bufs.pop(0) if task.kv != me else None
    q = bufs.pop(0) if task.q != me else None
    return kv, q


class DistFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: DistFlashPlan, group, kernel, scale: float):
        me, c = plan.rank, plan.chunk
        steps, active = plan.steps(), active_tasks(plan)
        ex = _Exchange(group, q.device, after=q)
        kv = torch.stack([k, v]).contiguous()
        acc = acc_dtype(q)
        B, H, _, D = q.shape
        out = q.new_zeros((B, H, c, D), dtype=acc)
        lse = q.new_full((B, H, c), float("-inf"), dtype=acc)
        local = {"kv": lambda task: kv, "q": lambda task: _rows(q, task, c).contiguous()}
        like = {"kv": lambda task: kv.shape, "q": lambda task: (B, H, _n(task, c), D)}

        def absorb(homing, got):
            for (_, task), part in zip(homing, got):
                a, b = task.rows(c)
                out[..., a:b, :], lse[..., a:b] = merge(out[..., a:b, :], lse[..., a:b], part[..., :D], part[..., D])

        def post_inputs(s):
            if s >= len(steps):
                return None
            kv_moves, q_moves = _moves(steps[s], active[s])
            kinds = {**({CH_KV: kv.dtype} if kv_moves else {}), **({CH_Q: q.dtype} if q_moves else {})}
            return ex.post(*_inputs(plan, steps[s], active[s], me, local, like), kinds, "forward",
                           "ring_distflash_in")

        pending_in, pending_out = post_inputs(0), None
        for s, step in enumerate(steps):
            nxt = post_inputs(s + 1)
            got = ex.wait(pending_in)
            task, sends = step[me], []
            if active[s][me]:
                kv_in, q_in = _received(task, me, got)
                kv_t = kv if kv_in is None else kv_in
                q_t = _rows(q, task, c) if q_in is None else q_in
                o, l = _forward_task(plan, kernel, s, task, q_t, kv_t[0], kv_t[1], scale)
                part = torch.cat([o.to(acc), l.to(acc).unsqueeze(-1)], -1)
                if task.q == me:
                    absorb([(me, task)], [part])
                else:  # a lent block: its partial (out, lse) goes home as one [..., D + 1] message
                    sends.append((task.q, part.contiguous(), CH_OUT))
            homing = [(x, t) for x, t in enumerate(step) if x != me and active[s][x] and t.q == me]
            recvs = [(x, (B, H, _n(t, c), D + 1), CH_OUT) for x, t in homing]
            lent = _moves(step, active[s])[1]   # some rank computed a lent block: partials go home
            posted = ex.post(sends, recvs, {CH_OUT: acc} if lent else {}, "forward", "ring_distflash_out")
            if pending_out is not None:
                absorb(pending_out[0], ex.wait(pending_out[1]))
            pending_out, pending_in = (homing, posted), nxt
        absorb(pending_out[0], ex.wait(pending_out[1]))
        if sinks is not None:
            out, lse = merge_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if sinks is not None else []))
        ctx.has_sinks, ctx.plan, ctx.group, ctx.kernel, ctx.scale, ctx.active = (
            sinks is not None, plan, group, kernel, scale, active)
        return ex.anchor(out.to(q.dtype))

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sinks = rest[0] if ctx.has_sinks else None
        plan, group, kernel, scale, active = ctx.plan, ctx.group, ctx.kernel, ctx.scale, ctx.active
        me, c = plan.rank, plan.chunk
        steps = plan.steps()
        dout = dout.contiguous()
        ex = _Exchange(group, q.device, after=dout)
        acc = acc_dtype(q)
        B, H, _, D = q.shape
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        # a lent block needs the owner's queries, dO, merged output and LSE: one [.., 3D + 1] message
        def owner_rows(task):
            return torch.cat([_rows(q, task, c).to(acc), _rows(dout, task, c).to(acc), _rows(out, task, c),
                              _rows(lse, task, c).unsqueeze(-1)], -1).contiguous()

        local = {"kv": lambda task: kv, "q": owner_rows}
        like = {"kv": lambda task: kv.shape, "q": lambda task: (B, H, _n(task, c), 3 * D + 1)}

        def add_dq(task, g):
            a, b = task.rows(c)
            dq[..., a:b, :] += g

        def post_inputs(s):
            if s >= len(steps):
                return None
            kv_moves, q_moves = _moves(steps[s], active[s])
            kinds = {**({CH_KV: kv.dtype} if kv_moves else {}), **({CH_Q: acc} if q_moves else {})}
            return ex.post(*_inputs(plan, steps[s], active[s], me, local, like), kinds, "backward",
                           "ring_distflash_in")

        pending_in, pending_grads = post_inputs(0), None
        for s, step in enumerate(steps):
            nxt = post_inputs(s + 1)
            got = ex.wait(pending_in)
            task, sends = step[me], []
            if active[s][me]:
                kv_in, q_in = _received(task, me, got)
                kv_t = kv if kv_in is None else kv_in
                if q_in is None:
                    q_t, do_t, o_t, l_t = (_rows(x, task, c) for x in (q, dout, out, lse))
                else:
                    q_t, do_t, o_t, l_t = (q_in[..., :D].to(q.dtype), q_in[..., D:2 * D].to(dout.dtype),
                                           q_in[..., 2 * D:3 * D], q_in[..., 3 * D])
                g_q, g_k, g_v = _backward_task(plan, kernel, s, task, do_t, q_t, kv_t[0], kv_t[1], o_t, l_t, scale)
                if task.q == me:
                    add_dq(task, g_q.to(acc))
                else:
                    sends.append((task.q, g_q.to(acc).contiguous(), CH_DQ))
                if task.kv == me:
                    dkv[0].add_(g_k.to(acc))
                    dkv[1].add_(g_v.to(acc))
                else:
                    sends.append((task.kv, torch.stack([g_k.to(acc), g_v.to(acc)]).contiguous(), CH_DKV))
            homing = []
            for x, t in enumerate(step):
                if x == me or not active[s][x]:
                    continue
                if t.q == me:
                    homing.append(("dq", t, (x, (B, H, _n(t, c), D), CH_DQ)))
                if t.kv == me:
                    homing.append(("dkv", t, (x, dkv.shape, CH_DKV)))
            kv_moves, q_moves = _moves(step, active[s])
            kinds = {**({CH_DQ: acc} if q_moves else {}), **({CH_DKV: acc} if kv_moves else {})}
            posted = ex.post(sends, [h[2] for h in homing], kinds, "backward", "ring_distflash_grads")
            if pending_grads is not None:
                _absorb_grads(pending_grads[0], ex.wait(pending_grads[1]), add_dq, dkv)
            pending_grads = (homing, posted)
            pending_in = nxt
        _absorb_grads(pending_grads[0], ex.wait(pending_grads[1]), add_dq, dkv)
        dsinks = None
        if sinks is not None:
            dsinks = sink_grad(sinks, lse.to(acc), dout, out)   # per head [H] or per token [B, H, S]
        return ex.anchor(dq.to(q.dtype)), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None, None


def _absorb_grads(homing, got, add_dq, dkv):
    for (kind, task, _), g in zip(homing, got):
        if kind == "dq":
            add_dq(task, g)
        else:
            dkv.add_(g)


def _n(task, c: int) -> int:
    a, b = task.rows(c)
    return b - a


def distflash_attention(q, k, v, group, plan: DistFlashPlan, kernel, scale: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of this rank's contiguous span over the whole sequence.

    q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` (rank r holds tokens ``[r S/P, (r+1) S/P)``);
    returns ``[B, Hq, S/P, D]``. ``sinks`` (``[Hq]``) adds gpt-oss style attention sinks.
    """
    if q.shape[-2] != plan.chunk:
        raise ValueError(f"distflash plan expects {plan.chunk} tokens per rank, got q of shape {tuple(q.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return DistFlashAttention.apply(q, k, v, sinks, plan, group, kernel, scale)
