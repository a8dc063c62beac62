"""Ring attention behind transformers' attention interface."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...sharding import balancers
from ..binding import AttentionBinding
from . import distflash
from .loop import RingPlan, ring_attention


def module_sinks(module, kwargs):
    """gpt-oss style sinks ``[Hq]``: the ``s_aux`` kwarg or the module's ``sinks`` parameter."""
    sinks = kwargs.get("s_aux")
    if not isinstance(sinks, torch.Tensor):
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def ring_core(binding: AttentionBinding, cpb, module, query, key, value, group, layout: str, kwargs, sinks):
    """Ring attention over ``group`` for q ``[B, H, n, D]`` in ``layout``; returns ``[B, H, n, D]``."""
    if kwargs.get("dropout") and getattr(module, "training", False):
        raise NotImplementedError(
            f"ring attention is exact only without attention dropout (got {kwargs['dropout']}); "
            "set attention_dropout=0 in the model config"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("ring attention does not implement logit soft-capping; use backend='ulysses'")
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if binding.schedule == "distflash":
        distflash.check_call(causal, kwargs.get("sliding_window"), cpb.seq_len)
        plan = distflash.DistFlashPlan(size=dist.get_world_size(group), rank=dist.get_rank(group),
                                       chunk=query.shape[2], docs=cpb.docs_on(query.device))
        return distflash.distflash_attention(query, key, value, group, plan, binding.ring_kernel,
                                             scale=kwargs.get("scaling"), sinks=sinks)
    chunk = query.shape[2] // balancers.chunks_per_rank(layout)
    plan = RingPlan(layout=layout, size=dist.get_world_size(group), rank=dist.get_rank(group), chunk=chunk,
                    causal=causal, window=kwargs.get("sliding_window"), docs=cpb.docs_on(query.device))
    return ring_attention(query, key, value, group, plan, binding.ring_kernel, rotate=binding.rotate,
                          scale=kwargs.get("scaling"), sinks=sinks)


def ring_attention_hf(module, query, key, value, *, binding: AttentionBinding, cpb, **kwargs):
    """q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` -> ``[B, S/P, Hq, D]``, the shard cut in ``cpb.layout``.

    Masks come from global positions (the layout's chunks), not from HF's per-shard mask;
    the sliding window from the ``sliding_window`` kwarg; sinks from ``s_aux`` / ``module.sinks``.
    """
    out = ring_core(binding, cpb, module, query, key, value, binding.ring_group, cpb.layout, kwargs,
                    module_sinks(module, kwargs))
    return out.transpose(1, 2).contiguous(), None
