"""Short convolutions under CP (LFM2, LFM2-MoE, LFM3; the static short convolutions of Inkling).

A short convolution is a causal depthwise conv1d over the sequence with a few taps (LFM2: 3,
LFM3: 7), gated around it (LFM: ``y = C · conv(B · x)``) or added back (Inkling: ``x + conv(x)``
on the k/v projections and the residual stream). Its only state along the sequence is the last
``kernel_size - 1`` conv inputs, so a shard needs exactly the halo of the shard before it: the
same mechanism as the Mamba conv (:func:`ringmaster.recurrent.conv.cp_causal_conv1d`: one small
all-gather of every chunk's tail, its backward a reduce-scatter; ``head_tail`` layouts take
each chunk's halo from the chunk before it in sequence order). There is no scan, so the
``recurrent`` strategy does not apply: under ``recurrent="heads"`` too a short conv takes the halo (``K - 1``
tokens a shard, where slicing it by channel would move its whole input and output through two all-to-alls).

Packed or padded rows: no tap reaches across a document start (global document ids from the
``ringmaster_batch`` kwarg, or from the model's step carrier when the layer is called
without kwargs, as Inkling's are); zero columns are inserted before every start so the model's
own kernel computes every document as if it ran alone.

The layers call ``causal_conv1d_fn`` by module-level name from ``forward``; a layer instance gets
a copy of its forward in which that name resolves to the CP conv (:mod:`.intercept`). A short
conv whose taps are computed inline (Inkling2's ``DynamicShortConvolution``: per-token taps,
``unfold`` instead of a kernel) has no name to route: it is its own kind (:mod:`.dynamic_conv`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn as nn

from .context import LayerContext, decode_only_without_cp
from .conv import cp_conv_kernel
from ..intercept import rebind_forward
from .heads import STRATEGY as HEADS
from .kind import RecurrentKind

# role -> the module-level name transformers' short-conv layers call (a family spec may rename them)
KERNELS = {"conv": "causal_conv1d_fn"}
OPTIONAL = {"conv_update": "causal_conv1d_update"}


def _call_guard(ctx: LayerContext, forward: Callable) -> Callable[[tuple, dict], None]:
    """Before every call: no cache under CP, and a padding mask (``attention_mask`` or Inkling's
    ``conv_mask``) cut like the shard. Arguments are bound by the layer's own signature (Inkling2's
    short conv takes ``dynamic_input`` second, where other layers take the cache)."""
    params = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[1:]   # after self
    # the names positional arguments bind to, read once here: torch.compile traces this guard (Signature.bind
    # reads a mapping proxy dynamo cannot follow)
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    def guard(args: tuple, kwargs: dict) -> None:
        if len(args) > len(positional):
            return   # the layer's own forward raises the argument error
        bound = {**dict(zip(positional, args)), **kwargs}
        extra = {}
        cache = next((v for k in ("cache", "cache_params", "past_key_values")
                      for v in (bound.get(k), extra.get(k)) if v is not None), None)
        if cache is not None and ctx.size > 1:
            raise RuntimeError(f"{ctx.path}: the model was called with a cache under CP; "
                               "run it with use_cache=False in training")
        hidden = bound.get("hidden_states")
        for key in ("attention_mask", "conv_mask"):
            mask = bound.get(key)
            if isinstance(mask, torch.Tensor) and isinstance(hidden, torch.Tensor) and mask.dim() == 2 \
                    and mask.shape[-1] != hidden.shape[1]:
                raise ValueError(f"{ctx.path}: the padding mask ({key}) has {mask.shape[-1]} positions but the "
                                 f"shard has {hidden.shape[1]}; shard the attention_mask with the batch")
    return guard


def wire_short_conv_layer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one short-conv layer instance through the CP conv halo; returns the undo. ``names``:
    role -> the kernel name this layer calls (default :data:`KERNELS` and :data:`OPTIONAL`)."""
    names = {**KERNELS, **OPTIONAL, **(names or {})}
    forward = type(module).forward
    namespace = inspect.unwrap(forward).__globals__
    replacements: dict[str, Any] = {
        names["conv"]: cp_conv_kernel(ctx, namespace, names["conv"]),
        names["conv_update"]: decode_only_without_cp(ctx, namespace, names["conv_update"]),
    }
    return rebind_forward(module, ctx.path, replacements, [names["conv"]], guard=_call_guard(ctx, forward))


def probe_width(module, hidden: int | None) -> int | None:
    """The width of the layer's input for ``wire``'s probe: the conv's channels when the conv sees
    the layer input as is (Inkling's k/v short convs are narrower than the hidden size), else
    ``hidden`` (LFM's projects ``hidden`` to ``3 · hidden`` before its conv)."""
    conv = next((m for m in module.children() if isinstance(m, nn.Conv1d)), None)
    if conv is None or any(isinstance(m, nn.Linear) for m in module.children()):
        return hidden
    return conv.in_channels


KIND = RecurrentKind(name="short_conv", kernels=KERNELS, optional=OPTIONAL, wire=wire_short_conv_layer,
                     probe_width=probe_width, strategies=(HEADS,),
                     description="short causal depthwise conv1d (LFM, Inkling): the halo of the previous shard")
