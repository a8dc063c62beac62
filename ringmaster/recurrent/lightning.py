"""MiniMax lightning attention under CP (``MiniMaxLightningAttention``): linear attention with a
scalar decay per head.

Per head ``h`` with ``λ = exp(-slope_h)`` the layer computes, token by token::

    S_t = λ · S_{t-1} + k_tᵀ v_t          (state [d, d] per head)
    o_t = q_t · S_t

so a stretch of ``L`` tokens maps its incoming state as ``S_end = λ^L · S_start + b`` (``b``: the
final state from zero) and every output is affine in ``S_start``:
``o_t = o⁰_t + λ^{t+1} · q_t · S_start`` (``t`` counted from the stretch's first token). ``scan``
all-gathers the maps and adds that correction (no second pass); ``sequential`` reruns the blocks
from the incoming state. Decays are only multiplied (``exp(-slope · n)``), never divided.

Why ringmaster computes the layer itself: transformers 5.24 writes the block loop inline in
``forward`` (no module-level kernel to re-bind; the only state entry is the decoding cache, whose
path runs one token at a time). The wired instance gets a forward of its own built from the
layer's own projections, norm, gate and ``slope_rate`` buffer, the block loop written out exactly
as transformers does it (intra-block ``(QKᵀ ⊙ decay) V`` plus inter-block ``(Q ⊙ decay) S``) with
an incoming state. ``wire`` first checks, on a random input spanning more than one block, that this
forward equals the class forward (the same parameters, the same dtype): a transformers release that
changes the layer fails closed here, naming it. At CP size 1 without packed rows (and for cached
decoding) the class forward runs unchanged.

Packed or padded rows: the state resets at every document start
(:class:`~ringmaster.recurrent.documents.DocumentSegment`); padding is zeroed in q/k/v by the
layer's own ``apply_mask_to_padding_states`` as without CP. Inside a compiled block each chunk's documents run as
one padded batch of pieces (:class:`~ringmaster.recurrent.documents.PiecesSegment`): the pieces' padding is marked
not ``live`` (:func:`lightning_blocks`), so it decays nothing and any state crosses it as it is (a documents shard's
split part may then be padded to a power of two after a piece the state passes on).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import UnsupportedLayerError
from .context import LayerContext, check_call_kwargs
from .documents import by_parts, document_segments
from ..intercept import interceptable, rebind_attributes
from .heads import STRATEGY as HEADS, local_heads, run_heads
from .kind import RecurrentKind
from .scan import chunk_ids, hi, pass_state, probe_run, simulate_sequential, split_local, state_dtype

# role -> a name the class forward must read (checked statically): the per-head decay buffer, which
# ringmaster's forward reads too. The real check is numerical (:func:`check_same_as_class_forward`).
KERNELS = {"scan": "slope_rate"}
OPTIONAL = {"padding": "apply_mask_to_padding_states"}


def lightning_blocks(q, k, v, slope, block_size: int, initial_state=None, live=None):
    """transformers' block loop with an incoming state. ``q, k, v [B, L, H, D]``, ``slope [H, 1, 1]``,
    ``initial_state [B, H, D, D]`` (None: zeros). Returns ``(out [B, L, H, D], final state)``.

    ``live [B, L]`` (1: a token, 0: padding; None: every token): a padding token decays nothing, so the decay
    between two tokens counts the tokens between them (``λ^{c_i - c_j}``, ``c`` the running count of ``live``)
    and padding anywhere leaves any state as it is (its ``k, v`` are zeros: :attr:`LightningSegment.neutral_padding`).
    Without it the loop is transformers' own, operation for operation (:func:`check_same_as_class_forward`)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                       # [B, H, L, D]
    B, H, L, D = q.shape
    state = (torch.zeros(B, H, D, v.shape[-1], dtype=v.dtype, device=v.device) if initial_state is None
             else initial_state.to(v.dtype))
    slope = slope.to(v.dtype)
    outs = []
    for start in range(0, L, block_size):
        stop = min(start + block_size, L)
        n = stop - start
        qb, kb, vb = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        idx = torch.arange(1, n + 1, device=v.device, dtype=v.dtype)
        if live is None:
            q_decay = torch.exp(-slope * idx[:, None])                      # [H, n, 1]
            k_decay = torch.exp(-slope * (n - idx)[:, None])
            diff = slope * (idx[:, None] - idx[None, :])[None]               # [H, n, n]
            diag = torch.exp(torch.where(diff >= 0, -diff, float("-inf")))
            block_decay = torch.exp(-slope * n)
        else:   # the same with the running count of live tokens for the positions: [B, H, n, ...]
            # counted in float32 (a bfloat16 sum of ones stops at 256), then rounded as transformers' arange
            c = live[:, start:stop].float().cumsum(1).to(v.dtype)[:, None, :, None]   # [B, 1, n, 1]
            total = c[:, :, -1:]                                               # [B, 1, 1, 1]
            q_decay = torch.exp(-slope * c)
            k_decay = torch.exp(-slope * (total - c))
            diff = slope * (c - c.transpose(-1, -2))                           # [B, H, n, n]
            causal = idx[:, None] >= idx[None, :]
            diag = torch.exp(torch.where(causal, -diff, float("-inf")))
            block_decay = torch.exp(-slope * total)
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diag, vb)
        inter = torch.matmul(qb * q_decay, state)
        outs.append(inter + intra)
        state = state * block_decay + torch.matmul((kb * k_decay).transpose(-1, -2), vb)
    return torch.cat(outs, dim=2).transpose(1, 2), state


