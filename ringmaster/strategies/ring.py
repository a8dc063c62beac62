"""Ring attention (KV blocks rotate around the CP group). The block-kernel choice lives here."""

from __future__ import annotations

from ..config import RingImpl


def resolve_ring_impl(ring_impl, inner_attn: str | None) -> RingImpl:
    """Pick the ring block kernel: flash kernels from the hub when the model uses a flash kernel,
    aten's LSE-returning SDPA ops otherwise; an explicit choice is kept."""
    impl = ring_impl if isinstance(ring_impl, RingImpl) else RingImpl(ring_impl)
    if impl is not RingImpl.AUTO:
        return impl
    inner = inner_attn or "sdpa"
    if "flash" in inner or "/" in inner:
        return RingImpl.HF_KERNELS
    return RingImpl.TORCH_NATIVE


def resolve_rotate(rotate_method) -> str:
    from ..config import RotateMethod

    return "allgather" if RotateMethod(rotate_method) is RotateMethod.ALLGATHER else "alltoall"


def module_sinks(module, kwargs):
    """gpt-oss style sinks ``[Hq]``: the ``s_aux`` kwarg or the module's ``sinks`` parameter."""
    import torch

    sinks = kwargs.get("s_aux")
    if not isinstance(sinks, torch.Tensor):
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def ring_core(rt, cpb, module, query, key, value, group, layout: str, kwargs, sinks):
    """Ring attention over ``group`` for q ``[B, H, n, D]`` in ``layout``; returns ``[B, H, n, D]``."""
    import torch.distributed as dist

    from .. import balancers
    from ..ring.loop import RingPlan, ring_attention

    if kwargs.get("dropout") and getattr(module, "training", False):
        raise NotImplementedError(
            f"ring attention is exact only without attention dropout (got {kwargs['dropout']}); "
            "set attention_dropout=0 in the model config"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("ring attention does not implement logit soft-capping; use backend='ulysses'")
    chunk = query.shape[2] // balancers.chunks_per_rank(layout)
    plan = RingPlan(layout=layout, size=dist.get_world_size(group), rank=dist.get_rank(group), chunk=chunk,
                    causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
                    window=kwargs.get("sliding_window"), docs=cpb.docs_on(query.device))
    return ring_attention(query, key, value, group, plan, rt.extras["ring_kernel"],
                          rotate=resolve_rotate(rt.config.rotate_method), scale=kwargs.get("scaling"), sinks=sinks)


def ring_attention_hf(module, query, key, value, attention_mask, *, inner: str, **kwargs):
    """Attention-interface function: q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` -> ``[B, S/P, Hq, D]``.

    Masks come from global positions (the layout's chunks), not from HF's per-shard mask;
    the sliding window from the ``sliding_window`` kwarg; sinks from ``s_aux`` / ``module.sinks``.
    """
    from ..runtime import active

    from .ulysses import require_batch

    rt = active()
    cpb = require_batch(kwargs)
    out = ring_core(rt, cpb, module, query, key, value, rt.ring_group, rt.shard_load_balance, kwargs,
                    module_sinks(module, kwargs))
    return out.transpose(1, 2).contiguous(), None


def register_ring_attention(inner: str, backend: str = "ring") -> str | None:
    """Register the Ring (or USP) wrapper of ``inner`` with transformers; return its name."""
    from functools import partial

    from ..comm import with_layer_context
    from ..compat import has_module
    from .ulysses import attention_name, no_cache_mask

    if not has_module("transformers"):
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if backend == "usp":
        from .usp import usp_attention_hf as fn
    else:
        fn = ring_attention_hf
    name = attention_name(inner).replace("ringmaster_ulysses_", f"ringmaster_{backend}_")
    AttentionInterface.register(name, with_layer_context(partial(fn, inner=inner)))
    AttentionMaskInterface.register(name, no_cache_mask)
    return name
