"""ringmaster's own axolotl entry point: ``plugins: [ringmaster.adapters.axolotl.RingmasterPlugin]``.

axolotl 0.21 ships a built-in ``context_parallel`` plugin that calls ringmaster's public API
(that stays supported). This plugin is the architecture-aware path: it wires the model with
:func:`ringmaster.wire` (every family in ringmaster's registry -- Llama-likes, sliding window,
sinks, Qwen3.5 / Qwen3-Next gated DeltaNet, Nemotron-H / Bamba / Falcon-H1 Mamba2, VLMs), keeps
accelerate's mesh (the ``cp`` dim of ``ParallelismConfig``) and batch replication, replaces
accelerate's and the Trainer's torch-native CP on those instances only, and makes the Trainer's
token count follow ringmaster's loss convention.

YAML (the ``ringmaster:`` block merges into axolotl's config schema)::

    plugins:
      - ringmaster.adapters.axolotl.RingmasterPlugin
    context_parallel_size: 4        # accelerate's cp dim (axolotl builds the mesh from it)
    ringmaster:
      size: 4
      backend: auto                 # auto | ulysses | ring | usp
      load_balance: auto

Keys of the block are :class:`~ringmaster.RingmasterConfig` fields (strings for the enums).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from ..config import RECURRENT_CHOICES, RingmasterConfig

try:
    from pydantic import BaseModel, ConfigDict, Field, model_validator
except ImportError:  # pragma: no cover - pydantic comes with axolotl
    BaseModel = None

try:
    from axolotl.integrations.base import BasePlugin as _Base
except Exception:  # axolotl is optional: the plugin object still works with a plain base
    class _Base:  # type: ignore[no-redef]
        def __init__(self):
            pass


if BaseModel is not None:
    class RingmasterSettings(BaseModel):
        """The ``ringmaster:`` block: RingmasterConfig fields plus trainer-side switches."""

        model_config = ConfigDict(extra="forbid")

        size: int = Field(default=1, ge=1)
        backend: Literal["auto", "ulysses", "ring", "usp"] = "auto"
        ulysses_size: Optional[int] = Field(default=None, ge=1)
        ring_size: Optional[int] = Field(default=None, ge=1)
        rotate_method: Literal["alltoall", "allgather", "p2p"] = "alltoall"
        load_balance: Literal["auto", "none", "head_tail", "distflash", "documents"] = "auto"
        documents_threshold: Optional[int] = Field(default=None, ge=1)
        """load_balance: documents: documents longer than this are split over the group (None: chosen per batch)."""
        ring_impl: Literal["auto", "math", "torch_native", "hf_kernels"] = "auto"
        recurrent: Literal[RECURRENT_CHOICES] = "auto"   # every RingmasterConfig.recurrent value (fla_cp, heads)
        gather_outputs: bool = False
        """All-gather the logits back to the full sequence after every forward (RL losses)."""

        @model_validator(mode="after")
        def _check(self):
            for name in ("ulysses_size", "ring_size"):
                value = getattr(self, name)
                if value is not None and self.size % value:
                    raise ValueError(f"ringmaster.{name}={value} must divide ringmaster.size={self.size}")
            if self.ulysses_size and self.ring_size and self.ulysses_size * self.ring_size != self.size:
                raise ValueError(f"ringmaster.ulysses_size * ring_size = {self.ulysses_size * self.ring_size} "
                                 f"!= size {self.size}")
            return self

    class RingmasterArgs(BaseModel):
        """Input args this plugin merges into axolotl's schema."""

        ringmaster: Optional[RingmasterSettings] = None

        @model_validator(mode="before")
        @classmethod
        def _sync_size(cls, data):
            if not isinstance(data, dict) or not isinstance(data.get("ringmaster"), dict):
                return data
            block = dict(data["ringmaster"])
            flat = data.get("context_parallel_size")
            if block.get("size") is None and flat:
                block["size"] = flat
            elif flat and block.get("size") and flat != block["size"]:
                raise ValueError(f"ringmaster.size ({block['size']}) conflicts with context_parallel_size ({flat})")
            data = dict(data)
            data["ringmaster"] = block
            return data


def settings_of(cfg) -> Optional[Any]:
    """The ``ringmaster:`` block of an axolotl cfg (dict or validated model), or None."""
    block = cfg.get("ringmaster") if isinstance(cfg, dict) else getattr(cfg, "ringmaster", None)
    if isinstance(block, dict):
        block = RingmasterSettings.model_validate(block)
    return block


