"""Dynamic short convolutions under CP (Inkling2's full-attention layers: ``DynamicShortConvolution``).

The layer is a causal depthwise conv of ``K`` taps whose taps are per token: ``static_weight`` plus a
projection of the token's own ``dynamic_input``, shared within each k/v head. It computes them inline
(``unfold`` over ``[zeros | x]``): there is no kernel name to route, so this kind gives each instance
ringmaster's forward of the layer (an instance attribute, :func:`~.intercept.rebind_attributes`).

Its only state along the sequence is the last ``K - 1`` inputs, as for the static short conv: the forward
forms every token's window ``x[t - lag]`` (``lag < K``) with the same halo mechanism
(:func:`ringmaster.recurrent.conv.cp_conv_kernel`: the previous shard's tail, no tap across a document
start), by running the window extraction as a depthwise conv with one-hot taps over ``K`` copies of the
channels (exact: products with 1 and 0), then weights the windows by the per-token taps exactly as the
layer does. The halo is ``K`` times the static conv's (``K - 1`` columns of ``K · C`` channels: a few
columns, tiny next to attention).

``wire``'s probe: the layer's second input is ``dynamic_input`` (the layer input of its projection); the
probe forward passes only the conv input, so the probe call draws a seeded random ``dynamic_input``. Before
anything is wired, ringmaster's forward with a zero halo must equal the class forward on a random input
(:func:`check_same_as_class_forward`): a transformers release that changes the layer is refused.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..sharding.documents import BATCH_KWARG
from ..errors import UnsupportedLayerError
from .context import LayerContext, Probe
from .conv import cp_conv_kernel
from ..intercept import interceptable, rebind_attributes
from .heads import STRATEGY as HEADS
from .kind import RecurrentKind
from .short_conv import _call_guard

# role -> a name the class forward must use (checked statically): it computes its windows inline
KERNELS = {"conv": "unfold"}


def _depthwise(x, weight, bias=None, activation=None, **kwargs):
    """Causal depthwise conv1d (``weight [c, k]``, last tap on the current token), torch's own."""
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]


def lag_weights(channels: int, taps: int, dtype, device) -> torch.Tensor:
    """``[channels * taps, taps]``: row ``c * taps + lag`` picks the input ``lag`` steps back."""
    return torch.eye(taps, dtype=dtype, device=device).flip(-1).repeat(channels, 1)


def wire_dynamic_conv_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one dynamic short-conv instance through the CP conv halo; returns the undo."""
    names = {**KERNELS, **(names or {})}
    cls_forward = interceptable(module, ctx.path, list(names.values()))
    for attr in ("static_weight", "weight_proj", "num_heads", "conv_kernel_size"):
        if not hasattr(module, attr):
            raise ValueError(f"{ctx.path} ({type(module).__name__}) has no `{attr}` (another transformers version?); "
                             "ringmaster's forward of the dynamic short conv does not apply: use a CP size of 1")
    guard = _call_guard(ctx, cls_forward)
    windows_conv = cp_conv_kernel(ctx, {"conv": _depthwise}, "conv")
    check = _same_as_class_forward(module, ctx, cls_forward, windows_conv)

    def forward(hidden_states, dynamic_input=None, cache=None, conv_mask=None, cache_offset=0, **kwargs):
        guard((hidden_states, dynamic_input), {"cache": cache, "conv_mask": conv_mask, **kwargs})
        if kwargs.get("seq_idx") is not None:
            if ctx.size > 1:
                raise NotImplementedError(f"{ctx.path}: seq_idx reached the dynamic short conv under CP; pass packed "
                                          "rows through context_parallel_region / ContextParallelContextManager")
            return cls_forward(module, hidden_states, dynamic_input, cache=cache, conv_mask=conv_mask,
                               cache_offset=cache_offset, **kwargs)
        K, H = module.conv_kernel_size, module.num_heads
        B, L, C = hidden_states.shape
        if dynamic_input is None and ctx.probe is not None:   # wire's probe passes the conv input only
            g = torch.Generator().manual_seed(ctx.probe.seed)
            dynamic_input = torch.randn(B, L, module.weight_proj.in_features, generator=g, dtype=torch.float64
                                        ).to(hidden_states)
        input_dtype = hidden_states.dtype
        dynamic = module.weight_proj(dynamic_input).float().view(B, L, H, 1, K)
        weights = module.static_weight.float().T.view(H, -1, K) + dynamic
        hidden_states = hidden_states.float()
        residual = hidden_states
        if conv_mask is not None:   # the layer's padding mask (apply_mask_to_padding_states)
            hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
        context = hidden_states.transpose(1, 2)                                    # [B, C, L]
        batch = kwargs.get(BATCH_KWARG)
        lagged = windows_conv(context.repeat_interleave(K, dim=1), lag_weights(C, K, context.dtype, context.device),
                              **({BATCH_KWARG: batch} if batch is not None else {}))
        windows = lagged.view(B, C, K, L).permute(0, 3, 1, 2).reshape(B, L, H, -1, K)   # [..., lag]
        out = (windows * weights).sum(-1).reshape(B, L, C)
        return ((out + residual) / math.sqrt(2 * K + 1)).to(input_dtype)

    check(forward)
    return rebind_attributes(module, ctx.path, {"forward": forward, "_ringmaster_recurrent": ctx.path})


def _same_as_class_forward(module, ctx: LayerContext, cls_forward, windows_conv):
    """``check(forward)``: ringmaster's forward of this layer (zero halo: a probe call that injects no state)
    must compute what its class forward computes on a random input, or the layer is refused before it is
    wired (float64 rounding apart: the same operations in the same order)."""
    def check(forward) -> None:
        param = next(module.parameters(), None)
        if param is None or param.device.type == "meta" or type(param).__name__ == "DTensor":
            return
        g = torch.Generator().manual_seed(5)
        L, C, D = module.conv_kernel_size + 3, module.static_weight.shape[1], module.weight_proj.in_features
        x = torch.randn(1, L, C, generator=g, dtype=torch.float64).to(param)
        dyn = torch.randn(1, L, D, generator=g, dtype=torch.float64).to(param)
        saved, ctx.probe = ctx.probe, Probe(inject=set(), seed=0)
        try:
            with torch.no_grad():
                got = forward(x, dyn)
                want = cls_forward(module, x, dyn)
        finally:
            ctx.probe = saved
        err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)
        if not err <= 1e-6:
            raise UnsupportedLayerError(
                f"layer {ctx.path!r} ({type(module).__name__}): ringmaster's CP forward of the dynamic short conv "
                f"differs from the class forward by {err:.1e} on a random input; the installed transformers changed "
                "the layer, so CP would be silently wrong. Use a CP size of 1 for this model")
    return check


def probe_width(module, hidden):
    """The probe's input width: the conv's channels (the k/v projection's output)."""
    return module.static_weight.shape[1]


KIND = RecurrentKind(name="dynamic_short_conv", kernels=KERNELS, wire=wire_dynamic_conv_layer, probe_width=probe_width,
                     strategies=(HEADS,),   # the halo, as short_conv
                     description="short causal conv with per-token taps computed inline (Inkling2): conv halo")
