"""Mamba2 mixers under CP (Nemotron-H, Bamba, Falcon-H1, GraniteMoeHybrid).

The mixers of transformers 5.x call three module-level kernels by name from ``forward``:
``mamba2_split_conv1d_scan_combined`` (fused, mamba-ssm only; it takes no conv state, so it
is routed around: it returns None, as the torch fallback does), ``causal_conv1d_fn`` and
``mamba2_chunk_scan`` (mamba-ssm's ``mamba_chunk_scan_combined`` when installed, else the
pure-torch SSD). :func:`wire_mamba2_layer` gives one mixer *instance* a copy of its class
forward in which those names resolve to CP-aware versions (nothing global is patched):

* conv: :func:`ringmaster.recurrent.conv.cp_causal_conv1d` (halo from the previous chunk);
* scan: the chunk's map is ``S_end = a · S_start + b`` with ``a = exp(Σ A·dt)`` per head and
  ``b`` the final state from zero; ``scan`` all-gathers the maps and adds the closed-form
  correction ``y_t += exp(Σ_{s<=t} A·dt_s) · C_t · S_in``; ``sequential`` reruns the kernel
  with ``initial_states=S_in``. Both in fp32, decays multiplied, never divided.

With mamba-ssm / causal-conv1d installed transformers resolves the names to ``mamba_chunk_scan_combined``
and ``causal_conv1d_fn``; the same calls reach them (``initial_states`` / ``return_final_states`` as the
real API takes them; their ``seq_idx`` is not used: packed rows keep the document cutting below).
Verified on CPU against stand-ins of those packages (tests/test_kernel_standins.py), not yet run on a GPU.

Packed or padded rows (the ``ringmaster_batch`` kwarg carries global document ids): the conv
masks every tap that crosses a document start and each shard chunk is cut at its document
starts (:class:`~ringmaster.recurrent.documents.DocumentSegment`: a chunk with a start
has decay 0 in its map), so state never flows from one document into the next, at any CP size.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.distributed as dist

from .fla_cp import kernel_takes
from .step_size import mamba2_dt, pad_step, step_pads_neutrally
from .context import LayerContext, check_call_kwargs
from ..sharding.documents import BATCH_KWARG
from .documents import by_parts, document_segments
from .heads import STRATEGY as HEADS, local_heads, run_heads
from .mixer import wire_conv_scan_mixer
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> the module-level name transformers' Mamba2 mixers call (a family spec may rename them)
KERNELS = {"conv": "causal_conv1d_fn", "scan": "mamba2_chunk_scan"}
OPTIONAL = {"fused": "mamba2_split_conv1d_scan_combined", "conv_update": "causal_conv1d_update",
            "state_update": "mamba2_selective_state_update"}
REQUIRED = tuple(KERNELS.values())


class Mamba2Segment:
    """One chunk of a ``mamba2_chunk_scan`` call (``x [b, l, h, p]``, ``dt [b, l, h]``, ``B, C [b, l, g, n]``)."""

    def __init__(self, kernel: Callable, x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                 dt_limit=(0.0, math.inf), kwargs: dict | None = None):
        self.kernel, self.x, self.dt, self.A, self.B, self.C = kernel, x, dt, A, B, C
        self.chunk_size, self.D, self.dt_bias = chunk_size, D, dt_bias
        self.dt_softplus, self.dt_limit, self.kwargs = dt_softplus, dt_limit, dict(kwargs or {})

    def _call(self, state_in):
        return self.kernel(self.x, self.dt, self.A, self.B, self.C, self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                           initial_states=state_in, dt_softplus=self.dt_softplus, dt_limit=self.dt_limit,
                           return_final_states=True, **self.kwargs)

    def state_meta(self):
        b, _, h, p = self.x.shape
        return (b, h, p, self.B.shape[-1]), state_dtype(self.x, self.dt), self.x.device

    def map_meta(self):
        b, h, p, n = self.state_meta()[0]
        return (b, h, p * n + 1)

    def local_map(self):
        y0, final = self._call(None)
        dt = mamba2_dt(hi(self.dt), None if self.dt_bias is None else hi(self.dt_bias), self.dt_softplus,
                       self.dt_limit)
        log_decay = torch.cumsum(hi(self.A) * dt, dim=1)                 # [b, l, h], <= 0
        packed = torch.cat([hi(final).flatten(2), log_decay[:, -1].exp()[..., None].to(hi(final).dtype)], dim=-1)
        return packed, (y0, log_decay)

    def combine(self, state, packed):
        shape = self.state_meta()[0]
        b = packed[..., :-1].reshape(shape)
        if state is None:
            return b
        return packed[..., -1][..., None, None] * state + b

    def finish(self, aux, state_in):
        y0, log_decay = aux
        if state_in is None:
            return y0
        h, g = self.x.shape[2], self.C.shape[2]
        C = hi(self.C).to(state_in.dtype).repeat_interleave(h // g, dim=2)
        corr = torch.einsum("blhn,bhpn->blhp", C, state_in) * log_decay.exp().to(state_in.dtype)[..., None]
        return y0 + corr.to(y0.dtype)

    def run(self, state_in):
        return self._call(state_in)

    def sub(self, rows, start, stop):
        """The same scan over batch ``rows`` (None: all) and tokens ``[start, stop)``."""
        def cut(t):
            t = t[:, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return Mamba2Segment(self.kernel, cut(self.x), cut(self.dt), self.A, cut(self.B), cut(self.C),
                             self.chunk_size, self.D, self.dt_bias, self.dt_softplus, self.dt_limit, self.kwargs)

    @property
    def neutral_padding(self) -> bool:
        """The padding of :meth:`with_tensors` leaves any state as it is (:func:`~.step_size.step_pads_neutrally`)."""
        return step_pads_neutrally(self.dt_softplus, self.dt_bias, self.dt_limit[0])

    def with_tensors(self, fn):
        """The same scan over ``fn`` of each per-token input (``[b, l, ...]``; documents.PiecesSegment), padded
        with a step of 0 (:func:`~.step_size.pad_step`) and zeros."""
        return Mamba2Segment(self.kernel, fn(self.x), fn(self.dt, pad_step(self.dt_softplus)), self.A,
                             fn(self.B), fn(self.C), self.chunk_size, self.D, self.dt_bias, self.dt_softplus,
                             self.dt_limit, self.kwargs)

    def packed_final(self, packed):
        """The final state of a zero incoming state, from a packed map ``[b flattened | decay]``."""
        return packed[..., :-1].reshape(packed.shape[0], *self.state_meta()[0][1:])

    def state_map(self, final):
        """The packed map of a chunk the incoming state cannot cross (a document starts in it):
        decay 0, ``b = final``."""
        final = hi(final)
        return torch.cat([final.flatten(2), final.new_zeros(*final.shape[:2], 1)], dim=-1)


def cp_mamba2_chunk_scan(kernel: Callable, ctx: LayerContext, hidden_states, dt, A, B, C, chunk_size, D=None,
                         dt_bias=None, initial_states=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                         return_final_states=False, *, ssm_varlen: bool = False, **kwargs):
    """``mamba2_chunk_scan`` for this rank's shard, with the state of the earlier shards passed in. ``ssm_varlen``:
    ``kernel`` is mamba-ssm's ``mamba_chunk_scan_combined``, which resets its state where ``seq_idx`` changes (decided
    at wire: :func:`~.fla_cp.kernel_takes`; transformers' torch fallback is never given ``seq_idx``)."""
    batch = ctx.take_batch(kwargs)
    if ctx.probe is not None:   # wire's probe: this kernel is reached, and its incoming state matters
        kwargs.pop("z", None)
        ctx.probe.shared_by(hidden_states.shape[2], B.shape[2], "B/C")
        seg = Mamba2Segment(kernel, hidden_states, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, kwargs)
        ctx.probe.observe(seg, [hidden_states, dt, B, C], hidden_states, hidden_states.shape[2],
                        {2: (B.shape[2], "B/C"), 3: (C.shape[2], "B/C")})
        return probe_run(seg, ctx.probe.state("scan", *seg.state_meta()), ctx.path)[0]
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, x, dt_, b_, c_: cp_mamba2_chunk_scan(
            kernel, ctx, x, dt_, A, b_, c_, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
            return_final_states, ssm_varlen=ssm_varlen, **{**kwargs, BATCH_KWARG: part}), (hidden_states, dt, B, C),
            (1,) * 4, 1)
    group, size, layout, strategy = ctx.resolve(batch)
    packed = getattr(batch, "doc_ids", None) is not None
    if size == 1 and not packed:
        return kernel(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                      dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states, **kwargs)
    check_call_kwargs(ctx.path, kwargs)
    if initial_states is not None or return_final_states:
        raise RuntimeError(f"{ctx.path}: a cache (initial/final SSM state) is not supported under CP or with "
                           "packed rows; run the model with use_cache=False")
    kwargs.pop("z", None)  # the mixers gate outside the scan (z=None)
    if strategy == HEADS and size > 1:
        return heads_scan(kernel, ctx.path, group, layout, batch, hidden_states, dt, A, B, C, chunk_size, D, dt_bias,
                          dt_softplus, dt_limit, kwargs, ssm_varlen)
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=1) for t in (hidden_states, dt, B, C)]
    segments = [Mamba2Segment(kernel, x, d, A, b, c, chunk_size, D, dt_bias, dt_softplus, dt_limit, kwargs)
                for x, d, b, c in zip(*parts)]
    segments = document_segments(segments, batch, ctx.path, size, rank, layout, tuple(hidden_states.shape[:2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return outs[0] if n == 1 else torch.cat(outs, dim=1)




def _ssm_varlen(kernel: Callable, A, chunk_size, D, dt_bias, dt_softplus, dt_limit, kwargs: dict, flat, batch):
    """mamba-ssm's own packed mode: every document of every whole row in one call, ``seq_idx`` (one index per
    document) made once per batch from the host boundaries."""
    x, dt, B, C = flat
    keep = {k: v for k, v in kwargs.items() if k not in ("seq_idx", "cu_seqlens")}
    return kernel(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                  seq_idx=batch.recurrent_seq_idx(x.shape[1] // batch.seq_len, x.device), dt_softplus=dt_softplus,
                  dt_limit=dt_limit, **keep)


def heads_scan(kernel: Callable, path: str, group, layout: str, batch, x, dt, A, B, C, chunk_size, D, dt_bias,
               dt_softplus, dt_limit, kwargs: dict, ssm_varlen: bool = False):
    """``recurrent="heads"``: the chunk scan over whole rows for this rank's heads; B / C replicated to the groups
    those heads read when ``n_groups`` < P; A, D and dt_bias sliced to them. Returns ``[b, l, h, p]``.
    ``ssm_varlen``: packed rows in one call of mamba-ssm's kernel with ``seq_idx``."""
    A, D, dt_bias = (local_heads(t, group) for t in (A, D, dt_bias))
    varlen = (functools.partial(_ssm_varlen, kernel, A, chunk_size, D, dt_bias, dt_softplus, dt_limit, kwargs)
              if ssm_varlen else None)
    return run_heads(path, group, layout, batch, [x, dt, B, C], lambda x_, dt_, B_, C_: Mamba2Segment(
        kernel, x_, dt_, A, B_, C_, chunk_size, D, dt_bias, dt_softplus, dt_limit, kwargs), x.shape[2],
        shared={2: "B/C", 3: "B/C"}, varlen=varlen)


def wire_mamba2_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one Mamba2 mixer instance through exact CP; returns the undo. ``names``: role -> the
    kernel name this layer calls (default :data:`KERNELS` and :data:`OPTIONAL`)."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    def facts(kernel):   # mamba-ssm's scan resets where seq_idx changes: packed rows in one call under heads
        return {"ssm_varlen": kernel_takes(kernel, "mamba_ssm", ("seq_idx",))}
    return wire_conv_scan_mixer(module, ctx, names, [names[r] for r in KERNELS], cp_mamba2_chunk_scan,
                                wired_kwargs=facts)


KIND = RecurrentKind(name="mamba2", kernels=KERNELS, optional=OPTIONAL, wire=wire_mamba2_layer, strategies=(HEADS,),
                     description="Mamba2 mixer: causal conv1d + SSD chunk scan (per-head scalar decay)")