def ringmaster_config(settings) -> RingmasterConfig:
    """A RingmasterConfig from the validated ``ringmaster:`` block."""
    from ..config import AUTO

    return RingmasterConfig(
        size=settings.size, backend=settings.backend,
        ulysses_size=settings.ulysses_size or AUTO, ring_size=settings.ring_size or AUTO,
        rotate_method=settings.rotate_method, load_balance=settings.load_balance, ring_impl=settings.ring_impl,
        recurrent=settings.recurrent, documents_threshold=settings.documents_threshold,
    )


class RingmasterPlugin(_Base):
    """axolotl plugin: architecture-aware context parallelism through ringmaster."""

    def __init__(self):
        super().__init__()
        self._restores: list = []
        self.runtime = None

    def get_input_args(self) -> str:
        return "ringmaster.adapters.axolotl.RingmasterArgs"

    def _enabled(self, cfg) -> bool:
        settings = settings_of(cfg)
        return bool(settings is not None and settings.size > 1)

    def pre_model_load(self, cfg):
        if not self._enabled(cfg):
            return
        from ..compat import require_torch

        require_torch()
        cp = cfg.get("context_parallel") if isinstance(cfg, dict) else getattr(cfg, "context_parallel", None)
        if cp:
            raise ValueError("use either axolotl's built-in `context_parallel:` plugin block or `ringmaster:`, "
                             "not both")

    def post_trainer_create(self, cfg, trainer):
        if not self._enabled(cfg):
            return
        try:
            self._configure(cfg, trainer)
        except Exception:
            self.post_train_unload(cfg)
            raise

    def _configure(self, cfg, trainer):
        from types import MethodType

        from ..wiring import unwire, wire

        from ..sharding.batch import ContextParallelContextManager
        from .accelerate import _restore, _set_instance, cp_num_items_in_batch, disable_torch_cp

        settings = settings_of(cfg)
        rm_cfg = ringmaster_config(settings)
        accelerator = trainer.accelerator
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None and "cp" not in tuple(getattr(mesh, "mesh_dim_names", None) or ()):
            mesh = None  # no cp dim in accelerate's mesh: the CP group is the whole world
        model = accelerator.unwrap_model(trainer.model)
        if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None):
            if not settings.gather_outputs:
                raise ValueError("ringmaster computes the causal-LM loss per shard: a custom compute_loss_func or "
                                 "label smoothing needs `ringmaster.gather_outputs: true`")
        self.runtime = runtime = wire(model, rm_cfg, device_mesh=mesh)
        self._restores.append(lambda: unwire(model))
        self._restores.append(disable_torch_cp(accelerator, trainer))

        originals: list = []

        def _get_num_items_in_batch(self_, batch_samples, device):
            if not self_.model_accepts_loss_kwargs:
                return None
            return cp_num_items_in_batch(self_, batch_samples, device, runtime.cp_group, runtime.cp_size)

        _set_instance(trainer, "_get_num_items_in_batch", MethodType(_get_num_items_in_batch, trainer), originals)
        self._restores.append(lambda: _restore(originals))
        models = [trainer.model]
        ref_model = getattr(trainer, "ref_model", None)
        if ref_model is not None:  # sharded like the policy, so its attention must be CP attention too
            ref = accelerator.unwrap_model(ref_model) if hasattr(accelerator, "unwrap_model") else ref_model
            if ref is not model and getattr(ref, "_ringmaster_runtime", None) is None:
                wire(ref, ringmaster_config(settings), device_mesh=mesh)
                self._restores.append(lambda: unwire(ref))
            models.append(ref_model)
        manager = ContextParallelContextManager(
            models, runtime.cp_group, gradient_accumulation_steps=int(cfg.get("gradient_accumulation_steps") or 1)
            if isinstance(cfg, dict) else int(getattr(cfg, "gradient_accumulation_steps", 1) or 1),
            gather_outputs=settings.gather_outputs)
        handles = manager.install()
        self._restores.append(lambda: [h.remove() for h in handles])
        try:  # axolotl's own CP consumers (mamba corrections, GRPO) look the group up here
            from axolotl.monkeypatch.ring_attn import set_ring_attn_group

            set_ring_attn_group(runtime.cp_group)
            self._restores.append(lambda: set_ring_attn_group(None))
        except ImportError:
            pass

    def post_train_unload(self, cfg):
        from ..runtime import teardown

        while self._restores:
            self._restores.pop()()
        if self.runtime is not None:
            teardown()
            self.runtime = None


__all__ = ["RingmasterArgs", "RingmasterPlugin", "RingmasterSettings", "ringmaster_config", "settings_of"]
