"""xLSTM's mLSTM (transformers 5.24 ``xLSTMLayer``) under CP: a gated linear recurrence with a
normaliser, kept stabilised.

Per head, with ``f_t = sigmoid(fgate_t)`` and ``q̃ = q / sqrt(d_k)``::

    C_t = f_t C_{t-1} + e^{i_t} k_t v_t^T,    n_t = f_t n_{t-1} + e^{i_t} k_t
    m_t = max(log f_t + m_{t-1}, i_t)          (m_0 = 0)
    h_t = (q̃·C'_t) / (max(|q̃·n'_t|, e^{-m_t}) + eps),    (C', n') = e^{-m_t} (C, n)

``(C, n)`` is a linear map of the incoming state: over ``L`` tokens ``(C, n)_end = e^G (C, n)_start + B``
(``G = Σ log f``). transformers keeps it stabilised as ``(C', n', m)``. Unlike RWKV's WKV the stabiliser
is *not* only a representation: the output's ``eps`` and its ``e^{-m}`` floor read ``m`` itself
(``h = q̃·C / (max(|q̃·n|, 1) + eps e^{m})``). But ``m`` is a max-plus linear recurrence, so it composes
exactly too: ``m_end = max(m_start + G, a)`` with ``a = max_s (i_s + Σ_{r>s} log f_r)`` the chunk's own
maximum (its ``m`` from an incoming ``m = -inf``). So a chunk's map is ``(C'_a, n'_a, a)`` (the chunk run
from a "no state" stabiliser, ``m = -1e38``: ``e^m = 0``) plus ``G``, and composing the prefix is the
log-sum-exp merge of RWKV (:mod:`.rwkv`) with the max taken on ``m`` itself: the composed state *is*
the state the kernel reaches token by token, stabiliser included, and its derivatives are the same
function's. The output is a ratio of affine functions of the incoming state (no additive correction),
so ``scan`` all-gathers the maps, composes the prefix and reruns each chunk from its composed state
(2x the kernel compute of ``sequential``, which passes ``(C', n', m)`` rank to rank).

The layer calls its kernels through a *module*, ``self.mlstm_backend(query, key, value, igate, fgate,
c_initial, n_initial, m_initial)`` (an ``xLSTMBackend``, whose kernels are picked by ``config.mode``:
the chunkwise kernel in ``train``, chunkwise + a token loop for the remainder in ``inference``). The
wired layer's backend instance gets an instance ``forward`` (:func:`~ringmaster.intercept.
rebind_attributes`): at CP size 1 on unpacked rows the original; otherwise each chunk runs the
backend's own forward in ``mode="inference"`` (the only mode that takes any length and returns the
final state) from its incoming state. Those are transformers' torch kernels ("native"); the external
``xlstm`` package's kernels (``is_xlstm_available()``) are a different layer class and are refused by
the class check. Not yet run on a GPU.

Packed or padded rows: the state restarts from transformers' zero state (``m = 0``) at every document
start (:class:`~ringmaster.recurrent.documents.DocumentSegment`), as when each document runs alone. Inside
a compiled block each chunk's documents run as one padded batch of pieces instead
(:class:`~ringmaster.recurrent.documents.PiecesSegment`). A padding token gets an input gate of ``-1e30``
(``e^i = 0``, below any real ``m``) and a forget gate of ``1e4`` (``log σ = 0`` exactly): ``(C, n, m)`` pass it
unchanged, bit for bit, whatever they are, and its own output is finite (the ``e^{-m}`` floor and ``eps``), so no
NaN reaches a gradient. (Zero gates move a general state, ``m -> max(m - log 2, 0)``, ``C -> C/2``, but happen to
keep transformers' zero start state, ``m = max(0 - log 2, 0) = 0``, the only state a right-aligned piece's leading
padding meets: measured exact with them too; the gates do not depend on that.) A piece that starts a document
is mapped from that zero state (``m = 0``), not from the "no state" ``m = -1e38`` a continuing chunk's map is
composed from (``starts``): the two differ wherever ``i_1 < log f_1``.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import UnsupportedLayerError
from .context import LayerContext
from .documents import by_parts, document_segments
from ..intercept import interceptable, rebind_attributes
from .heads import STRATEGY as HEADS, run_heads
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> the submodule attribute the layer's forward calls (checked statically, then probed)
KERNELS = {"scan": "mlstm_backend"}
_BACKEND_ARGS = ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial", "mode")

_NEG = -1e38   # "no state" stabiliser: e^m = 0
# neutral gates of a padding token (documents.PiecesSegment): e^{i} = 0 (any real m is far above -1e30; float16's
# lowest where that is lower) and log sigmoid(1e4) = 0 exactly, so (C, n, m) pass it unchanged, whatever they are,
# and its own output stays finite
PAD_IGATE, PAD_FGATE = -1e30, 1e4


def unpack(state: torch.Tensor, dk: int, dv: int):
    """``[b, h, dk*dv + dk + 1]`` -> ``(C' [b, h, dk, dv], n' [b, h, dk], m [b, h, 1])``."""
    c, n, m = state.split([dk * dv, dk, 1], dim=-1)
    return c.unflatten(-1, (dk, dv)), n, m


def pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.cat([hi(c).flatten(-2), hi(n), hi(m).reshape(*n.shape[:-1], 1)], dim=-1)


class MlstmSegment:
    """One chunk of ``kernel(q, k, v [b, h, l, d], igate, fgate [b, h, l], c, n, m) -> (h, (c, n, m))``;
    the state is the stabilised ``(C', n', m)`` packed on the last dim (:func:`pack`)."""

    seq_dim = 2
    # the neutral gates of with_tensors leave any state (C, n, m) as it is (documents.PiecesSegment)
    neutral_padding = True

    def __init__(self, kernel: Callable, q, k, v, igate, fgate, starts=None):
        self.kernel, self.q, self.k, self.v, self.igate, self.fgate = kernel, q, k, v, igate, fgate
        self.dk, self.dv = q.shape[-1], v.shape[-1]
        # [b] bool: the rows whose map starts a document (transformers' zero state, m = 0) rather than composing
        # an incoming state (m = -1e38); None: none (documents.PiecesSegment sets it)
        self.starts = starts

    def state_meta(self):
        b, h = self.q.shape[:2]
        return (b, h, self.dk * self.dv + self.dk + 1), state_dtype(self.q, self.k, self.v, self.fgate), self.q.device

    def run(self, state_in):
        c, n, m = (None, None, None) if state_in is None else unpack(state_in, self.dk, self.dv)
        out, (c, n, m) = self.kernel(self.q, self.k, self.v, self.igate, self.fgate, c, n, m)
        return out, pack(c, n, m)

    def map_meta(self):
        b, h, n = self.state_meta()[0]
        return (b, h, n + 1)

    def local_map(self):
        """``(C'_a, n'_a, a)``: the chunk from a zero state whose stabiliser is ``-1e38`` (so ``a`` is the
        chunk's own max-plus maximum), and ``G = Σ log f`` per head."""
        shape, dtype, device = self.state_meta()
        empty = torch.zeros(shape, dtype=dtype, device=device)
        if self.starts is None:
            empty[..., -1] = _NEG
        else:
            empty[..., -1] = torch.where(self.starts[:, None], 0.0, _NEG).to(dtype)
        _, final = self.run(empty)
        G = F.logsigmoid(hi(self.fgate).to(final.dtype)).sum(-1, keepdim=True)
        return torch.cat([final, G], dim=-1), None

    def combine(self, state, packed):
        """``state`` decayed by ``e^G`` plus the chunk's own part, merged on the stabiliser. ``state``
        None is transformers' zero state (``m = 0``), what the sequence starts from."""
        b, G = packed[..., :-1], packed[..., -1:]
        if state is None:
            state = torch.zeros_like(b)
        m_dec = state[..., -1:] + G
        m = torch.maximum(m_dec, b[..., -1:])
        body = torch.exp(m_dec - m) * state[..., :-1] + torch.exp(b[..., -1:] - m) * b[..., :-1]
        return torch.cat([body, m], dim=-1)

    def finish(self, aux, state_in):
        return self.run(state_in)[0]

    def sub(self, rows, start, stop):
        def cut(t):
            t = t[:, :, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return MlstmSegment(self.kernel, *(cut(t) for t in (self.q, self.k, self.v, self.igate, self.fgate)))

    def with_tensors(self, fn):
        """The same mLSTM over ``fn`` of each per-token input (``[b, h, l, ...]``; documents.PiecesSegment): padding
        with neutral gates (:data:`PAD_IGATE`, :data:`PAD_FGATE`), the padded rows that start a document
        (``fn.starts``) mapped from transformers' zero state."""
        low = max(PAD_IGATE, torch.finfo(self.igate.dtype).min)
        return MlstmSegment(self.kernel, fn(self.q), fn(self.k), fn(self.v), fn(self.igate, low),
                            fn(self.fgate, PAD_FGATE), starts=fn.starts)

    def packed_final(self, packed):
        """The final state of a chunk's map ``[final | G]``."""
        return packed[..., :-1]

    def state_map(self, final):
        """A chunk the incoming state cannot cross (a document starts in it): ``G = -1e38``, ``b = final``."""
        final = hi(final)
        return torch.cat([final, final.new_full((*final.shape[:-1], 1), _NEG)], dim=-1)


def cp_mlstm(kernel: Callable, ctx: LayerContext, q, k, v, igate, fgate, batch=None):
    """The mLSTM over this rank's shard, with the earlier shards' state: ``(h, None)``. ``batch``: the step's
    ``CPBatch`` (None: the step carrier's; the backend gets no kwargs), or one part of a documents batch."""
    batch = ctx.take_batch({}) if batch is None else batch
    if ctx.probe is not None:
        seg = MlstmSegment(kernel, q, k, v, igate, fgate)
        ctx.probe.observe(seg, [t.transpose(1, 2) for t in (q, k, v, igate, fgate)], v.transpose(1, 2), q.shape[1])
        injected = ctx.probe.state("scan", *seg.state_meta())
        return probe_run(seg, injected, ctx.path)[0], None
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, *t: cp_mlstm(kernel, ctx, *t, batch=part), (q, k, v, igate, fgate),
                        (2,) * 5, 2)
    group, size, layout, strategy = ctx.resolve(batch)
    if strategy == HEADS and size > 1:   # whole rows for this rank's heads ([b, h, l, ...] inputs)
        return run_heads(ctx.path, group, layout, batch, [t.transpose(1, 2) for t in (q, k, v, igate, fgate)],
                         lambda *t: MlstmSegment(kernel, *(x.transpose(1, 2) for x in t)), q.shape[1],
                         token_dim=2), None
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=2) for t in (q, k, v, igate, fgate)]
    segments = document_segments([MlstmSegment(kernel, *p) for p in zip(*parts)], batch, ctx.path, size, rank, layout,
                                 (q.shape[0], q.shape[2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    ys = [o[0] if isinstance(o, tuple) else o for o in outs]
    return (ys[0] if n == 1 else torch.cat(ys, dim=2)), None


def _state_refusal(ctx: LayerContext) -> RuntimeError:
    return RuntimeError(f"{ctx.path}: the mLSTM was called with an incoming state (an xLSTMCache, or xLSTMModel's "
                        "chunked inference of a shard longer than max_inference_chunksize) under CP or with packed "
                        "rows; run the model in training with use_cache=False")


def wire_mlstm_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one ``xLSTMLayer`` instance through exact CP (its backend's forward per chunk); returns the undo."""
    names = {**KERNELS, **(names or {})}
    layer_forward = interceptable(module, ctx.path, [names["scan"]])
    backend = getattr(module, names["scan"], None)
    if not isinstance(backend, torch.nn.Module):
        raise UnsupportedLayerError(f"layer {ctx.path!r} ({type(module).__name__}): {names['scan']!r} is not the "
                                    "mLSTM backend module transformers 5.24 calls; leave CP off for it")
    backend_forward = type(backend).forward
    params = inspect.signature(backend_forward).parameters
    missing = [a for a in _BACKEND_ARGS if a not in params]
    if missing:
        raise UnsupportedLayerError(
            f"layer {ctx.path!r}: its mLSTM backend {type(backend).__name__}.forward takes no {missing} (the initial "
            "state and mode ringmaster runs each chunk with); the installed transformers changed the layer. Use a "
            "CP size of 1")

    def kernel(q, k, v, igate, fgate, c, n, m):
        return backend_forward(backend, query=q, key=k, value=v, igate=igate, fgate=fgate, c_initial=c,
                               n_initial=n, m_initial=m, mode="inference")

    def forward(query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None,
                return_last_states=None, mode=None):
        if ctx.probe is None and ctx.size == 1 and getattr(ctx.carrier.current, "doc_ids", None) is None:
            return backend_forward(backend, query, key, value, igate, fgate, c_initial, n_initial, m_initial,
                                   return_last_states, mode)
        if c_initial is not None or n_initial is not None or m_initial is not None:
            raise _state_refusal(ctx)
        return cp_mlstm(kernel, ctx, query, key, value, igate, fgate)

    def guarded(*args, **kwargs):
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        if state is not None and ctx.size > 1:
            raise _state_refusal(ctx)
        return layer_forward(module, *args, **kwargs)

    undos = [rebind_attributes(backend, ctx.path + "." + names["scan"], {"forward": forward})]
    try:
        undos.append(rebind_attributes(module, ctx.path, {"forward": guarded, "_ringmaster_recurrent": ctx.path}))
    except BaseException:
        undos[0]()
        raise

    def undo():
        for u in reversed(undos):
            u()
    return undo


KIND = RecurrentKind(name="mlstm", kernels=KERNELS, wire=wire_mlstm_layer, strategies=(HEADS,),
                     description="xLSTM's mLSTM: matrix memory + normaliser with a max-plus stabiliser "
                                 "(stabilised state, log-sum-exp composition on m, chunks rerun)")
