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
