"""The active runtime: which groups, sizes and layout the wrapped attention uses.

There is one active runtime per process (``rm.setup`` / ``rm.wire`` replace it,
``rm.teardown`` drops it). It holds configuration and process groups only; nothing
per-batch lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import Backend, LoadBalance, RingmasterConfig
from .mesh import cp_group_from, group_rank, group_size, intra_node_size


@dataclass
class Runtime:
    config: RingmasterConfig
    cp_group: Any
    cp_rank: int
    cp_size: int
    ulysses_group: Any = None
    ring_group: Any = None
    inner_attn: str | None = None
    attn_implementation: str | None = None
    num_kv_heads: int | None = None
    extras: dict = field(default_factory=dict)

    @property
    def shard_load_balance(self) -> str:
        """The shard layout batch tensors use: ``"contiguous"`` or ``"head_tail"``."""
        lb = self.config.load_balance
        return "head_tail" if lb is LoadBalance.HEAD_TAIL else "contiguous" if lb is LoadBalance.NONE else lb.value

    @property
    def backend(self) -> Backend:
        return self.config.backend


_ACTIVE: Runtime | None = None


def active(required: bool = True) -> Runtime | None:
    if _ACTIVE is None and required:
        raise RuntimeError(
            "no ringmaster runtime is active: call rm.setup(cfg, ...) or rm.wire(model, cfg) first "
            "(or keep the model on its original attn_implementation)"
        )
    return _ACTIVE


def setup(cfg: RingmasterConfig, num_kv_heads: int | None = None, device_mesh=None, cp_dim: str = "cp",
          inner_attn: str | None = None, num_heads: int | None = None) -> Runtime:
    """Resolve the config against the CP group and register the wrapped attention.

    Every check runs before anything collective, so a bad argument raises on every rank
    instead of hanging one of them; the only collective step, creating the USP sub-groups,
    comes last.
    """
    global _ACTIVE
    if not isinstance(cfg, RingmasterConfig):
        raise TypeError(f"setup() needs a RingmasterConfig, got {type(cfg).__name__}")
    group = cp_group_from(device_mesh, cp_dim)
    size = group_size(group)
    if cfg.size != size:
        where = f"device_mesh[{cp_dim!r}]" if device_mesh is not None else "the default process group"
        raise ValueError(
            f"RingmasterConfig.size={cfg.size} but {where} has {size} ranks; set size={size} "
            f"or build the mesh with a {cp_dim!r} dim of {cfg.size}"
        )
    if not cfg.normalized:
        cfg.normalize(num_kv_heads=num_kv_heads, intra_node_size=intra_node_size(), num_heads=num_heads)
    ulysses_only = cfg.backend is Backend.ULYSSES or (cfg.backend is Backend.USP and cfg.ring_size == 1)
    if ulysses_only and cfg.load_balance is not LoadBalance.NONE:
        raise ValueError(
            f"load_balance={cfg.load_balance.value!r} only helps Ring; Ulysses computes the whole sequence "
            "on every rank, so use load_balance='none' (or 'auto')"
        )
    if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.load_balance is LoadBalance.HEAD_TAIL:
        raise ValueError(
            "backend='usp' shards the sequence contiguously (each Ulysses group holds one span of the ring); "
            "use load_balance='none' (or 'auto'), or backend='ring' for head_tail balancing"
        )
    if cfg.load_balance is LoadBalance.DISTFLASH:
        raise NotImplementedError(
            "load_balance='distflash' is not implemented: head_tail already balances causal work to within 1% "
            "(balancers.work_figure); use load_balance='head_tail'"
        )
    inner = inner_attn or "sdpa"
    rt = Runtime(config=cfg, cp_group=group, cp_rank=group_rank(group), cp_size=size, inner_attn=inner,
                 num_kv_heads=num_kv_heads)
    if ulysses_only:
        from .strategies.ulysses import register_ulysses_attention

        rt.ulysses_group = group
        rt.attn_implementation = register_ulysses_attention(inner)
    else:
        from .mesh import split_usp_groups
        from .ring.kernels import get_kernel
        from .strategies.ring import register_ring_attention, resolve_ring_impl

        if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.ring_size > 1:
            rt.ulysses_group, rt.ring_group = split_usp_groups(device_mesh, cp_dim, group, cfg.ulysses_size,
                                                               cfg.ring_size)
            backend = "usp"
        else:  # a 1 x P USP split is plain Ring
            rt.ring_group, backend = group, "ring"
        rt.extras["ring_impl"] = resolve_ring_impl(cfg.ring_impl, inner)
        rt.extras["ring_kernel"] = get_kernel(rt.extras["ring_impl"])
        rt.attn_implementation = register_ring_attention(inner, backend)
    _ACTIVE = rt
    return rt


def teardown() -> None:
    """Drop the active runtime. Registered attention names stay registered (harmless)."""
    global _ACTIVE
    _ACTIVE = None
