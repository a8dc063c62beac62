"""Mamba1 selective scans under CP (Mamba, FalconMamba, Jamba, Zamba).

The mixers of transformers 5.x call module-level kernels by name from ``forward``:
``causal_conv1d_fn`` (the ``causal-conv1d`` package when installed, else a torch depthwise conv),
``mamba_selective_scan`` (mamba-ssm's ``selective_scan_fn`` when installed, else the pure-torch
recurrence) and, Mamba/FalconMamba in training only, the fused ``mamba_inner_fn`` (mamba-ssm
only; the torch fallback returns None and the mixer takes its unfused path). Which
implementation a name holds is chosen once, at import, by transformers'
``use_kernel_func_from_hub_with_fallback`` (hub kernel if requested, else the package, else
torch): on CPU the torch path always runs. :func:`wire_mamba1_layer` gives one mixer *instance* a
copy of its class forward in which those names resolve to CP-aware versions (nothing global is
patched):

* conv: :func:`ringmaster.recurrent.conv.cp_causal_conv1d` (halo of ``kernel_size - 1`` inputs
  from the previous chunk, the model's own kernel on ``[halo | chunk]``);
* fused ``mamba_inner_fn``: takes no incoming state, so under CP (or a packed row) it returns
  None, as the torch fallback does, and the mixer runs the unfused conv + scan;
* scan: the state is ``[b, d_inner, d_state]`` with a *diagonal* transition, so a chunk's map is
  ``S_end = a ⊙ S_start + b`` with ``a = exp(Σ_t dt_t A)`` (one decay per channel and state
  entry) and ``b`` the final state from zero. The outputs are affine in ``S_start`` too:
  ``y_t = y0_t + C_t · (exp(Σ_{s<=t} dt_s A) ⊙ S_start)`` before the ``silu(z)`` gate, which is
  applied after the correction (the kernel is called with ``z=None``). ``scan`` all-gathers the
  maps and composes them in fp32 (fp64 for a float64 model); ``sequential`` passes the state
  rank to rank and adds the same correction. Decays are multiplied, never divided.

The kernel itself always runs from a zero state: neither transformers' torch fallback nor
mamba-ssm's ``selective_scan_fn`` takes an initial state (its API has ``return_last_state`` only),
so the incoming state enters through the closed-form correction, computed in tiles of
:data:`TILE` tokens that are recomputed in backward (:func:`decayed_readout`): the decays
``[b, d_inner, l, d_state]`` (the size of the torch fallback's own ``discrete_A``) never live at once.
The chunk's own end state ``b`` is computed the same way (:func:`decayed_state`), not taken from the
kernel's ``return_last_state``: mamba-ssm returns that last state from an autograd Function whose
backward *ignores its gradient*, so a map built from it would silently cut every earlier shard's
gradient through the carried state (the torch fallback keeps it, which is why only the real package, or
its CPU stand-in ``standins.kernels``, shows the difference). With mamba-ssm /
causal-conv1d installed the same code calls them (the conv through its halo, no ``initial_states``
needed): verified on CPU against the stand-in packages (tests/test_kernel_standins.py), not yet run on
a GPU.

Packed or padded rows (the ``ringmaster_batch`` kwarg carries global document ids): the conv
masks every tap that crosses a document start and each chunk is cut at its document starts
(:class:`~ringmaster.recurrent.documents.DocumentSegment`), so no state flows between documents.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .context import LayerContext, check_call_kwargs
from ..sharding.documents import BATCH_KWARG
from .documents import by_parts, document_segments
from .mixer import wire_conv_scan_mixer
from .heads import STRATEGY as HEADS, local_heads, run_heads
from .kind import RecurrentKind
from .step_size import mamba1_dt, pad_step, step_pads_neutrally
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> the module-level name transformers' Mamba1 mixers call (a family spec may rename them)
KERNELS = {"conv": "causal_conv1d_fn", "scan": "mamba_selective_scan"}
OPTIONAL = {"fused": "mamba_inner_fn", "conv_update": "causal_conv1d_update",
            "state_update": "mamba_selective_state_update"}


TILE = 256   # tokens per tile of the state correction: [b, d_inner, TILE, d_state] at a time


def _readout(cum_dt, A, state, C):
    """``C_t · (exp(cum_dt_t A) ⊙ S)`` for one tile: ``cum_dt [b, d, T]``, ``A [d, n]``, ``S [b, d, n]``,
    ``C [b, n, T]`` -> ``[b, d, T]``."""
    return torch.einsum("bdtn,bdn,bnt->bdt", torch.exp(cum_dt[..., None] * A[:, None, :]), state, C)


def decayed_readout(cum_dt, A, state, C, tile: int = TILE):
    """The outputs' dependence on the incoming state, ``y_t += C_t · (exp(Σ_{s<=t} dt_s A) ⊙ S_in)``, in
    tiles of ``tile`` tokens, each recomputed in backward (activation checkpointing): the decays
    ``[b, d_inner, l, d_state]`` are never held for the whole chunk (mamba-ssm's kernel keeps O(l · d_inner))."""
    l = cum_dt.shape[-1]
    outs = []
    for a in range(0, l, tile):
        args = (cum_dt[..., a:a + tile], A, state, C[..., a:a + tile])
        if l > tile and torch.is_grad_enabled() and any(t.requires_grad for t in args):
            outs.append(checkpoint(_readout, *args, use_reentrant=False))
        else:
            outs.append(_readout(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _decayed_state(rev_dt, A, x, B):
    """``Σ_t exp(rev_dt_t A) ⊙ x_t B_t`` for one tile: ``rev_dt, x [b, d, T]``, ``A [d, n]``, ``B [b, n, T]``
    -> ``[b, d, n]``."""
    return torch.einsum("bdtn,bdt,bnt->bdn", torch.exp(rev_dt[..., None] * A[:, None, :]), x, B)


def decayed_state(dt, A, u, B, tile: int = TILE):
    """A chunk's end state from a zero start, ``S_end = Σ_t exp(Σ_{s>t} dt_s A) ⊙ (dt_t u_t) B_t``
    (``dt, u [b, d, l]``, ``A [d, n]``, ``B [b, n, l]``), in tiles of ``tile`` tokens recomputed in backward,
    with its full gradient (mamba-ssm's ``return_last_state`` has none). The suffix sums of ``dt`` are
    summed directly (no difference of prefix sums), so the decays stay products, never quotients."""
    rev = torch.flip(torch.cumsum(torch.flip(dt, [-1]), -1), [-1]) - dt        # Σ_{s>t} dt_s, >= 0
    x = dt * u
    l = dt.shape[-1]
    total = None
    for a in range(0, l, tile):
        args = (rev[..., a:a + tile], A, x[..., a:a + tile], B[..., a:a + tile])
        if l > tile and torch.is_grad_enabled() and any(t.requires_grad for t in args):
            part = checkpoint(_decayed_state, *args, use_reentrant=False)
        else:
            part = _decayed_state(*args)
        total = part if total is None else total + part
    return total


class Mamba1Segment:
    """One chunk of a ``selective_scan_fn`` call: ``u, delta, z [b, d, l]``, ``A [d, n]``,
    ``B, C [b, n, l]``; the token dim is the last one (``seq_dim``: outputs ``[b, d, l]``)."""

    seq_dim = 2

    def __init__(self, kernel: Callable, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                 delta_softplus=False, kwargs: dict | None = None):
        self.kernel, self.u, self.delta, self.A, self.B, self.C = kernel, u, delta, A, B, C
        self.D, self.z, self.delta_bias, self.delta_softplus = D, z, delta_bias, delta_softplus
        self.kwargs = dict(kwargs or {})

    def _call(self):
        """The model's kernel on this chunk from a zero state, ungated: ``y0 = scan + D·u`` (its last state is
        not asked for: see the module docstring)."""
        return self.kernel(self.u, self.delta, self.A, self.B, self.C, D=self.D, z=None, delta_bias=self.delta_bias,
                           delta_softplus=self.delta_softplus, return_last_state=False, **self.kwargs)

    def _gate(self, y):
        return y if self.z is None else y * F.silu(self.z)

    def state_meta(self):
        b, d, _ = self.u.shape
        return (b, d, self.A.shape[-1]), state_dtype(self.u, self.delta), self.u.device

    def map_meta(self):
        b, d, n = self.state_meta()[0]
        return (b, d, 2 * n)

    def local_map(self):
        y0 = self._call()
        y0 = y0[0] if isinstance(y0, tuple) else y0
        dtype = self.state_meta()[1]
        dt = mamba1_dt(hi(self.delta).to(dtype), None if self.delta_bias is None else hi(self.delta_bias).to(dtype),
                       self.delta_softplus)                                  # [b, d, l]
        A = hi(self.A).to(dtype)
        cum_dt = torch.cumsum(dt, dim=-1)                                    # [b, d, l]: exp(cum_dt * A) <= 1
        decay = torch.exp(cum_dt[..., -1, None] * A)                         # [b, d, n]
        final = decayed_state(dt, A, hi(self.u).to(dtype), hi(self.B).to(dtype))
        packed = torch.cat([final, decay], dim=-1)                           # [b, d, 2n]
        return packed, (y0, cum_dt)

    def combine(self, state, packed):
        n = self.A.shape[-1]
        b = packed[..., :n]
        if state is None:
            return b
        return packed[..., n:] * state + b

    def finish(self, aux, state_in):
        y0, cum_dt = aux
        if state_in is None:
            return self._gate(y0)
        dtype = state_in.dtype
        corr = decayed_readout(cum_dt.to(dtype), hi(self.A).to(dtype), state_in, hi(self.C).to(dtype))
        return self._gate(y0 + corr.to(y0.dtype))

    def run(self, state_in):
        packed, aux = self.local_map()
        return self.finish(aux, state_in), self.combine(None if state_in is None else hi(state_in), packed)

    def sub(self, rows, start, stop):
        """The same scan over batch ``rows`` (None: all) and tokens ``[start, stop)``."""
        def cut(t):
            if t is None:
                return None
            t = t[..., start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return Mamba1Segment(self.kernel, cut(self.u), cut(self.delta), self.A, cut(self.B), cut(self.C), self.D,
                             cut(self.z), self.delta_bias, self.delta_softplus, self.kwargs)

    def with_tensors(self, fn):
        """The same scan over ``fn`` of each per-token input (``[b, d, l]``; documents.PiecesSegment), padded with
        a step of 0 (:func:`~.step_size.pad_step`) and zeros."""
        def each(t):
            return None if t is None else fn(t)
        return Mamba1Segment(self.kernel, fn(self.u), fn(self.delta, pad_step(self.delta_softplus)), self.A,
                             fn(self.B), fn(self.C), self.D, each(self.z), self.delta_bias, self.delta_softplus,
                             self.kwargs)

    @property
    def neutral_padding(self) -> bool:
        """The padding of :meth:`with_tensors` leaves any state as it is (:func:`~.step_size.step_pads_neutrally`)."""
        return step_pads_neutrally(self.delta_softplus, self.delta_bias)

    def packed_final(self, packed):
        """The final state of a zero incoming state, from a packed map ``[b | decay]``."""
        return packed[..., :self.A.shape[-1]]

    def state_map(self, final):
        """The packed map of a chunk the incoming state cannot cross (a document starts in it):
        decay 0, ``b = final``."""
        final = hi(final)
        return torch.cat([final, torch.zeros_like(final)], dim=-1)


def cp_selective_scan(kernel: Callable, ctx: LayerContext, hidden_states, dt, A, B, C, D=None, z=None,
                      delta_bias=None, delta_softplus=False, return_last_state=False, **kwargs):
    """``selective_scan_fn`` for this rank's shard ``[b, d, l]``, with the state of the earlier shards passed in."""
    batch = ctx.take_batch(kwargs)
    if ctx.probe is not None:   # wire's probe: this kernel is reached, and its incoming state matters
        seg = Mamba1Segment(kernel, hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, kwargs)
        ctx.probe.observe(seg, _per_channel(hidden_states, dt, B, C, z), hidden_states.transpose(1, 2),
                        hidden_states.shape[1], {2: (1, "B"), 3: (1, "C")})
        return probe_run(seg, ctx.probe.state("scan", *seg.state_meta()), ctx.path)[0]
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, u, dt_, b_, c_, z_: cp_selective_scan(
            kernel, ctx, u, dt_, A, b_, c_, D, z_, delta_bias, delta_softplus, return_last_state,
            **{**kwargs, BATCH_KWARG: part}), (hidden_states, dt, B, C, z), (-1,) * 5, -1)
    group, size, layout, strategy = ctx.resolve(batch)
    packed = getattr(batch, "doc_ids", None) is not None
    if size == 1 and not packed:
        return kernel(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                      return_last_state=return_last_state, **kwargs)
    check_call_kwargs(ctx.path, kwargs)
    if return_last_state:
        raise RuntimeError(f"{ctx.path}: a cache (final SSM state) is not supported under CP or with packed rows; "
                           "run the model with use_cache=False")
    if B.dim() != 3 or C.dim() != 3:
        raise NotImplementedError(f"{ctx.path}: selective scan with grouped B/C of shape {tuple(B.shape)}; ringmaster "
                                  "passes state for B, C of shape [batch, d_state, seq] only")
    if strategy == HEADS and size > 1:
        return heads_selective_scan(kernel, ctx.path, group, layout, batch, hidden_states, dt, A, B, C, D, z,
                                    delta_bias, delta_softplus, kwargs)
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=-1) for t in (hidden_states, dt, B, C)]
    gates = split_local(z, n, dim=-1) if z is not None else [None] * n
    segments = document_segments([Mamba1Segment(kernel, u, d, A, b, c, D, g, delta_bias, delta_softplus, kwargs)
                                  for u, d, b, c, g in zip(*parts, gates)], batch, ctx.path, size, rank, layout,
                                 (hidden_states.shape[0], hidden_states.shape[-1]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return outs[0] if n == 1 else torch.cat(outs, dim=-1)



def _per_channel(u, dt, B, C, z) -> list:
    """The selective scan's inputs in heads form: ``[b, l, d]`` (u, dt, z) and ``[b, l, 1, n]`` (B, C: one group)."""
    return [t.transpose(1, 2) for t in (u, dt)] + [t.transpose(1, 2)[:, :, None] for t in (B, C)] + (
        [] if z is None else [z.transpose(1, 2)])


def heads_selective_scan(kernel: Callable, path: str, group, layout: str, batch, u, dt, A, B, C, D, z, delta_bias,
                         delta_softplus, kwargs: dict):
    """``recurrent="heads"``: the selective scan over whole rows for this rank's channels (``[b, d, l]`` inputs;
    B / C, read by every channel, go whole to every rank); A, D and delta_bias sliced to those channels."""
    A, D, delta_bias = (local_heads(t, group) for t in (A, D, delta_bias))
    per_channel = _per_channel(u, dt, B, C, z)
    gated = z is not None

    def build(u_, dt_, B_, C_, *z_):
        return Mamba1Segment(kernel, u_.transpose(1, 2), dt_.transpose(1, 2), A, B_[:, :, 0].transpose(1, 2),
                             C_[:, :, 0].transpose(1, 2), D, z_[0].transpose(1, 2) if gated else None, delta_bias,
                             delta_softplus, kwargs)
    return run_heads(path, group, layout, batch, per_channel, build, u.shape[1], "channels",
                     shared={2: "B", 3: "C"}, token_dim=2)


def wire_mamba1_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one Mamba1 mixer instance through exact CP; returns the undo. ``names``: role -> the
    kernel name this layer calls (default :data:`KERNELS` and :data:`OPTIONAL`)."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    return wire_conv_scan_mixer(module, ctx, names, [names[r] for r in KERNELS], cp_selective_scan)


KIND = RecurrentKind(name="mamba1", kernels=KERNELS, optional=OPTIONAL, wire=wire_mamba1_layer, strategies=(HEADS,),
                     description="Mamba1 mixer: causal conv1d + selective scan (diagonal per-channel decay, "
                                 "state [d_inner, d_state])")
