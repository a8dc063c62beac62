"""USP: Ulysses inside a node, Ring across nodes, and the rule that picks the split."""

from __future__ import annotations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_select(num_heads: int | None, num_kv_heads: int | None, world: int,
                ranks_per_node: int | None = None) -> tuple[int, int]:
    """Return ``(ulysses_size, ring_size)`` with product ``world``.

    Rule: Ulysses is the cheaper collective on fast intra-node links but every rank must hold
    whole KV heads, so take the largest Ulysses degree that divides ``world``, fits in a node
    and divides both the query and the KV head counts (no KV replication); the rest of the
    group becomes Ring, which has no head cap. Unknown head counts only cap by the node.
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    node = ranks_per_node if ranks_per_node and ranks_per_node > 0 else world
    best = 1
    for u in _divisors(world):
        if u > node:
            continue
        if num_heads is not None and num_heads % u:
            continue
        if num_kv_heads is not None and num_kv_heads % u:
            continue
        best = max(best, u)
    return best, world // best


def usp_attention_hf(module, query, key, value, attention_mask, *, inner: str, **kwargs):
    """Attention-interface function for USP: Ulysses all-to-all inside the Ulysses group turns
    ``[B, H, S/P, D]`` into ``[B, H/u, S/r, D]`` (the Ulysses group's contiguous span), Ring runs
    over the ring group on that span, and the reverse all-to-all returns ``[B, S/P, H, D]``."""
    import torch.distributed as dist

    from ..runtime import active
    from .ring import module_sinks, ring_core
    from .ulysses import head_to_seq, kv_replication, require_batch, seq_to_head

    rt = active()
    cpb = require_batch(kwargs)
    ug = rt.ulysses_group
    u, i = dist.get_world_size(ug), dist.get_rank(ug)
    rep = kv_replication(query.shape[1], key.shape[1], u)
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = seq_to_head([query, key, value], ug)
    sinks = module_sinks(module, kwargs)
    if sinks is not None:
        sinks = sinks[i * q.shape[1]:(i + 1) * q.shape[1]]
    out = ring_core(rt, cpb, module, q, k, v, rt.ring_group, "contiguous", kwargs, sinks)
    return head_to_seq(out.transpose(1, 2), ug), None