class LightningSegment:
    """One chunk of lightning attention (``q, k, v [B, l, H, D]``, ``slope [H, 1, 1]``; ``live [B, l]``: which
    tokens are not padding, None: all)."""

    # padding decays nothing (``live``: :func:`lightning_blocks`) and adds nothing (zero k, v): any state passes a
    # padded piece as it is (documents.PiecesSegment)
    neutral_padding = True

    def __init__(self, q, k, v, slope, block_size: int, live=None):
        self.q, self.k, self.v, self.slope, self.block_size, self.live = q, k, v, slope, block_size, live

    def state_meta(self):
        B, _, H, D = self.q.shape
        return (B, H, D, self.v.shape[-1]), state_dtype(self.q, self.v), self.v.device

    def run(self, state_in):
        return lightning_blocks(self.q, self.k, self.v, self.slope, self.block_size, state_in, self.live)

    def _log_decay(self, dtype):
        """``-slope · c_t`` for every token of the chunk, ``c_t`` the tokens up to ``t`` that are not padding:
        ``[1, l, H]`` (``[B, l, H]`` with padding)."""
        l = self.q.shape[1]
        t = (torch.arange(1, l + 1, device=self.q.device, dtype=dtype)[None] if self.live is None
             else self.live.float().cumsum(1).to(dtype))
        return -self.slope.to(dtype).reshape(1, 1, -1) * t[..., None]

    def map_meta(self):
        B, H, D, Dv = self.state_meta()[0]
        return (B, H, D * Dv + 1)

    def local_map(self):
        y0, final = self.run(None)
        final = hi(final)
        decay = self._log_decay(final.dtype)[:, -1].exp()                    # λ^l per head: [1 or B, H]
        B = final.shape[0]
        packed = torch.cat([final.flatten(2), decay.expand(B, -1)[..., None]], dim=-1)
        return packed, y0

    def combine(self, state, packed):
        b = packed[..., :-1].reshape(self.state_meta()[0])
        if state is None:
            return b
        return packed[..., -1][..., None, None] * state + b

    def finish(self, y0, state_in):
        if state_in is None:
            return y0
        decay = self._log_decay(state_in.dtype).exp()                        # [1 or B, l, H]
        corr = torch.einsum("blhd,bhde->blhe", hi(self.q).to(state_in.dtype), state_in) * decay[..., None]
        return y0 + corr.to(y0.dtype)

    def sub(self, rows, start, stop):
        def cut(t):
            if t is None:
                return None
            t = t[:, start:stop]
            return t if rows is None else t.index_select(0, torch.tensor(rows, device=t.device))
        return LightningSegment(cut(self.q), cut(self.k), cut(self.v), self.slope, self.block_size, cut(self.live))

    def with_tensors(self, fn):
        """The same attention over ``fn`` of each per-token input (``[B, l, ...]``; documents.PiecesSegment), its
        padding marked not ``live`` (zeros where ``fn`` pads)."""
        live = self.live if self.live is not None else self.q.new_ones(self.q.shape[:2])
        return LightningSegment(fn(self.q), fn(self.k), fn(self.v), self.slope, self.block_size, fn(live))

    def packed_final(self, packed):
        """The final state of a zero incoming state, from a packed map ``[b | decay]``."""
        return packed[..., :-1].reshape(packed.shape[0], *self.state_meta()[0][1:])

    def state_map(self, final):
        """A chunk the incoming state cannot cross (a document starts in it): decay 0, ``b = final``."""
        final = hi(final)
        return torch.cat([final.flatten(2), final.new_zeros(*final.shape[:2], 1)], dim=-1)


