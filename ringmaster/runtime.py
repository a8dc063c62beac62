"""A runtime: the groups, sizes, layout and block kernel one CP setup uses, bound at setup time.

``rm.setup`` (:mod:`ringmaster.attention.setup`: it binds attention, so it sits above it) resolves the
config against the CP group and registers an attention function with transformers under a name of its
own (``runtime.attn_implementation``). That function is closed over an :class:`AttentionBinding`: its
groups, its ring block kernel and rotation. This module holds what the layers below attention need: the
:class:`Runtime` record, the current runtime and :func:`runtime_of`.
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

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .attention.binding import AttentionBinding
from .config import Backend, LoadBalance, RingImpl, RingmasterPlan


@dataclass(eq=False)
class Runtime:
    config: RingmasterPlan             # the resolved, frozen plan (never the caller's RingmasterConfig)
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
    recurrent_auto: bool = False       # the config asked recurrent="auto": wire_recurrent_layers picks per layer
    adapter: Any = None                # a framework adapter's record (e.g. adapters.accelerate.AccelerateWiring)
    # the step carriers (sharding.carrier.StepCarrier) of the models wired against this runtime: what
    # context_parallel_region(batch, runtime=...) sets for its step when it is not given the model
    carriers: list = field(default_factory=list, repr=False)
    cost: Any = None                   # rm.wire's sharding.assignment.Cost for the model (load_balance="documents")
    mixing: Any = None                 # rm.wire's token-mixing check (architectures.mixing.MixingCheck)
    # rm.wire(compile=True): a row of one document that numbers its positions (position_ids) keeps its document
    # ids, so a compiled block sees a packed batch of one document as the packed case it already compiled
    compiled: bool = False
    undo: list[Callable[[], None]] = field(default_factory=list, repr=False)   # what rm.wire changed

    @property
    def shard_load_balance(self) -> str:
        """The shard layout batch tensors use: ``"contiguous"`` or ``"head_tail"`` (``distflash`` cuts
        contiguously: it balances the work by its schedule, not by the cut), or ``"documents"`` (a per-batch
        assignment: :func:`ringmaster.sharding.assignment.policy_of`)."""
        lb = self.config.load_balance
        if lb is LoadBalance.DOCUMENTS:
            return "documents"
        return "head_tail" if lb is LoadBalance.HEAD_TAIL else "contiguous"

    @property
    def backend(self) -> Backend:
        return self.config.backend


_CURRENT: Runtime | None = None
# registered attention name -> the runtime that registered it (weak: a dropped runtime disappears)
_BY_NAME: "weakref.WeakValueDictionary[str, Runtime]" = weakref.WeakValueDictionary()


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


def name_runtime(name: str, rt: Runtime) -> None:
    """Record that ``rt`` registered the attention implementation ``name`` (for :func:`runtime_of`)."""
    _BY_NAME[name] = rt


def teardown() -> None:
    """Forget the current runtime. Wired models keep working (their attention is bound to its own
    runtime); ``rm.unwire(model)`` restores a model."""
    global _CURRENT
    _CURRENT = None
