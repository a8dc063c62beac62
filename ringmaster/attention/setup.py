"""``rm.setup``: resolve the config against the CP group and register an attention function bound to it.

It binds attention (the block kernel, the rotation, the registered name), so it lives in ``attention/``,
not in :mod:`ringmaster.runtime`: the runtime record sits below the step and the ops, which read it.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from ..config import Backend, LoadBalance, RingmasterConfig, RingmasterPlan
from ..mesh import cp_group_from, group_rank, group_size, intra_node_size, split_usp_groups
from ..runtime import Runtime, make_current, name_runtime
from . import flash_kernels, register
from .accounting import Ledger
from .binding import AttentionBinding
from .ring.kernels import get_kernel
from .ring.select import resolve_ring_impl, resolve_rotate

_SERIAL = itertools.count(1)


def _check_layout_for_backend(cfg: RingmasterPlan) -> bool:
    ulysses_only = cfg.backend is Backend.ULYSSES or (cfg.backend is Backend.USP and cfg.ring_size == 1)
    if ulysses_only and cfg.load_balance not in (LoadBalance.NONE, LoadBalance.DOCUMENTS):
        raise ValueError(
            f"load_balance={cfg.load_balance.value!r} only helps Ring; Ulysses computes the whole sequence "
            "on every rank, so use load_balance='none' (or 'auto')"
        )
    if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.load_balance is LoadBalance.HEAD_TAIL:
        raise ValueError(
            "backend='usp' shards the sequence contiguously (each Ulysses group holds one span of the ring); "
            "use load_balance='none' (or 'auto'), or backend='ring' for head_tail balancing"
        )
    if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.load_balance is LoadBalance.DISTFLASH:
        raise ValueError(
            "load_balance='distflash' is a schedule for pure Ring (backend='ring'); under backend='usp' each "
            "Ulysses group holds one span of the ring and runs the plain ring loop. Use load_balance='none' "
            "(or 'auto'), or backend='ring' for distflash"
        )
    return ulysses_only


def size_mismatch_message(wanted: int, size: int, world: int, cp_dim: str = "cp", mesh: bool = True) -> str:
    """The error for ``RingmasterConfig.size=wanted`` on a CP group of ``size`` ranks in a job of ``world``: set
    ``size``, or (only where ``world`` can hold it) build the mesh with a ``cp_dim`` dim of ``wanted``."""
    where = f"device_mesh[{cp_dim!r}]" if mesh else "the default process group"
    head = f"RingmasterConfig.size={wanted} but {where} has {size} ranks; set size={size}"
    if world % wanted:
        return (f"{head}. A {cp_dim!r} dim of {wanted} is not possible here: this job has {world} ranks, which "
                f"{wanted} does not divide (launch a multiple of {wanted} ranks for size={wanted})")
    return (f"{head}, or pass device_mesh=init_device_mesh(device, ({world // wanted}, {wanted}), "
            f"mesh_dim_names=('dp', {cp_dim!r})) for a {cp_dim!r} dim of {wanted} over this job's {world} ranks")


def setup(cfg: RingmasterConfig | RingmasterPlan, num_kv_heads: int | None = None, device_mesh=None,
          cp_dim: str = "cp", inner_attn: str | None = None, num_heads: int | None = None) -> Runtime:
    """Resolve the config against the CP group and register an attention function bound to it.

    The config is resolved into a frozen :class:`RingmasterPlan` (``runtime.config``); the caller's
    ``RingmasterConfig`` is left exactly as it was (a plan, or a config ``normalize()`` resolved in place,
    is taken as it is). Every check runs before anything collective, so a bad argument raises on every rank
    instead of hanging one of them; the only collective step, creating the USP sub-groups, comes last.
    Returns the runtime and makes it the current one.
    """
    if not isinstance(cfg, (RingmasterConfig, RingmasterPlan)):
        raise TypeError(f"setup() needs a RingmasterConfig, got {type(cfg).__name__}")
    group = cp_group_from(device_mesh, cp_dim)
    size = group_size(group)
    if cfg.size != size:
        raise ValueError(size_mismatch_message(cfg.size, size, dist.get_world_size(), cp_dim, device_mesh is not None))
    asked_auto = cfg.recurrent == "auto"   # a plan has it resolved; the layers wired under this runtime pick per layer
    cfg = cfg.resolve(num_kv_heads=num_kv_heads, intra_node_size=intra_node_size(), num_heads=num_heads)
    ulysses_only = _check_layout_for_backend(cfg)
    inner = inner_attn or "sdpa"
    rank = group_rank(group)
    rt = Runtime(config=cfg, cp_group=group, cp_rank=rank, cp_size=size, inner_attn=inner,
                 num_kv_heads=num_kv_heads, recurrent_auto=asked_auto)
    serial = next(_SERIAL)
    if ulysses_only:
        rt.ulysses_group = group
        binding = AttentionBinding("ulysses", inner, group, rank, size, ulysses_group=group,
                                   name=register.attention_name("ulysses", inner, serial),
                                   inner_kernel=flash_kernels.load(inner) if flash_kernels.is_flash(inner) else None,
                                   ledger=Ledger(), documents=cfg.load_balance is LoadBalance.DOCUMENTS)
    else:
        if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.ring_size > 1:
            rt.ulysses_group, rt.ring_group = split_usp_groups(device_mesh, cp_dim, group, cfg.ulysses_size,
                                                               cfg.ring_size)
            backend = "usp"
        else:  # a 1 x P USP split is plain Ring
            rt.ring_group, backend = group, "ring"
        rt.ring_impl = resolve_ring_impl(cfg.ring_impl, inner)
        # distflash owns its p2p schedule: rotate_method is not consulted (axolotl passes its default)
        schedule = "distflash" if cfg.load_balance is LoadBalance.DISTFLASH else "ring"
        binding = AttentionBinding(backend, inner, group, rank, size, ulysses_group=rt.ulysses_group,
                                   ring_group=rt.ring_group, ring_kernel=get_kernel(rt.ring_impl, inner),
                                   rotate=resolve_rotate(cfg.rotate_method), schedule=schedule,
                                   name=register.attention_name(backend, inner, serial), ledger=Ledger(),
                                   documents=cfg.load_balance is LoadBalance.DOCUMENTS)
    rt.binding = binding
    if register.register_attention(binding):
        rt.attn_implementation = binding.name
        name_runtime(binding.name, rt)
    make_current(rt)
    return rt
