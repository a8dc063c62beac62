"""The head split of each attention layer, read from the layer itself.

Ulysses needs to know, before any collective, how many query and KV heads an attention call
carries (each rank must hold whole KV heads; KV heads are replicated when there are fewer than
ranks), and the USP split rule caps the Ulysses degree by them. A model's config is not a
reliable source: gpt_bigcode's ``multi_query`` means one KV head whatever
``num_key_value_heads`` says, laguna has a head count per layer
(``num_attention_heads_per_layer``), mimo_v2_flash doubles the KV heads of its sliding layers,
jetmoe's mixture-of-attention tiles its KV heads ``top_k`` times before the call, deepseek_v4
shares one KV head. What every such layer does set is what HF's own kernels read:
``num_key_value_groups`` (eager's ``repeat_kv`` factor, so the call's KV heads are the query heads
divided by it) and, where the query heads differ from the config, ``num_heads``. So the query
heads are the layer's ``num_heads``, else the config's, else the ``q_proj`` width (not first: a
gated ``q_proj``, qwen3_next's, is twice the heads wide); the KV heads follow from the groups,
else from the layer's KV attribute, its ``k_proj`` width or the config.

The CP kernels themselves take the split from the tensors of each call (Ulysses and Ring read
``query.shape[1]`` / ``key.shape[1]``); this module is what ``rm.wire`` validates and sizes the
USP split with.
"""

from __future__ import annotations

from math import gcd

import torch.nn as nn

from ..errors import UnsupportedLayerError

_Q_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "kv_heads", "n_kv_heads")


def _int_attr(module, names) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _proj_heads(module, proj: str) -> int | None:
    linear, head_dim = getattr(module, proj, None), getattr(module, "head_dim", None)
    if isinstance(linear, nn.Linear) and isinstance(head_dim, int) and head_dim > 0 \
            and linear.out_features % head_dim == 0:
        return linear.out_features // head_dim
    return None


def head_split(path: str, module, config=None, heads_attr: str = "num_attention_heads",
               kv_attr: str = "num_key_value_heads") -> tuple[int, int] | None:
    """``(query heads, KV heads)`` of one attention call of ``module``; None when neither the layer
    nor ``config`` says. Raises when the layer's own numbers contradict each other."""
    q = _int_attr(module, _Q_ATTRS)
    if q is None and config is not None:  # before q_proj: a gated q_proj (qwen3_next) is twice the heads wide
        q = getattr(config, heads_attr, None) if isinstance(getattr(config, heads_attr, None), int) else None
    q = q or _proj_heads(module, "q_proj")
    if q is None:
        return None
    groups = _int_attr(module, ("num_key_value_groups",))
    if groups is not None:
        if q % groups:
            raise UnsupportedLayerError(
                f"layer {path!r} ({type(module).__name__}) has {q} query heads but num_key_value_groups={groups}, "
                "which does not divide them; ringmaster cannot tell its head split. Register the family with an "
                "ArchitectureSpec (rm.register_architecture) or use backend='ring'")
        return q, q // groups
    kv = _int_attr(module, _KV_ATTRS) or _proj_heads(module, "k_proj")
    if kv is None and config is not None:
        kv = getattr(config, kv_attr, None) if isinstance(getattr(config, kv_attr, None), int) else None
    return q, (kv or q)


def head_splits(model, paths, config=None, heads_attr: str = "num_attention_heads",
                kv_attr: str = "num_key_value_heads") -> dict[str, tuple[int, int]]:
    """``path -> (query heads, KV heads)`` for every attention layer in ``paths`` whose split is known."""
    modules = dict(model.named_modules())
    out = {}
    for path in paths:
        split = head_split(path, modules[path], config, heads_attr, kv_attr)
        if split is not None:
            out[path] = split
    return out


def common_split(splits: dict[str, tuple[int, int]]) -> tuple[int | None, int | None]:
    """The head counts every layer's split is a multiple of (gcd): a Ulysses degree that divides
    them divides every layer's heads, which is what the USP split rule needs."""
    if not splits:
        return None, None
    q = kv = 0
    for hq, hk in splits.values():
        q, kv = gcd(q, hq), gcd(kv, hk)
    return q, kv