def cp_lightning(ctx: LayerContext, batch, q, k, v, slope, block_size: int):
    """The attention core of this rank's shard (``[B, l, H, D]``) with the earlier shards' state."""
    if ctx.probe is not None:   # wire's probe: the core is reached, and its incoming state matters
        seg = LightningSegment(q, k, v, slope, block_size)
        ctx.probe.observe(seg, [q, k, v], v, q.shape[2])
        return probe_run(seg, ctx.probe.state("scan", *seg.state_meta()), ctx.path)[0]
    if getattr(batch, "assignment", None) is not None:   # load_balance="documents": split part, then whole part
        return by_parts(batch, lambda part, q_, k_, v_: cp_lightning(ctx, part, q_, k_, v_, slope, block_size),
                        (q, k, v), (1,) * 3, 1)
    group, size, layout, strategy = ctx.resolve(batch)
    if strategy == HEADS and size > 1:   # whole rows for this rank's heads, and their slopes
        slope = local_heads(slope, group)
        return run_heads(ctx.path, group, layout, batch, [q, k, v],
                         lambda *t: LightningSegment(*t, slope, block_size), q.shape[2])
    n = len(chunk_ids(layout, size, 0)) if size > 1 else 1
    rank = dist.get_rank(group) if size > 1 else 0
    parts = [split_local(t, n, dim=1) for t in (q, k, v)]
    segments = document_segments([LightningSegment(*chunk, slope, block_size) for chunk in zip(*parts)], batch,
                                 ctx.path, size, rank, layout, tuple(q.shape[:2]))
    outs = pass_state(segments, strategy, group, layout, ctx.path) if size > 1 else simulate_sequential(segments)
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return outs[0] if n == 1 else torch.cat(outs, dim=1)


def lightning_forward(module, core: Callable, padding: Callable, hidden_states, attention_mask):
    """``MiniMaxLightningAttention.forward`` (transformers 5.24) with the block loop replaced by
    ``core(q, k, v, slope, block_size)`` on ``[B, L, H, D]`` tensors."""
    B, L, _ = hidden_states.shape
    H, D = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    qkv = padding(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(B, L, H, 3 * D), D, dim=3)
    out = core(q, k, v, module.slope_rate, module.block_size).reshape(B, L, H * D)
    out = module.norm(out)
    out = F.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


def check_same_as_class_forward(module, path: str, padding: Callable) -> None:
    """ringmaster's forward of this layer must compute what its class forward computes (zero incoming
    state, one row over more than one block), or the layer is refused before anything is wired."""
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta" or type(param).__name__ == "DTensor":
        return
    hidden = module.qkv_proj.in_features
    L = module.block_size + 3
    x = torch.randn(1, L, hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = x.to(device=param.device, dtype=param.dtype)
    with torch.no_grad():
        want = type(module).forward(module, x, None, None)[0]
        got = lightning_forward(module, lambda *a: lightning_blocks(*a)[0], padding, x, None)[0]
    # the class forward reads decay buffers computed in float32 at init (cast with the model): a float64
    # layer agrees to ~1e-8, not to float64 rounding
    tol = {torch.float64: 1e-6, torch.float32: 1e-4}.get(param.dtype, 3e-2)
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    if not err <= tol:
        raise UnsupportedLayerError(
            f"layer {path!r} ({type(module).__name__}): ringmaster's CP forward of lightning attention differs from "
            f"the class forward by {err:.1e} (tolerance {tol:g}) on a random input; the installed transformers "
            "changed the layer, so CP would be silently wrong. Use a CP size of 1 for this model")


def wire_lightning_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one lightning-attention instance through exact CP; returns the undo."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    class_forward = interceptable(module, ctx.path, [names["scan"]])
    namespace = inspect.unwrap(class_forward).__globals__
    if names["padding"] not in namespace:
        raise UnsupportedLayerError(f"layer {ctx.path!r} ({type(module).__name__}): its module has no "
                                    f"{names['padding']!r}; the installed transformers changed the layer")
    padding = namespace[names["padding"]]
    check_same_as_class_forward(module, ctx.path, padding)

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        batch = ctx.take_batch(kwargs)
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        packed = getattr(batch, "doc_ids", None) is not None
        if ctx.probe is None and ctx.size == 1 and not packed:
            return class_forward(module, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        if cache is not None:
            raise RuntimeError(f"{ctx.path}: a cache (lightning attention's recurrent state) is not supported under "
                               "CP or with packed rows; run the model with use_cache=False")
        if ctx.size > 1:
            check_call_kwargs(ctx.path, kwargs)

        def core(q, k, v, slope, block_size):
            return cp_lightning(ctx, batch, q, k, v, slope, block_size)

        return lightning_forward(module, core, padding, hidden_states, attention_mask)

    undo = rebind_attributes(module, ctx.path, {"forward": forward, "_ringmaster_recurrent": ctx.path})
    return undo


def _probe_kwargs(x):
    return {"position_embeddings": None, "attention_mask": None}


KIND = RecurrentKind(name="lightning", kernels=KERNELS, optional=OPTIONAL, wire=wire_lightning_layer,
                     probe_kwargs=_probe_kwargs, strategies=(HEADS,),
                     description="MiniMax lightning attention: linear attention with a scalar decay per head "
                                 "(ringmaster's own forward of the layer, checked against the class forward)")
