"""A runtime: the groups, sizes, layout and block kernel one CP setup uses, bound at setup time.

``rm.setup`` resolves the config against the CP group and registers an attention function
with transformers under a name of its own (``runtime.attn_implementation``). That function
is closed over an :class:`AttentionBinding`: its groups, its ring block kernel and rotation.
Nothing inside a forward looks up "the active runtime": the per-step layout and document
structure arrive in the per-batch ``ringmaster_batch`` kwarg that the shard step writes, and
every CP function checks that batch against what it was bound to before any collective.
So two models wired differently in one process (a Ulysses policy and a Ring reference, two
CP groups) are both exact.

``rm.setup`` also makes its runtime the *current* one: the default for the convenience APIs
called outside a forward (``context_parallel_region(batch)`` without ``runtime=``,
``gather_sequence`` without ``group=``, ``wire_recurrent_layers`` without ``group=``).
``rm.teardown`` forgets it.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .attention import flash_kernels, register
from .attention.accounting import Ledger
from .attention.binding import AttentionBinding
from .attention.ring.kernels import get_kernel
from .attention.ring.select import resolve_ring_impl, resolve_rotate
from .config import Backend, LoadBalance, RingImpl, RingmasterConfig
from .mesh import cp_group_from, group_rank, group_size, intra_node_size, split_usp_groups


@dataclass(eq=False)
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
    ring_impl: RingImpl | None = None
    binding: AttentionBinding | None = None
    multimodal: Any = None             # the VLM's ArchitectureSpec when rm.wire wired one
    positions: Any = None              # rm.wire's PositionConvention for absolute position tables (else None)
    report: Any = None                 # rm.wire's WireReport
    recurrent_wiring: Any = None       # rm.wire's RecurrentWiring (restore() undoes the recurrent layers only)
    adapter: Any = None                # a framework adapter's record (e.g. adapters.accelerate.AccelerateWiring)
    # the step carriers (sharding.carrier.StepCarrier) of the models wired against this runtime: what
    # context_parallel_region(batch, runtime=...) sets for its step when it is not given the model
    carriers: list = field(default_factory=list, repr=False)
    undo: list[Callable[[], None]] = field(default_factory=list, repr=False)   # what rm.wire changed

    @property
    def shard_load_balance(self) -> str:
        """The shard layout batch tensors use: ``"contiguous"`` or ``"head_tail"`` (``distflash`` cuts
        contiguously: it balances the work by its schedule, not by the cut)."""
        lb = self.config.load_balance
        return "head_tail" if lb is LoadBalance.HEAD_TAIL else "contiguous"

    @property
    def backend(self) -> Backend:
        return self.config.backend


_CURRENT: Runtime | None = None
# registered attention name -> the runtime that registered it (weak: a dropped runtime disappears)
_BY_NAME: "weakref.WeakValueDictionary[str, Runtime]" = weakref.WeakValueDictionary()
_SERIAL = itertools.count(1)


def active(required: bool = True) -> Runtime | None:
    """The current runtime (the last ``rm.setup``/``rm.wire``), for APIs called outside a forward."""
    if _CURRENT is None and required:
        raise RuntimeError(
            "no ringmaster runtime is set up: call rm.setup(cfg, ...) or rm.wire(model, cfg) first, "
            "or pass runtime=... (rm.wire returns it)"
        )
    return _CURRENT


def make_current(rt: Runtime | None) -> None:
    """Make ``rt`` the current runtime (``rm.wire`` puts the previous one back when it fails)."""
    global _CURRENT
    _CURRENT = rt


# Checks for a model that reaches CP attention through ``rm.setup`` + ``set_attn_implementation``
# (the low-level path axolotl's built-in plugin takes) instead of ``rm.wire``: that path swaps the attention
# kernel only, so a model needing anything else (a position table numbered from the full row, a layer whose
# caller drops the batch kwarg, a recurrent layer left unwired, a hazard) would train silently wrong.
# ``wiring`` registers the check at import (the core never imports it); it runs once per model, at the
# model's first sharded forward, before any collective.
_SETUP_PATH_CHECKS: list[Callable[[Any], None]] = []


def register_setup_path_check(check: Callable[[Any], None]) -> Callable[[Any], None]:
    if check not in _SETUP_PATH_CHECKS:
        _SETUP_PATH_CHECKS.append(check)
    return check


def check_setup_path(model, rt: Runtime) -> None:
    """Run the registered low-level-path checks on ``model`` once (a model ``rm.wire`` wired is
    checked by ``wire`` itself)."""
    model = unwrap_wrappers(model)
    if getattr(model, "_ringmaster_runtime", None) is not None or model.__dict__.get("_ringmaster_checked") is rt:
        return
    for check in _SETUP_PATH_CHECKS:
        check(model)
    model.__dict__["_ringmaster_checked"] = rt


def unwrap_wrappers(model):
    """The model inside DDP-style wrappers (``.module`` until something has a ``config``)."""
    while model is not None and not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def runtime_of(model) -> Runtime | None:
    """The runtime whose CP attention ``model`` uses: the one ``rm.wire`` bound to it, else the one
    that registered the model's (text config's) attention implementation; None if not wired."""
    model = unwrap_wrappers(model)
    rt = getattr(model, "_ringmaster_runtime", None)
    if rt is not None:
        return rt
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (text, config):
        name = getattr(cfg, "_attn_implementation", None)
        if isinstance(name, str) and name in _BY_NAME:
            return _BY_NAME[name]
    return None


def _check_layout_for_backend(cfg: RingmasterConfig) -> bool:
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
    if cfg.backend is Backend.USP and cfg.ulysses_size > 1 and cfg.load_balance is LoadBalance.DISTFLASH:
        raise ValueError(
            "load_balance='distflash' is a schedule for pure Ring (backend='ring'); under backend='usp' each "
            "Ulysses group holds one span of the ring and runs the plain ring loop. Use load_balance='none' "
            "(or 'auto'), or backend='ring' for distflash"
        )
    return ulysses_only


def setup(cfg: RingmasterConfig, num_kv_heads: int | None = None, device_mesh=None, cp_dim: str = "cp",
          inner_attn: str | None = None, num_heads: int | None = None) -> Runtime:
    """Resolve the config against the CP group and register an attention function bound to it.

    Every check runs before anything collective, so a bad argument raises on every rank
    instead of hanging one of them; the only collective step, creating the USP sub-groups,
    comes last. Returns the runtime and makes it the current one.
    """
    global _CURRENT
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
    ulysses_only = _check_layout_for_backend(cfg)
    inner = inner_attn or "sdpa"
    rank = group_rank(group)
    rt = Runtime(config=cfg, cp_group=group, cp_rank=rank, cp_size=size, inner_attn=inner,
                 num_kv_heads=num_kv_heads)
    serial = next(_SERIAL)
    if ulysses_only:
        rt.ulysses_group = group
        binding = AttentionBinding("ulysses", inner, group, rank, size, ulysses_group=group,
                                   name=register.attention_name("ulysses", inner, serial),
                                   inner_kernel=flash_kernels.load(inner) if flash_kernels.is_flash(inner) else None,
                                   ledger=Ledger())
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
                                   name=register.attention_name(backend, inner, serial), ledger=Ledger())
    rt.binding = binding
    if register.register_attention(binding):
        rt.attn_implementation = binding.name
        _BY_NAME[binding.name] = rt
    _CURRENT = rt
    return rt


def teardown() -> None:
    """Forget the current runtime. Wired models keep working (their attention is bound to its own
    runtime); ``rm.unwire(model)`` restores a model."""
    global _CURRENT
    _CURRENT = None
