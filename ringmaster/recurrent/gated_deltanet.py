"""Gated-DeltaNet linear attention under CP (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid).

The layers call ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` (flash-linear-
attention's ``chunk_gated_delta_rule`` when installed) by module-level name from ``forward``;
:func:`wire_gated_deltanet_layer` gives one layer *instance* a copy of its forward in which
those names resolve to CP-aware versions.

The gated delta rule ``S_t = (I - β_t k_t k_tᵀ) e^{g_t} S_{t-1} + β_t k_t v_tᵀ`` is linear in
(state, values) jointly, so one call of the *unmodified* kernel with values ``[v | 0]`` and
initial state ``[0 | I]`` returns

* final state ``[b | A]``: the chunk's map ``S_end = A·S_start + b`` (``A`` is d_k × d_k);
* outputs ``[y0 | w]`` with ``y0`` the outputs from a zero state and ``w_t = A_{≤t}ᵀ q_t``,

so ``scan`` needs no second kernel call: ``y_t = y0_t + S_inᵀ w_t`` once the prefix ``S_in``
is known (all-gathered maps, composed in fp32). ``sequential`` runs the kernel with
``initial_state=S_in`` and passes the final state on. ``fla_cp`` (opt-in) hands the state passing to
flash-linear-attention's own context parallelism (:mod:`ringmaster.recurrent.fla_cp`; contiguous and
head_tail layouts).

With flash-linear-attention / causal-conv1d installed transformers resolves the kernel names to their
functions (``chunk_gated_delta_rule``, ``causal_conv1d_fn``); the same code calls them (FLA's final state is
fp32, its ``cu_seqlens`` is not used: packed rows keep the document cutting below). Verified on CPU against
the real flash-linear-attention (its Triton kernels under Triton's interpreter, tests/test_real_kernels.py);
causal-conv1d against its stand-in (tests/test_kernel_standins.py); not yet run on a GPU.

Packed or padded rows: conv taps and the recurrence never cross a document start (global
document ids from the ``ringmaster_batch`` kwarg; :class:`~ringmaster.recurrent.documents.
DocumentSegment` cuts each chunk at its starts, and a chunk with a start maps with ``A = 0``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

import torch.distributed as dist

from ..errors import UnsupportedLayerError
from .conv import cp_conv_kernel
from .context import LayerContext, call_guard, check_call_kwargs, decode_only_without_cp, wired_kernel
from ..sharding.documents import BATCH_KWARG
from .documents import by_parts, global_documents, host_runs, document_segments
from .fla_cp import STRATEGY as FLA_CP, fla_cp_rule, takes_varlen, unavailable_reason
from .heads import STRATEGY as HEADS, run_heads
from ..intercept import rebind_forward
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> the module-level name transformers' gated-DeltaNet layers call (a family spec may rename them)
KERNELS = {"conv": "causal_conv1d_fn", "scan": "torch_chunk_gated_delta_rule"}
OPTIONAL = {"conv_update": "causal_conv1d_update", "state_update": "torch_recurrent_gated_delta_rule"}
REQUIRED = tuple(KERNELS.values())


# kernel keywords that transform g or beta in the kernel (flash-linear-attention's chunk_gated_delta_rule /
# chunk_kda): zero padding is then no longer g = beta = 0 (GatedDeltaSegment.neutral_padding)
GATE_IN_KERNEL = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate", "lower_bound")


class GatedDeltaSegment:
    """One chunk of a ``chunk_gated_delta_rule`` call (``q, k [b, l, hk, dk]``, ``v [b, l, hv, dv]``,
    ``g, beta [b, l, hv]``)."""

    def __init__(self, kernel: Callable, q, k, v, g, beta, kwargs: dict | None = None):
        self.kernel, self.q, self.k, self.v, self.g, self.beta = kernel, q, k, v, g, beta
        self.kwargs = dict(kwargs or {})

    @property
    def neutral_padding(self) -> bool:
        """Zero padding leaves any state as it is (``g = 0``: no decay, ``beta = 0``: no update; documents.
        PiecesSegment) where the kernel takes ``g`` and ``beta`` as they are: no keyword of :data:`GATE_IN_KERNEL`
        set. (The call's other keywords, the model's own pass-through ones included, leave them alone.)"""
        return not any(self.kwargs.get(name) not in (None, False) for name in GATE_IN_KERNEL)

    def _call(self, v, state_in):
        return self.kernel(self.q, self.k, v, g=self.g, beta=self.beta, initial_state=state_in,
                           output_final_state=True, **self.kwargs)

    def state_meta(self):
        b, _, hv, dv = self.v.shape
        dk = self.k.shape[-1]
        return (b, hv, dk, dv), state_dtype(self.q, self.v), self.v.device

    def map_meta(self):
        (b, hv, dk, dv), _, _ = self.state_meta()
        return (b, hv, dk, dv + dk)

    def local_map(self):
        (b, hv, dk, dv), dtype, device = self.state_meta()
        v_ext = torch.cat([self.v, self.v.new_zeros(*self.v.shape[:-1], dk)], dim=-1)
        eye = torch.eye(dk, dtype=dtype, device=device).expand(b, hv, dk, dk)
        init = torch.cat([torch.zeros(b, hv, dk, dv, dtype=dtype, device=device), eye], dim=-1)
        out, final = self._call(v_ext, init)
        y0, w = out[..., :dv], out[..., dv:]
        return hi(final), (y0, w)                      # final = [b | A]: [b, hv, dk, dv + dk]

    def combine(self, state, packed):
        dv = self.v.shape[-1]
        b, A = packed[..., :dv], packed[..., dv:]
        if state is None:
            return b
        return A @ state + b

    def finish(self, aux, state_in):
        y0, w = aux
        if state_in is None:
            return y0
        return y0 + torch.einsum("blhk,bhkv->blhv", hi(w).to(state_in.dtype), state_in).to(y0.dtype)

    def run(self, state_in):
        return self._call(self.v, state_in)

    def sub(self, rows, start, stop):
        """The same rule over batch ``rows`` (None: all) and tokens ``[start, stop)``."""
        def cut(t):
            t = t[:, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return GatedDeltaSegment(self.kernel, cut(self.q), cut(self.k), cut(self.v), cut(self.g), cut(self.beta),
                                 self.kwargs)

    def with_tensors(self, fn):
        """The same rule over ``fn`` of each per-token input (``[b, l, ...]``; documents.PiecesSegment)."""
        return GatedDeltaSegment(self.kernel, fn(self.q), fn(self.k), fn(self.v), fn(self.g), fn(self.beta),
                                 self.kwargs)

    def packed_final(self, packed):
        """The final state of a zero incoming state, from a packed map ``[b | A]``."""
        return packed[..., :self.v.shape[-1]]

    def state_map(self, final):
        """The packed map of a chunk the incoming state cannot cross (a document starts in it):
        ``[b | A] = [final | 0]``."""
        final = hi(final)
        return torch.cat([final, final.new_zeros(*final.shape[:-1], final.shape[-2])], dim=-1)


def cp_chunk_gated_delta_rule(kernel: Callable, ctx: LayerContext, query, key, value, g, beta,
                              initial_state=None, output_final_state=False, *, fla_varlen: bool = False, **kwargs):
    """``chunk_gated_delta_rule`` for this rank's shard, with the earlier shards' state passed in. ``fla_varlen``:
    ``kernel`` is flash-linear-attention's with its varlen mode (:func:`~.fla_cp.takes_varlen`, decided at wire)."""
    batch = ctx.take_batch(kwargs)
    if ctx.probe is not None:   # wire's probe: this kernel is reached, and its incoming state matters
        ctx.probe.shared_by(value.shape[2], query.shape[2], "query/key head")
        seg = GatedDeltaSegment(kernel, query, key, value, g, beta, kwargs=kwargs)
        ctx.probe.observe(seg, [query, key, value, g, beta], value, value.shape[2],
                        {0: (query.shape[2], "query/key head"), 1: (key.shape[2], "query/key head")})
        return probe_run(seg, ctx.probe.state("scan", *seg.state_meta()), ctx.path)[0], None
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, q, k, v, g_, b_: cp_chunk_gated_delta_rule(
            kernel, ctx, q, k, v, g_, b_, initial_state, output_final_state, fla_varlen=fla_varlen,
            **{**kwargs, BATCH_KWARG: part}),
            (query, key, value, g, beta), (1,) * 5, 1)
    group, size, layout, strategy = ctx.resolve(batch)
    packed = getattr(batch, "doc_ids", None) is not None
    if size == 1 and not packed:
        return kernel(query, key, value, g=g, beta=beta, initial_state=initial_state,
                      output_final_state=output_final_state, **kwargs)
    check_call_kwargs(ctx.path, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seqlens",)}
    if initial_state is not None or output_final_state:
        raise RuntimeError(f"{ctx.path}: a cache (initial/final recurrent state) is not supported under CP or "
                           "with packed rows; run the model with use_cache=False")
    if strategy == FLA_CP and size > 1:
        docs = global_documents(batch, ctx.path, size, query.shape[0], query.shape[1])
        runs = None if docs is None else host_runs(batch)
        return fla_cp_rule(kernel, ctx.path, group, layout, runs, query, key, value, g, beta, kwargs), None
    if strategy == HEADS and size > 1:
        return heads_rule(kernel, ctx.path, group, layout, batch, query, key, value, g, beta, kwargs,
                          fla_varlen), None
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=1) for t in (query, key, value, g, beta)]
    segments = [GatedDeltaSegment(kernel, *chunk, kwargs=kwargs) for chunk in zip(*parts)]
    segments = document_segments(segments, batch, ctx.path, size, rank, layout, tuple(query.shape[:2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return (outs[0] if n == 1 else torch.cat(outs, dim=1)), None


def _fla_varlen(kernel: Callable, kwargs: dict, flat, batch):
    """flash-linear-attention's own varlen mode: every document of every whole row in one call (the boundaries on
    the device and on the host, made once per batch)."""
    q, k, v, g, beta = flat
    rows = q.shape[1] // batch.seq_len
    return kernel(q, k, v, g=g, beta=beta, cu_seqlens=batch.recurrent_bounds(rows, q.device),
                  cu_seqlens_cpu=batch.recurrent_bounds(rows), **kwargs)[0]


def heads_rule(kernel: Callable, path: str, group, layout: str, batch, query, key, value, g, beta, kwargs: dict,
               fla_varlen: bool = False):
    """``recurrent="heads"``: the layer's kernel over whole rows for this rank's value heads (q / k replicated to
    the groups those heads read when the key heads are fewer than the ranks); returns the outputs ``[b, l, hv, dv]``.
    ``fla_varlen``: packed rows in one varlen call of the kernel (flash-linear-attention's)."""
    return run_heads(path, group, layout, batch, [query, key, value, g, beta],
                     lambda *t: GatedDeltaSegment(kernel, *t, kwargs=kwargs), value.shape[2], "value heads",
                     shared={0: "query/key head", 1: "query/key head"},
                     varlen=functools.partial(_fla_varlen, kernel, kwargs) if fla_varlen else None)


def wire_gated_deltanet_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one gated-DeltaNet layer instance through exact CP; returns the undo. ``names``: role ->
    the kernel name this layer calls (default :data:`KERNELS` and :data:`OPTIONAL`)."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    namespace = inspect.unwrap(type(module).forward).__globals__
    if ctx.strategy == FLA_CP:
        reason = unavailable_reason(namespace.get(names["scan"]))
        if reason is not None:
            raise UnsupportedLayerError(f"layer {ctx.path!r}: recurrent='fla_cp' (flash-linear-attention's own "
                                        f"context parallelism) is unavailable: {reason}; use recurrent='scan' or "
                                        "'sequential'")

    # flash-linear-attention's varlen mode, decided here for the kernel the name resolves to now (inspecting the
    # kernel in forward crashed dynamo); a kernel put there later is never given cu_seqlens
    current = wired_kernel(namespace, names["scan"], lambda kernel: {"fla_varlen": takes_varlen(kernel)})

    def rule(*args, **kwargs):
        kernel, facts = current()
        return cp_chunk_gated_delta_rule(kernel, ctx, *args, **facts, **kwargs)

    replacements: dict[str, Any] = {
        names["conv"]: cp_conv_kernel(ctx, namespace, names["conv"]),
        names["scan"]: rule,
        names["conv_update"]: decode_only_without_cp(ctx, namespace, names["conv_update"]),
        names["state_update"]: decode_only_without_cp(ctx, namespace, names["state_update"]),
    }
    return rebind_forward(module, ctx.path, replacements, [names[r] for r in KERNELS], guard=call_guard(ctx))


KIND = RecurrentKind(name="gated_deltanet", kernels=KERNELS, optional=OPTIONAL, wire=wire_gated_deltanet_layer,
                     strategies=(FLA_CP, HEADS),
                     description="gated DeltaNet: causal conv1d + chunked gated delta rule (d_k x d_k transition)")
