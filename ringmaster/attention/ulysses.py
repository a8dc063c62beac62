"""Ulysses: trade the sequence shard for a head shard, run the model's own kernel, trade back.

Each rank enters attention with ``[B, H, S/P, D]`` (all heads, its slice of the sequence),
one fused all-to-all turns q, k and v into ``[B, H/P, S, D]`` (its slice of the heads, the
whole sequence), the kernel the model was configured with runs unchanged, and a second
all-to-all returns ``[B, S/P, H, D]``. Everything the kernel needs to know about the whole
sequence (causal, sliding window, document boundaries of packed rows, padding) comes from
the ``ringmaster_batch`` kwarg captured before sharding.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

from ..comm import all_to_all
from . import flash_kernels, flash_op
from .binding import AttentionBinding
from . import relbias, tiled
from .token_sinks import KWARG as TOKEN_SINKS
from .flex import block_mask as flex_block_mask

# kwargs that describe the local shard only: the inner kernel must not see them
LOCAL_ONLY_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def kv_replication(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How many times each KV head is repeated so that ``size`` ranks each hold whole heads.

    Raises with the splits that would work when no replication can make it fit.
    """
    if num_heads % size:
        ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"Ulysses needs the query heads ({num_heads}) divisible by the CP size ({size}); "
            f"sizes that divide the heads: {ok}. Use one of them, or backend='ring' (no head cap)"
        )
    if num_kv_heads % size == 0:
        return 1
    if size % num_kv_heads == 0:
        return size // num_kv_heads
    raise ValueError(
        f"Ulysses cannot split {num_kv_heads} KV heads over {size} ranks (neither divides the other); "
        f"use a CP size that divides {num_kv_heads} or is a multiple of it, or backend='ring'"
    )


class _HeadSliceModule:
    """Stands in for the attention module inside the inner kernel.

    Same attributes, except the head-dependent ones (GQA ratio, sinks) describe only the
    heads this rank computes, so the model's unmodified kernel does the right thing. A plain
    object with ordinary attributes and a ``__getattr__`` fallback: built per call, it is traced
    by ``torch.compile`` (no ``object.__getattribute__`` tricks, which dynamo cannot follow).
    """

    def __init__(self, module: torch.nn.Module, overrides: dict):
        self.module = module
        for name, value in overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name):  # only for what is not an override
        if name == "module":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.module, name)


