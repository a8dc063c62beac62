"""USP: Ulysses inside a node, Ring across nodes (the split itself: ``config.auto_select``)."""

from __future__ import annotations

import torch.distributed as dist

from .binding import AttentionBinding
from .relbias import KWARG as REL_KWARG, RelativeBias
from .ring.hf import check_call, module_sinks, ring_core
from .ulysses import head_to_seq, kv_replication, seq_to_head


def usp_attention_hf(module, query, key, value, *, binding: AttentionBinding, cpb, **kwargs):
    """Ulysses all-to-all inside the Ulysses group turns ``[B, H, S/P, D]`` into ``[B, H/u, S/r, D]``
    (the Ulysses group's contiguous span), Ring runs over the ring group on that span, and the
    reverse all-to-all returns ``[B, S/P, H, D]``."""
    check_call(binding, module, query, value, kwargs)  # refusals come before the all-to-all
    ug = binding.ulysses_group
    u, i = dist.get_world_size(ug), dist.get_rank(ug)
    rep = kv_replication(query.shape[1], key.shape[1], u)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = seq_to_head([query, key, value], ug)
    rel = kwargs.get(REL_KWARG)
    if rel is not None:  # Inkling's per-query bias features travel with the queries
        kwargs[REL_KWARG] = RelativeBias(states=seq_to_head([rel.states], ug)[0], proj=rel.proj)
    sinks = module_sinks(module, kwargs)
    if sinks is not None and sinks.dim() == 3:  # Inkling2's per-token sinks travel with the queries
        sinks = seq_to_head([sinks.unsqueeze(-1)], ug)[0][..., 0]
    elif sinks is not None:
        sinks = sinks[i * q.shape[1]:(i + 1) * q.shape[1]]
    if kwargs.get("alibi_slopes") is not None:  # per-head, like the sinks: this rank's heads only
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"][i * q.shape[1]:(i + 1) * q.shape[1]]
    out = ring_core(binding, cpb, module, q, k, v, binding.ring_group, "contiguous", kwargs, sinks)
    return head_to_seq(out.transpose(1, 2), ug), None
