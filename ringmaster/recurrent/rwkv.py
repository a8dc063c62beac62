"""RWKV (v4) under CP: the WKV recurrence with its normaliser, and the token shifts.

**WKV.** Per channel, with ``w = -exp(time_decay)`` and ``u = time_first``::

    num_t = e^{w} num_{t-1} + e^{k_t} v_t,     den_t = e^{w} den_{t-1} + e^{k_t}
    out_t = (num_{t-1} + e^{u + k_t} v_t) / (den_{t-1} + e^{u + k_t})

The state ``(num, den)`` is a linear map of the incoming state: over ``L`` tokens
``(num, den)_end = e^{wL} (num, den)_start + b``. transformers keeps it *stabilised* as
``(num', den', m)`` with ``(num, den) = e^m (num', den')`` (a running max ``m`` so the exponentials
never overflow). That is a change of representation, not of the recurrence, so composition stays
exact: decaying a stabilised state is ``m += wL`` and adding two is a log-sum-exp merge
(``m = max(m1, m2)``, each part rescaled by ``e^{m_i - m}``), exactly what the kernel does token by
token. The gradient is exact too: the represented value does not depend on ``m`` (its derivative
with respect to the stabiliser is zero), so whichever branch ``max`` routes it through is right.
What the stabiliser does not allow is the additive output correction of the other kinds: each
output is a *ratio* of two affine functions of the incoming state. So ``scan`` all-gathers the
per-chunk maps (``b`` stabilised, ``wL`` per channel), composes the prefix with the merge above
and reruns the chunk's WKV from the composed state (2x the WKV compute of ``sequential``, which
passes the stabilised state rank to rank).

The layers call ``rwkv_linear_attention`` by module-level name; under CP (or packed rows) ringmaster
runs its torch loop ``rwkv_linear_attention_cpu`` for every chunk: transformers' CUDA WKV kernel
takes an incoming state but its backward returns no gradient for it, so the state passing would
train silently wrong through it (and the torch loop is slow on long shards: not yet run on a GPU).

**Token shift.** Both the time-mixing and the channel-mixing block mix each token with the one
before it (``time_shift``, a ``ZeroPad2d`` that shifts the sequence by one): a causal conv of width
2, so it gets a halo of one token from the previous shard (:func:`~ringmaster.recurrent.conv.
cp_causal_conv1d`, the module's own shift run on ``[halo | shard]``). Packed or padded rows: the
shift reads zero at every document start and the WKV state restarts there (from "no state"). Inside a compiled
block each chunk's documents run as one padded batch of pieces
(:class:`~ringmaster.recurrent.documents.PiecesSegment`): a zero key would add ``e^0 v`` to the state, so a
padding token's key is ``-1e30`` (:func:`pad_key`), neutral before a document's first token and behind its last,
and its decay is skipped (:func:`wkv_live`, ringmaster's copy of transformers' torch loop with a decay per token,
asked when wired whether it computes what that loop does), so any state crosses the padding as it is.

The blocks are called without any kwargs: the step context reaches the layers through the model's
step carrier (:mod:`ringmaster.sharding.carrier`), bound to each layer's ``LayerContext`` when wired.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import UnsupportedLayerError
from .conv import conv_documents, cp_causal_conv1d, probe_conv
from .context import LayerContext
from .documents import by_parts, document_segments, recurrent_runs
from ..intercept import interceptable, rebind_attributes, rebind_forward
from .heads import STRATEGY as HEADS, local_heads, run_heads
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# time mixing: the token shift lives in ``extract_key_value`` (called from forward), the WKV kernel is
# called by name; channel mixing: only the shift
KERNELS = {"conv": "extract_key_value", "scan": "rwkv_linear_attention"}
OPTIONAL = {"torch_scan": "rwkv_linear_attention_cpu"}
SHIFT_KERNELS = {"conv": "time_shift"}

_NEG = -1e38   # transformers' "no state" stabiliser (e^m = 0)
# the key of a padding token (documents.PiecesSegment): far below every real key, far above the "no state" -1e38
PAD_KEY = -1e30


def merge(a, b):
    """Two stabilised states ``(num, den, m)`` stacked on the last dim ``[..., 3]``: their sum."""
    m = torch.maximum(a[..., 2], b[..., 2])
    ea, eb = torch.exp(a[..., 2] - m), torch.exp(b[..., 2] - m)
    return torch.stack([ea * a[..., 0] + eb * b[..., 0], ea * a[..., 1] + eb * b[..., 1], m], dim=-1)


def wkv_live(time_decay, time_first, key, value, live, state=None):
    """transformers' ``rwkv_linear_attention_cpu`` with the decay of token ``t`` scaled by ``live [b, l]`` (1: a
    token, 0: padding): a padding token's key is :func:`pad_key`, so it adds nothing, and its decay is 0, so it leaves
    any state ``(num, den, max)`` exactly as it is (``max(m + 0, -1e30) = m``, ``e^0 = 1``). With every token live it
    is the same loop, operation for operation (``w · 1 = w``; :func:`same_as_torch_loop`). Returns
    ``(output, [num, den, max])``."""
    output = torch.zeros_like(key)
    if state is None:
        num = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den = torch.zeros_like(key[:, 0], dtype=torch.float32)
        m = torch.zeros_like(key[:, 0], dtype=torch.float32) + _NEG
    else:
        num, den, m = state
    w = -torch.exp(time_decay)
    for t in range(key.shape[1]):
        k, v = key[:, t].float(), value[:, t]
        m_out = torch.maximum(m, k + time_first)
        e1, e2 = torch.exp(m - m_out), torch.exp(k + time_first - m_out)
        output[:, t] = ((e1 * num + e2 * v) / (e1 * den + e2)).to(output.dtype)
        decayed = m + w * live[:, t, None]
        m_state = torch.maximum(decayed, k)
        e1, e2 = torch.exp(decayed - m_state), torch.exp(k - m_state)
        num, den, m = e1 * num + e2 * v, e1 * den + e2, m_state
    return output, [num, den, m]


def same_as_torch_loop(kernel: Callable) -> bool:
    """Whether :func:`wkv_live` with every token live computes what ``kernel`` (the module's own torch loop) computes,
    bit for bit, on a random input: only then may it run the padded pieces of a compiled block with their padding
    skipped (:attr:`WkvSegment.neutral_padding`); else those pieces run ``kernel`` itself, their padding decaying as
    any token, and a documents split part's lone piece fills its row (a graph per new length, not a wrong result)."""
    g = torch.Generator().manual_seed(5)
    decay, first, key, value = (torch.randn(*shape, generator=g) for shape in ((3,), (3,), (2, 5, 3), (2, 5, 3)))
    want, want_state = kernel(decay, first, key, value, return_state=True)
    got, got_state = wkv_live(decay, first, key, value, torch.ones(2, 5))
    return all(torch.equal(a, b) for a, b in zip([want, *want_state], [got, *got_state]))


class WkvSegment:
    """One chunk of ``rwkv_linear_attention_cpu(time_decay [c], time_first [c], key, value [b, l, c])``;
    the state ``[b, c, 3]`` is the stabilised ``(num, den, max)``. ``live [b, l]``: which tokens are not padding
    (None: all; then the module's own loop runs, else :func:`wkv_live`); ``live_ok``: :func:`wkv_live` computes what
    ``kernel`` does (:func:`same_as_torch_loop`, asked when wired), so padded pieces may skip their padding."""

    def __init__(self, kernel: Callable, time_decay, time_first, key, value, live=None, live_ok: bool = True):
        self.kernel, self.time_decay, self.time_first, self.key, self.value = kernel, time_decay, time_first, key, value
        self.live, self.live_ok = live, live_ok

    @property
    def neutral_padding(self) -> bool:
        """A padding token adds nothing (:func:`pad_key`) and, run by :func:`wkv_live`, decays nothing: any state
        passes a padded piece as it is (documents.PiecesSegment). Not where ``kernel`` is another loop."""
        return self.live_ok

    def state_meta(self):
        b, _, c = self.key.shape
        return (b, c, 3), state_dtype(self.key, self.value, self.time_decay), self.key.device

    def run(self, state_in):
        state = None if state_in is None else list(state_in.unbind(-1))
        if self.live is None:
            out, final = self.kernel(self.time_decay, self.time_first, self.key, self.value, state=state,
                                     return_state=True)
        else:
            out, final = wkv_live(self.time_decay, self.time_first, self.key, self.value, self.live, state)
        return out, torch.stack([hi(f) for f in final], dim=-1)

    def map_meta(self):
        b, c, _ = self.state_meta()[0]
        return (b, c, 4)

    def local_map(self):
        y0, final = self.run(None)
        tokens = self.key.shape[1] if self.live is None else self.live.to(final.dtype).sum(1, keepdim=True)
        log_decay = -torch.exp(hi(self.time_decay).to(final.dtype)) * tokens     # w·L per channel (L: not padding)
        return torch.cat([final, log_decay.expand(final.shape[0], -1)[..., None]], dim=-1), y0

    def combine(self, state, packed):
        b = packed[..., :3]
        if state is None:
            return b
        decayed = torch.stack([state[..., 0], state[..., 1], state[..., 2] + packed[..., 3]], dim=-1)
        return merge(decayed, b)

    def finish(self, y0, state_in):
        return y0 if state_in is None else self.run(state_in)[0]

    def sub(self, rows, start, stop):
        def cut(t):
            if t is None:
                return None
            t = t[:, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return WkvSegment(self.kernel, self.time_decay, self.time_first, cut(self.key), cut(self.value),
                          cut(self.live), self.live_ok)

    def with_tensors(self, fn):
        """The same WKV over ``fn`` of the keys and values (``[b, l, c]``; documents.PiecesSegment), padding with
        :func:`pad_key` and (``live_ok``) marked not ``live``."""
        live = self.live if self.live is not None else self.key.new_ones(self.key.shape[:2], dtype=torch.float32)
        return WkvSegment(self.kernel, self.time_decay, self.time_first, fn(self.key, pad_key(self.key.dtype)),
                          fn(self.value), fn(live) if self.live_ok else None, self.live_ok)

    def packed_final(self, packed):
        """The final state of a chunk's map ``[num, den, max | w·L]``."""
        return packed[..., :3]

    def start_state(self, like):
        """The state a document starts from (transformers' "no state" ``(0, 0, -1e38)``), shaped as ``like``."""
        return torch.cat([like.new_zeros(*like.shape[:-1], 2), like.new_full((*like.shape[:-1], 1), _NEG)], dim=-1)

    def state_map(self, final):
        """A chunk the incoming state cannot cross (a document starts in it): the incoming state decays
        by ``e^{-1e38}`` (= 0), ``b = final``."""
        final = hi(final)
        return torch.cat([final, final.new_full((*final.shape[:-1], 1), _NEG)], dim=-1)


def pad_key(dtype: torch.dtype) -> float:
    """The key of a padding token: :data:`PAD_KEY` (float16's lowest where it is lower; the kernel runs in fp32).
    From "no state" ``(0, 0, -1e38)`` it takes the output's max (``e^{k+u-max} = 1``), so its output is its value
    (finite: no 0/0 to put NaN in a gradient) and the state becomes ``(v, 1, -1e30)``, which still represents zero
    and weighs ``e^{-1e30 - k} = 0`` at the first real key: that token's output and state are those of "no state",
    bit for bit. Behind real keys it weighs ``e^{-1e30 - max} = 0`` (the first piece's trailing padding)."""
    return max(PAD_KEY, torch.finfo(dtype).min) if dtype.is_floating_point else PAD_KEY


def cp_wkv(kernel: Callable, ctx: LayerContext, time_decay, time_first, key, value, state=None, return_state=False,
           batch=None, live_ok: bool = True):
    """``rwkv_linear_attention`` for this rank's shard, with the earlier shards' state. ``batch``: the step's
    ``CPBatch`` (None: the step carrier's; the blocks get no kwargs), or one part of a documents batch; ``live_ok``:
    :func:`wkv_live` computes what ``kernel`` does (:attr:`WkvSegment.live_ok`)."""
    batch = ctx.take_batch({}) if batch is None else batch
    if ctx.probe is not None:
        seg = WkvSegment(kernel, time_decay, time_first, key, value, live_ok=live_ok)
        ctx.probe.observe(seg, [key, value], value, key.shape[-1])
        injected = ctx.probe.state("scan", *seg.state_meta())
        if injected is not None:   # a valid stabilised state: positive num/den scale, finite max
            injected = torch.stack([injected[..., 0], injected[..., 1].abs() + 1, injected[..., 2]], dim=-1)
        return probe_run(seg, injected, ctx.path)[0], None
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, k, v: cp_wkv(kernel, ctx, time_decay, time_first, k, v, state, return_state,
                                                         batch=part, live_ok=live_ok), (key, value), (1, 1), 1)
    group, size, layout, strategy = ctx.resolve(batch)
    if state is not None or return_state:
        raise RuntimeError(f"{ctx.path}: a cache (the WKV state) is not supported under CP or with packed rows; "
                           "run the model with use_cache=False")
    if strategy == HEADS and size > 1:   # whole rows for this rank's channels, and their decay / bonus
        decay, first = local_heads(time_decay, group), local_heads(time_first, group)
        return run_heads(ctx.path, group, layout, batch, [key, value],
                         lambda k, v: WkvSegment(kernel, decay, first, k, v, live_ok=live_ok), key.shape[-1],
                         "channels"), None
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=1) for t in (key, value)]
    segments = document_segments([WkvSegment(kernel, time_decay, time_first, k, v, live_ok=live_ok)
                                  for k, v in zip(*parts)], batch,
                                 ctx.path, size, rank, layout, tuple(key.shape[:2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    ys = [o[0] if isinstance(o, tuple) else o for o in outs]
    return (ys[0] if n == 1 else torch.cat(ys, dim=1)), None


def _shift(ctx: LayerContext, pad) -> Callable:
    """``time_shift(hidden [b, l, c])`` for this rank's shard: the module's own shift on ``[halo | shard]``."""
    pad_forward = type(pad).forward

    def kernel(x, weight=None, bias=None, activation=None, **kwargs):      # [b, c, l] -> shifted by one
        return pad_forward(pad, x.transpose(1, 2)).transpose(1, 2)

    def run(batch, hidden):
        if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, whole part
            return by_parts(batch, run, (hidden,), (1,), 1)
        x = hidden.transpose(1, 2)
        weight = x.new_zeros(x.shape[1], 2)          # width 2: a halo of one token (the taps are the shift's)
        group, size, layout, _ = ctx.resolve(batch)
        docs = conv_documents(batch, ctx.path, size, x)
        if size == 1 and docs is None:
            return pad_forward(pad, hidden)
        return cp_causal_conv1d(kernel, x, weight, group=group if size > 1 else None, layout=layout,
                                docs=docs, runs=recurrent_runs(batch),
                                pieces=getattr(batch, "pieces", None)).transpose(1, 2)

    def shift(hidden):
        batch = ctx.take_batch({})
        if ctx.probe is not None:
            x = hidden.transpose(1, 2)
            return probe_conv(ctx, kernel, x, x.new_zeros(x.shape[1], 2)).transpose(1, 2)
        return run(batch, hidden)
    return shift


def _check_shift(module, path: str) -> None:
    pad = getattr(module, "time_shift", None)
    if not isinstance(pad, torch.nn.ZeroPad2d) or tuple(pad.padding) != (0, 0, 1, -1):
        raise UnsupportedLayerError(
            f"layer {path!r} ({type(module).__name__}): its time_shift is not the one-token ZeroPad2d((0, 0, 1, -1)) "
            "transformers 5.24 uses; ringmaster cannot give it the previous shard's token. Use a CP size of 1")


def _guard(ctx: LayerContext) -> Callable:
    def guard(args, kwargs):
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        if state is not None and ctx.size > 1:
            raise RuntimeError(f"{ctx.path}: the model was called with an RWKV state under CP; "
                               "run it with use_cache=False in training")
        _meet_pieces(ctx.carrier.current)
    return guard


def _meet_pieces(batch) -> None:
    """Read the batch's chunk pieces here, in the block's own (time- or channel-mixing) forward, before its token
    shift does: a compiled block keeps the sizes of a tensor it first reaches through a torch.nn module of its own
    (``time_shift``, a ``ZeroPad2d`` whose forward ringmaster shadows) static, so the pieces' dynamic count and
    length (``ChunkPieces.sizes``) would specialise the block on every new pair."""
    for p in getattr(batch, "pieces", None) or ():
        p.sizes, p.groups, p.index, p.group, p.first, p.last, p.keep, p.whole    # noqa: B018 (the read is the point)


def wire_rwkv_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one RWKV time-mixing block through exact CP (token shift halo + WKV state); returns the undo."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    _check_shift(module, ctx.path)
    forward = interceptable(module, ctx.path, [names["conv"], names["scan"]])
    namespace = inspect.unwrap(forward).__globals__
    if names["torch_scan"] not in namespace:
        raise UnsupportedLayerError(f"layer {ctx.path!r}: its module has no {names['torch_scan']!r} (the torch WKV "
                                    "loop ringmaster runs under CP); the installed transformers changed the layer")
    live_ok = same_as_torch_loop(namespace[names["torch_scan"]])

    def wkv(time_decay, time_first, key, value, state=None, return_state=False):
        batch = ctx.carrier.current
        if ctx.probe is None and ctx.size == 1 and getattr(batch, "doc_ids", None) is None:
            return namespace[names["scan"]](time_decay, time_first, key, value, state=state,
                                            return_state=return_state)
        return cp_wkv(namespace[names["torch_scan"]], ctx, time_decay, time_first, key, value, state, return_state,
                      live_ok=live_ok)

    undo_shift = rebind_attributes(module.time_shift, ctx.path + ".time_shift", {"forward": _shift(ctx, module.time_shift)})
    try:
        undo_forward = rebind_forward(module, ctx.path, {names["scan"]: wkv}, [names["scan"]], guard=_guard(ctx))
    except BaseException:
        undo_shift()
        raise

    def undo():
        undo_forward()
        undo_shift()
    return undo


def wire_rwkv_channel_mix(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one RWKV channel-mixing block (a token shift, then per-token MLP) through CP: the shift's halo."""
    names = {**SHIFT_KERNELS, **(names or {})}
    _check_shift(module, ctx.path)
    forward = interceptable(module, ctx.path, [names["conv"]])
    guard = _guard(ctx)

    def guarded(*args, **kwargs):
        guard(args, kwargs)
        return forward(module, *args, **kwargs)

    undos = [rebind_attributes(module.time_shift, ctx.path + ".time_shift", {"forward": _shift(ctx, module.time_shift)}),
             rebind_attributes(module, ctx.path, {"forward": guarded, "_ringmaster_recurrent": ctx.path})]

    def undo():
        for u in reversed(undos):
            u()
    return undo


KIND = RecurrentKind(name="rwkv", kernels=KERNELS, optional=OPTIONAL, wire=wire_rwkv_layer, strategies=(HEADS,),
                     description="RWKV time mixing: token shift (halo of one token) + WKV with its normaliser "
                                 "(stabilised state, log-sum-exp composition)")
CHANNEL_MIX = RecurrentKind(name="rwkv_channel_mix", kernels=SHIFT_KERNELS, wire=wire_rwkv_channel_mix,
                            strategies=(HEADS,),   # the one-token halo under every strategy
                            description="RWKV channel mixing: token shift (halo of one token), then per-token MLP")
