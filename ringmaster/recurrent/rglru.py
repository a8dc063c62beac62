"""Recurrent Gemma's recurrent block under CP (``RecurrentGemmaRecurrentBlock``: Griffin / Hawk).

The block runs a depthwise causal conv1d (``conv_1d``, width ``conv1d_width``) and then the RG-LRU,
a diagonal gated linear recurrence per channel::

    h_t = a_t ⊙ h_{t-1} + x̃_t        (a_t = σ-gated decay, 0 where position_ids == 0)

so a stretch of tokens maps its incoming state as ``h_end = (Π a_t) ⊙ h_start + b`` and every output
is affine in ``h_start``: ``h_t = h⁰_t + (Π_{s<=t} a_s) ⊙ h_start``. ``scan`` all-gathers the maps and
adds that correction; ``sequential`` reruns the layer's own scan from the incoming state. The decay
products are cumulative products (never divided), so a reset (``a = 0``) inside a chunk stops the
incoming state exactly.

transformers 5.24 calls both pieces as *methods* of submodules (``self.conv_1d(x)``,
``self.rg_lru._rnn_scan(...)``), not as module-level kernels, so the wired block instance gets
instance attributes that shadow them (:func:`~ringmaster.intercept.rebind_attributes`):
``conv_1d.forward`` (the module's own conv on ``[halo | shard]``,
:func:`~ringmaster.recurrent.conv.cp_causal_conv1d`) and ``rg_lru._rnn_scan`` (the layer's own scan
per chunk, with the state passed across ranks). The gates, the input normalisation and the reset at
``position_ids == 0`` stay the layer's own code, computed from the global position ids every shard
carries.

Packed or padded rows: conv taps never cross a document start and the scan restarts at every one
(:class:`~ringmaster.recurrent.documents.DocumentSegment`), as when each document runs alone.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .conv import conv_documents, cp_causal_conv1d, probe_conv
from .context import LayerContext
from ..sharding.documents import BATCH_KWARG
from .documents import by_parts, document_segments, recurrent_runs
from ..intercept import interceptable, rebind_attributes
from .heads import STRATEGY as HEADS, run_heads
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> the submodule attribute the block's forward calls (checked statically, then probed)
KERNELS = {"conv": "conv_1d", "scan": "rg_lru"}


class RglruSegment:
    """One chunk of ``_rnn_scan(hidden_states [b, l, w], recurrent_gate [b, l, w], reset [b, l, 1])``."""

    # the padding of with_tensors leaves any state as it is (documents.PiecesSegment)
    neutral_padding = True

    def __init__(self, kernel: Callable, x, a, reset):
        self.kernel, self.x, self.a, self.reset = kernel, x, a, reset

    def state_meta(self):
        b, _, w = self.x.shape
        return (b, w), state_dtype(self.x, self.a), self.x.device

    def run(self, state_in):
        return self.kernel(hidden_states=self.x, recurrent_gate=self.a, reset=self.reset, recurrent_states=state_in)

    def _decay(self, dtype):
        """``Π_{s<=t} a_s`` (0 from a reset on): ``[b, l, w]``."""
        return torch.cumprod(hi(self.a).to(dtype) * ~self.reset, dim=1)

    def map_meta(self):
        b, w = self.state_meta()[0]
        return (b, 2 * w)

    def local_map(self):
        y0, final = self.run(None)
        final = hi(final)
        decay = self._decay(final.dtype)
        return torch.cat([final, decay[:, -1]], dim=-1), (y0, decay)

    def combine(self, state, packed):
        w = self.x.shape[-1]
        if state is None:
            return packed[..., :w]
        return packed[..., w:] * state + packed[..., :w]

    def finish(self, aux, state_in):
        y0, decay = aux
        if state_in is None:
            return y0
        return y0 + (decay.to(state_in.dtype) * state_in[:, None]).to(y0.dtype)

    def sub(self, rows, start, stop):
        def cut(t):
            t = t[:, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return RglruSegment(self.kernel, cut(self.x), cut(self.a), cut(self.reset))

    def with_tensors(self, fn):
        """The same scan over ``fn`` of each per-token input (``[b, l, ...]``; documents.PiecesSegment), padded with
        ``a = 1, x = 0`` (no reset): ``h = 1 * h + 0``, any state as it is (:attr:`neutral_padding`)."""
        return RglruSegment(self.kernel, fn(self.x), fn(self.a, 1.0), fn(self.reset))

    def packed_final(self, packed):
        """The final state of a zero incoming state, from a packed map ``[b | decay]``."""
        return packed[..., :self.x.shape[-1]]

    def state_map(self, final):
        """A chunk the incoming state cannot cross (a document starts in it): decay 0, ``b = final``."""
        final = hi(final)
        return torch.cat([final, torch.zeros_like(final)], dim=-1)


def cp_rnn_scan(kernel: Callable, ctx: LayerContext, hidden_states, recurrent_gate, reset, recurrent_states=None,
                **kwargs):
    """``RecurrentGemmaRglru._rnn_scan`` for this rank's shard, with the earlier shards' state."""
    batch = ctx.take_batch(kwargs)
    if ctx.probe is not None:
        seg = RglruSegment(kernel, hidden_states, recurrent_gate, reset)
        ctx.probe.observe(seg, [hidden_states, recurrent_gate, reset.to(hidden_states.dtype)], hidden_states,
                        hidden_states.shape[-1], {2: (reset.shape[2], "reset flag")})
        return probe_run(seg, ctx.probe.state("scan", *seg.state_meta()), ctx.path)
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, x, a, r: cp_rnn_scan(kernel, ctx, x, a, r, recurrent_states,
                                                                 **{**kwargs, BATCH_KWARG: part}),
                        (hidden_states, recurrent_gate, reset), (1,) * 3, 1)
    group, size, layout, strategy = ctx.resolve(batch)
    packed = getattr(batch, "doc_ids", None) is not None
    if size == 1 and not packed:
        return kernel(hidden_states=hidden_states, recurrent_gate=recurrent_gate, reset=reset,
                      recurrent_states=recurrent_states, **kwargs)
    if recurrent_states is not None or hidden_states.shape[1] == 1 and size > 1:
        raise RuntimeError(f"{ctx.path}: a cache (the RG-LRU's recurrent state) is not supported under CP or with "
                           "packed rows; run the model with use_cache=False")
    reset = reset.expand(*hidden_states.shape[:2], 1) if reset.shape[0] != hidden_states.shape[0] else reset
    if strategy == HEADS and size > 1:   # whole rows for this rank's channels; the reset flags go to every rank
        flags = reset.dtype   # bool: sent as the activations' dtype, one all-to-all fewer
        return run_heads(ctx.path, group, layout, batch, [hidden_states, recurrent_gate, reset.to(hidden_states.dtype)],
                         lambda x, a, r: RglruSegment(kernel, x, a, r.to(flags)), hidden_states.shape[-1], "channels",
                         shared={2: "reset flag"}), None
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=1) for t in (hidden_states, recurrent_gate, reset)]
    segments = document_segments([RglruSegment(kernel, *chunk) for chunk in zip(*parts)], batch, ctx.path, size,
                                 rank, layout, tuple(hidden_states.shape[:2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    ys = [o[0] if isinstance(o, tuple) else o for o in outs]
    return (ys[0] if n == 1 else torch.cat(ys, dim=1)), None


def wire_rglru_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one recurrent block instance through exact CP; returns the undo."""
    names = {**KERNELS, **(names or {})}
    block_forward = interceptable(module, ctx.path, list(names.values()))
    conv, lru = getattr(module, names["conv"]), getattr(module, names["scan"])
    conv_forward, scan = type(conv).forward, type(lru)._rnn_scan

    def conv_kernel(x, weight=None, bias=None, activation=None, **kwargs):
        """The module's own conv, causal part only (the block slices ``[..., :seq_len]`` after it)."""
        return conv_forward(conv, x)[..., :x.shape[-1]]

    def run_conv(batch, x):
        if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, whole part
            return by_parts(batch, run_conv, (x,), (-1,), -1)
        group, size, layout, _ = ctx.resolve(batch)
        return cp_causal_conv1d(conv_kernel, x, conv.weight[:, 0, :], group=group if size > 1 else None,
                                layout=layout, docs=conv_documents(batch, ctx.path, size, x),
                                runs=recurrent_runs(batch), pieces=getattr(batch, "pieces", None))

    def cp_conv(x):
        batch = ctx.take_batch({})
        if ctx.probe is not None:
            return probe_conv(ctx, conv_kernel, x, conv.weight[:, 0, :])
        return run_conv(batch, x)

    def cp_scan(hidden_states, recurrent_gate, reset, recurrent_states=None, **kwargs):
        def kernel(**kw):
            return scan(lru, **kw)
        return cp_rnn_scan(kernel, ctx, hidden_states, recurrent_gate, reset, recurrent_states, **kwargs)

    def forward(*args, **kwargs):
        use_cache = kwargs.get("use_cache", args[3] if len(args) > 3 else True)
        if use_cache and ctx.size > 1:
            raise RuntimeError(f"{ctx.path}: the recurrent block was called with use_cache=True under CP (its conv "
                               "and RG-LRU caches would hold one shard's state); run the model with use_cache=False")
        return block_forward(module, *args, **kwargs)

    undos = [rebind_attributes(conv, ctx.path + "." + names["conv"], {"forward": cp_conv}),
             rebind_attributes(lru, ctx.path + "." + names["scan"], {"_rnn_scan": cp_scan}),
             rebind_attributes(module, ctx.path, {"forward": forward, "_ringmaster_recurrent": ctx.path})]

    def undo():
        for u in reversed(undos):
            u()
    return undo


def _probe_kwargs(x):
    # positions from 1: a continuation chunk (position 0 resets the RG-LRU, which would hide the state)
    return {"position_ids": torch.arange(1, x.shape[1] + 1, device=x.device)[None], "attention_mask": None,
            "use_cache": False}


KIND = RecurrentKind(name="rglru", kernels=KERNELS, wire=wire_rglru_layer, probe_kwargs=_probe_kwargs,
                     strategies=(HEADS,),
                     description="Griffin recurrent block: causal conv1d + RG-LRU (diagonal gated recurrence)")
