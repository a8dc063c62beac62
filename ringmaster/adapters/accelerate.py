"""accelerate: keep its ``ParallelismConfig`` mesh and batch replication, let ringmaster own the attention.

accelerate's ``ParallelismConfig(cp_size=N)`` builds the mesh (dims ``dp_replicate``,
``dp_shard``, ``cp``, ``tp``; FSDP2 shards over the flattened ``dp_shard_cp``) and gives every
rank of a ``cp`` group the same batch. Its own CP, however, is torch's experimental
``context_parallel`` around SDPA: ``Accelerator._prepare_cp`` attaches hooks and
``maybe_context_parallel`` shards buffers in place, and the Trainer refuses any attention but
SDPA. :func:`setup_from_parallelism_config` keeps the mesh and the replication, switches those
hooks off **on this accelerator (and trainer) instance only** -- the classes are never patched --
and wires the model with :func:`ringmaster.wire`, so CP works for every family ringmaster knows
(sliding window, sinks, Mamba2 / gated-DeltaNet hybrids, ...).

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    runtime = setup_from_parallelism_config(accelerator, model, rm.RingmasterConfig(size=2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:                 # full-length batch, the same on every cp rank
        loss = model(**batch).loss       # the forward pre-hook cuts this rank's shard
        accelerator.backward(loss)
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
from types import MethodType
from typing import Any, Callable

from ..comm import all_reduce_sum
from ..config import RingmasterConfig
from ..runtime import unwrap_wrappers


def _is_accelerator(obj) -> bool:
    return hasattr(obj, "state") and hasattr(obj, "prepare") and hasattr(obj, "parallelism_config")


def _resolve(accelerator_or_pc):
    """(accelerator or None, ParallelismConfig)."""
    if _is_accelerator(accelerator_or_pc):
        pc = accelerator_or_pc.parallelism_config
        if pc is None:
            raise ValueError(
                "the Accelerator has no parallelism_config; build it with "
                "Accelerator(parallelism_config=ParallelismConfig(cp_size=N, ...))"
            )
        return accelerator_or_pc, pc
    if hasattr(accelerator_or_pc, "cp_size") and hasattr(accelerator_or_pc, "build_device_mesh"):
        return None, accelerator_or_pc
    raise TypeError(
        f"setup_from_parallelism_config needs an accelerate Accelerator or ParallelismConfig, got "
        f"{type(accelerator_or_pc).__name__}"
    )


def device_mesh_of(accelerator_or_pc, device_type: str | None = None):
    """The accelerate mesh with its ``cp`` dim (built from the ParallelismConfig if needed)."""
    accelerator, pc = _resolve(accelerator_or_pc)
    mesh = getattr(accelerator, "torch_device_mesh", None) if accelerator is not None else None
    if mesh is None:
        mesh = getattr(pc, "device_mesh", None)
    if mesh is None:
        if device_type is None:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = pc.get_device_mesh(device_type)
    return mesh


def _set_instance(obj, name: str, value, originals: list) -> None:
    originals.append((obj, name, name in vars(obj), vars(obj).get(name)))
    setattr(obj, name, value)


def _restore(originals: list) -> None:
    for obj, name, existed, value in reversed(originals):
        if existed:
            setattr(obj, name, value)
        elif name in vars(obj):
            delattr(obj, name)
    originals.clear()


def _null_cp_context(buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
    return contextlib.nullcontext()


def disable_torch_cp(accelerator, trainer=None) -> Callable[[], None]:
    """Switch accelerate's (and the HF Trainer's) torch-native CP off on these instances only.

    ``accelerator._prepare_cp`` becomes a pass-through (no ``context_parallel`` hooks, no
    rotate-method global), ``maybe_context_parallel`` a no-op, and ``trainer._prepare_context_
    parallel_inputs`` stops checking for SDPA and sharding buffers. Returns ``restore()``.
    """
    originals: list = []

    def _prepare_cp(self, *args):
        self._cp_context = _null_cp_context
        return args

    _set_instance(accelerator, "_prepare_cp", MethodType(_prepare_cp, accelerator), originals)
    _set_instance(accelerator, "_cp_context", _null_cp_context, originals)
    if trainer is not None:
        def _prepare_context_parallel_inputs(self, model, inputs):
            return contextlib.nullcontext, inputs

        _set_instance(trainer, "_prepare_context_parallel_inputs",
                      MethodType(_prepare_context_parallel_inputs, trainer), originals)
    return lambda: _restore(originals)


def cp_num_items_in_batch(trainer, batch_samples: list, device, cp_group, cp_size: int):
    """A HF Trainer's ``num_items_in_batch`` under the CP loss convention: global tokens / cp_size.

    Full batches are counted as they are (shifted labels); batches the collator already cut
    (``_cp_shard``) are counted locally and summed over the CP group. With
    ``average_tokens_across_devices`` the count is summed over every rank (each CP rank holds the
    same batch, hence the division by cp_size) and the Trainer multiplies the loss by the number
    of processes, as it does without CP.
    """
    from ..sharding.batch import CP_SHARD_KEY, IGNORE_INDEX

    if not batch_samples or "labels" not in batch_samples[0]:
        return None
    labels = [b["shift_labels"] if b.get("shift_labels") is not None else b["labels"][..., 1:]
              for b in batch_samples]
    count = sum(label.ne(IGNORE_INDEX).sum() for label in labels).to(device)
    if any(CP_SHARD_KEY in b for b in batch_samples):   # on the group's device: NCCL has no CPU backend
        count = all_reduce_sum(count, cp_group, tag="token count")
    count = count.float()
    if trainer.args.average_tokens_across_devices and trainer.accelerator.num_processes > 1:
        count = trainer.accelerator.gather(count).sum()
    return (count / cp_size).clamp_min(1e-8)


def _unwrap(model, accelerator):
    if accelerator is not None:
        try:
            return accelerator.unwrap_model(model)
        except Exception:  # an unprepared model: nothing to unwrap
            pass
    return unwrap_wrappers(model)


@dataclass
class AccelerateWiring:
    """What :func:`setup_from_parallelism_config` installed: ``restore()`` undoes all of it."""

    restore: Callable[[], Any]
    context_manager: Any = None
    device_mesh: Any = None


def setup_from_parallelism_config(accelerator_or_pc, model, cfg: RingmasterConfig | None = None, *,
                                  trainer=None, install_hooks: bool = True, gradient_accumulation_steps: int = 1,
                                  device_type: str | None = None):
    """Wire ``model`` for CP over the ``cp`` dim of accelerate's mesh; returns the ringmaster Runtime.

    ``cfg.size`` must equal ``ParallelismConfig.cp_size`` (``cfg=None`` takes it from there). With
    an Accelerator, its torch-native CP hooks are replaced on that instance (and on ``trainer``'s
    when given). ``install_hooks`` registers :class:`ContextParallelContextManager` on the model,
    so a full batch in is cut to this rank's shard (with the global token count); pass False when
    you shard yourself (``context_parallel_region``). ``runtime.adapter`` is an
    :class:`AccelerateWiring`; :func:`teardown` (or ``runtime.adapter.restore()``) undoes everything.
    """
    from ..wiring import unwire, wire

    from ..sharding.batch import ContextParallelContextManager

    accelerator, pc = _resolve(accelerator_or_pc)
    cp_size = int(getattr(pc, "cp_size", 1) or 1)
    if cp_size < 2:
        raise ValueError(f"ParallelismConfig.cp_size={cp_size}: set cp_size > 1 to use context parallelism")
    if getattr(pc, "sp_size", 1) not in (None, 1):
        raise ValueError("ParallelismConfig.sp_size > 1 (DeepSpeed Ulysses) and ringmaster CP are exclusive")
    if cfg is None:
        cfg = RingmasterConfig(size=cp_size)
    if cfg.size != cp_size:
        raise ValueError(f"RingmasterConfig.size={cfg.size} but ParallelismConfig.cp_size={cp_size}; make them equal")
    mesh = device_mesh_of(accelerator_or_pc, device_type)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "cp" not in names:
        raise ValueError(f"accelerate's device mesh has no 'cp' dim (dims: {names}); is cp_size > 1?")

    inner = _unwrap(model, accelerator)
    runtime = wire(inner, cfg, device_mesh=mesh, cp_dim="cp")
    context_manager = None
    restores: list[Callable[[], Any]] = []
    try:
        if accelerator is not None:
            restores.append(disable_torch_cp(accelerator, trainer))
        if install_hooks:
            manager = ContextParallelContextManager([model], runtime.cp_group,
                                                    gradient_accumulation_steps=gradient_accumulation_steps,
                                                    load_balance=runtime.shard_load_balance)
            handles = manager.install()
            context_manager = manager
            restores.append(lambda: [h.remove() for h in handles])
    except Exception:
        for r in reversed(restores):
            r()
        unwire(inner)
        raise

    def restore():
        for r in reversed(restores):
            r()
        restores.clear()
        unwire(inner)

    runtime.adapter = AccelerateWiring(restore=restore, context_manager=context_manager, device_mesh=mesh)
    return runtime


def teardown(runtime) -> None:
    """Undo :func:`setup_from_parallelism_config` (hooks, accelerate overrides, wiring) and drop the runtime."""
    from .. import runtime as _runtime

    wiring, runtime.adapter = runtime.adapter, None
    if isinstance(wiring, AccelerateWiring):
        wiring.restore()
    _runtime.teardown()