def inner_attention(inner: str, module: torch.nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fn
        return fn
    if inner not in ALL_ATTENTION_FUNCTIONS:
        raise KeyError(
            f"ringmaster wraps attn_implementation={inner!r}, which transformers has not registered; "
            "load the model with that implementation first (model.set_attn_implementation)"
        )
    return ALL_ATTENTION_FUNCTIONS[inner]


def _size_rank(group) -> tuple[int, int]:
    """``(P, rank)`` of a Ulysses group; ``None`` is one rank (a documents batch's whole documents: no collective)."""
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def seq_to_head(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``[B, H_i, S/P, D]`` each -> ``[B, H_i/P, S, D]`` each, in one fused all-to-all (none for ``group=None``)."""
    if group is None:
        return list(tensors)
    P = dist.get_world_size(group)
    B, _, S, D = tensors[0].shape
    if any(t.shape[-1] != D for t in tensors):  # different head dims cannot share one buffer
        return [seq_to_head([t], group)[0] for t in tensors]
    heads = [t.shape[1] // P for t in tensors]
    x = torch.cat([t.reshape(B, P, h, S, D) for t, h in zip(tensors, heads)], dim=2).transpose(0, 1)
    y = all_to_all(x, group, tag="ulysses_qkv")  # [P (source = sequence chunk), B, h, S, D]
    y = y.permute(1, 2, 0, 3, 4).reshape(B, sum(heads), P * S, D)
    return list(y.split(heads, dim=1))


def head_to_seq(out: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, H/P, D]`` -> ``[B, S/P, H, D]``, contiguous as HF's kernels return it: with one head
    per rank the reshape is a strided view, and a model that ``.view``s the output (afmoe) breaks."""
    if group is None:
        return out.contiguous()
    P = dist.get_world_size(group)
    B, S_full, h, D = out.shape
    S = S_full // P
    x = out.reshape(B, P, S, h, D).transpose(0, 1)
    y = all_to_all(x, group, tag="ulysses_out")  # [P (source = head group), B, S, h, D]
    return y.permute(1, 2, 0, 3, 4).reshape(B, S, P * h, D).contiguous()


def kernel_mask(inner: str, cpb, causal: bool, window, query: torch.Tensor, kwargs: dict):
    """The mask the inner kernel needs for the whole sequence (flash kernels take no mask: they run in
    :func:`flash_ulysses` with varlen boundaries)."""
    if inner == "flex_attention":  # HF's flex path adds a tensor mask to the scores and is not causal without one
        return flex_block_mask(cpb, causal, window, query.device)
    sdpa_like = inner == "sdpa"  # applies is_causal itself when given no mask
    mask = cpb.dense_mask(causal, window, query.device, materialize=not sdpa_like)
    if mask is None or sdpa_like:
        return mask
    # eager-style kernels add the mask to the scores. Eager is the model's own S x S kernel by design
    # (its scores and probabilities are [B, H/P, S, S]), so a dense [B, 1, S, S] mask in the query
    # dtype adds nothing to its order. sdpa never gets a dense mask (tiled.py), flex gets a BlockMask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, torch.finfo(query.dtype).min)


def alibi_mask(cpb, causal: bool, window, slopes: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The eager kernel's additive mask with ALiBi (bloom, mpt): ``slopes[h] * (k - q)`` over global positions
    plus the batch's mask, ``[B|1, h, S, S]``. Dense, like the eager kernel it feeds (its scores are
    ``[B, h, S, S]`` anyway, as in the modules that use ALiBi: bloom and mpt compute eager attention
    themselves, so Ulysses runs the eager kernel for them whatever ``attn_implementation`` says)."""
    S = q.shape[2]
    pos = torch.arange(S, device=q.device)
    bias = slopes.to(q.dtype).view(1, -1, 1, 1) * (pos[None, :] - pos[:, None]).to(q.dtype)
    mask = cpb.dense_mask(causal, window, q.device, materialize=True)
    return bias.masked_fill(~mask, torch.finfo(q.dtype).min)


def relative_bias_mask(cpb, causal: bool, window, rel: relbias.RelativeBias, q: torch.Tensor) -> torch.Tensor:
    """The eager kernel's additive mask with Inkling's relative bias (this rank's heads, the whole sequence:
    the states came with the all-to-all) plus the batch's mask, ``[B, h, S, S]``: dense like the unwired
    model's own ``[B, H, S, S]`` ``position_bias`` (this rank holds 1/P of its heads)."""
    bias = rel.dense(torch.arange(q.shape[2], device=q.device)).to(q.dtype)
    mask = cpb.dense_mask(causal, window, q.device, materialize=True)
    return bias.masked_fill(~mask, torch.finfo(q.dtype).min)


_BOUND = object()   # the binding's Ulysses group


def local_attention(module, query, key, value, *, binding: AttentionBinding, cpb, **kwargs):
    """The model's own kernel on this rank's tokens alone, masked by ``cpb`` (a batch of one rank): a
    documents batch's whole documents. Ulysses' path with no group: no collective."""
    return ulysses_attention(module, query, key, value, binding=binding, cpb=cpb, group=None, **kwargs)


def ulysses_attention(module, query, key, value, *, binding: AttentionBinding, cpb, group=_BOUND, **kwargs):
    """q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` -> ``[B, S/P, Hq, D]`` (contiguous shards).
    ``group=None``: one rank (:func:`local_attention`)."""
    group = binding.ulysses_group if group is _BOUND else group
    inner = binding.inner
    rel = kwargs.pop(relbias.KWARG, None)
    token_sinks = kwargs.pop(TOKEN_SINKS, None)
    if kwargs.get("alibi_slopes") is not None or rel is not None or token_sinks is not None:
        # bloom/mpt compute eager S x S attention themselves, Inkling's bias is an S x S tensor, Inkling2's
        # per-token sinks are a kwarg of its own eager kernel: so does CP
        inner = "eager"
    elif binding.inner_kernel is not None:
        return flash_ulysses(module, query, key, value, binding=binding, cpb=cpb, group=group, **kwargs)
    if inner == "sdpa" and kwargs.get("softcap") is not None:  # HF's sdpa raises too, but after the all-to-all
        raise NotImplementedError(
            f"{type(module).__name__}: the model caps attention logits (softcap={kwargs['softcap']}) and sdpa has "
            "no softcap; load it with attn_implementation='eager' (or 'flex_attention', or a flash kernel)")
    P, rank = _size_rank(group)
    num_heads, num_kv = query.shape[1], key.shape[1]
    rep = kv_replication(num_heads, num_kv, P)
    if rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    q, k, v = seq_to_head([query, key, value], group)
    hq, hk = q.shape[1], k.shape[1]
    if rel is not None:  # per-query features: they travel with the queries
        rel = relbias.RelativeBias(states=seq_to_head([rel.states], group)[0], proj=rel.proj)
    if token_sinks is not None:  # one logit per query: it travels with the queries, back in the model's shape
        kwargs["sinks"] = seq_to_head([token_sinks.unsqueeze(-1)], group)[0]

    heads = slice(rank * hq, (rank + 1) * hq)
    overrides = {"num_key_value_groups": hq // hk}
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor) and sinks.shape[0] == num_heads:
        overrides["sinks"] = sinks[heads]
    s_aux = kwargs.get("s_aux")
    if isinstance(s_aux, torch.Tensor) and s_aux.shape[0] == num_heads:
        kwargs["s_aux"] = s_aux[heads]
    alibi = kwargs.pop("alibi_slopes", None)
    for name in LOCAL_ONLY_KWARGS:
        kwargs.pop(name, None)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    window = kwargs.get("sliding_window")
    fn = inner_attention(inner, module)
    if alibi is not None:  # ALiBi slopes are per head: this rank's heads only
        out, _ = fn(_HeadSliceModule(module, overrides), q, k, v,
                    alibi_mask(cpb, causal, window, local_heads(alibi, rank, hq), q), **kwargs)
        return head_to_seq(out, group), None
    if rel is not None:
        out, _ = fn(_HeadSliceModule(module, overrides), q, k, v, relative_bias_mask(cpb, causal, window, rel, q),
                    **kwargs)
        return head_to_seq(out, group), None
    if inner == "sdpa" and tiled.needs_tiles(cpb, window):  # no S x S mask: one call per query tile
        out = tiled.tiled_attention(fn, _HeadSliceModule(module, overrides), q, k, v, cpb, causal, window, kwargs)
        return head_to_seq(out, group), None
    mask = kernel_mask(inner, cpb, causal, window, q, kwargs)
    out, _ = fn(_HeadSliceModule(module, overrides), q, k, v, mask, **kwargs)
    return head_to_seq(out, group), None


def local_heads(per_head: torch.Tensor, rank: int, count: int) -> torch.Tensor:
    """The ``count`` entries of a per-head tensor (sinks) for the heads rank ``rank`` computes."""
    return per_head[rank * count:(rank + 1) * count]


def flash_ulysses(module, query, key, value, *, binding: AttentionBinding, cpb, group=_BOUND, **kwargs):
    """Ulysses around a flash kernel (``flash_attention_2/3/4`` or a hub repo), called directly.

    transformers' flash path cannot be used under CP: it looks the library up from
    ``module.config._attn_implementation``, which now names ringmaster's function. The kernel was
    resolved at setup (``binding.inner_kernel``, :mod:`.flash_kernels`) and gets the whole
    head-sharded sequence as one varlen batch: every row's documents (packing, and each padding
    token alone) as ``cu_seqlens`` from the batch's global doc ids, sliding windows as
    ``window_size=(w-1, 0)``, sinks sliced to this rank's heads, softcap and scale as the module
    has them. Unsupported features are refused before any collective. CPU stand-in only so far:
    not yet run on a GPU.
    """
    kernel = binding.inner_kernel
    group = binding.ulysses_group if group is _BOUND else group
    P, rank = _size_rank(group)
    num_heads = query.shape[1]
    rep = kv_replication(num_heads, key.shape[1], P)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    sinks = kwargs.get("s_aux")
    if not isinstance(sinks, torch.Tensor):
        sinks = getattr(module, "sinks", None)
        sinks = sinks if isinstance(sinks, torch.Tensor) else None
    if sinks is not None and sinks.shape[0] != num_heads:
        raise ValueError(f"{type(module).__name__}: {sinks.shape[0]} sink logits for {num_heads} query heads")
    dropout = float(kwargs.get("dropout") or 0.0)
    softcap = kwargs.get("softcap")
    window = flash_kernels.window_size(kwargs.get("sliding_window"), causal)
    kernel.check(sinks=sinks is not None, dropout=dropout, softcap=softcap, window=window is not None)
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    if query.shape[2] * P != cpb.seq_len:  # the varlen boundaries describe cpb.seq_len tokens per row
        raise RuntimeError(f"{type(module).__name__}: {P} shards of {query.shape[2]} tokens, but the batch was cut "
                           f"from {cpb.seq_len}; shard it with this model's runtime (context_parallel_region)")

    if rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    q, k, v = seq_to_head([query, key, value], group)  # [B, h, S, D]
    B, hq, S, D = q.shape
    dv = v.shape[-1]
    cast = flash_kernels.target_dtype(q, module)  # as transformers' flash path: fp32 in -> the model's dtype

    def packed(t, width=None):
        t = t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[-1])
        if width is not None and t.shape[-1] != width:  # value heads narrower than query heads (MLA)
            t = torch.nn.functional.pad(t, [0, width - t.shape[-1]])
        return t if cast is None else t.to(cast)

    local_sinks = None if sinks is None else local_heads(sinks, rank, hq)
    if torch.compiler.is_compiling() and flash_op.compiles(local_sinks, dropout):
        # in a compiled block: the kernel inside ringmaster's op, its boundaries read on the host from the step's
        # opaque handle (no kernel Python traced, no per-packing int in the graph)
        out = flash_op.flash_varlen(packed(q), packed(k), packed(v, D), cpb, B, kernel.name, window, causal, softcap,
                                    float(scale))
    else:
        cu, longest = cpb.varlen_bounds(B, q.device)
        out = kernel.varlen(packed(q), packed(k), packed(v, D), cu, longest, scale=float(scale), causal=causal,
                            window=window, softcap=softcap, dropout=dropout, sinks=local_sinks)
    return head_to_seq(out[..., :dv].reshape(B, S, hq, dv), group), None
