"""trl: ``CPSFTTrainer``, an ``SFTTrainer`` whose model is context parallel through ringmaster.

Every rank of a CP group receives the same full batch (accelerate's ``ParallelismConfig(cp_size=N)``
replicates it over ``cp``; a single-process-per-rank launch does so too; where accelerate shards the data over
every rank, DeepSpeed's engine or a distributed launch without ``ParallelismConfig``, this trainer shards it per
CP group instead). A forward pre-hook
(:class:`~ringmaster.ContextParallelContextManager`) shifts the labels *before* cutting
(``shift_labels``), cuts this rank's shard and passes the batch's document structure, so padding,
packing and padding-free batches are all exact. What this class adds to ``SFTTrainer``:

- ``num_items_in_batch`` is the global supervised-token count over the accumulation window
  divided by the CP degree (counted on the full batch, or all-reduced over the CP group when the
  collator already cut the shard), so the mean over the CP group of each rank's loss and
  gradients is the single-device value (the convention FSDP2/DDP averaging completes);
- accelerate's and the Trainer's torch-native CP (SDPA only, in-place buffer sharding) are
  replaced on these instances; packing / padding-free are allowed (ringmaster keeps documents
  apart from the global ``position_ids``);
- the loss is :func:`ringmaster.sharding.loss.chunked_nll` over the shard's hidden states (full-vocabulary
  logits never exist for the whole shard) unless ``cp_loss="trl"`` keeps trl's fused head;
- evaluation losses are reduced (mean) over the CP group, so every rank logs the true eval loss.

``CPGRPOTrainer`` (GRPO with the policy and the reference model wired; per-token log-probs through
:func:`ringmaster.token_logprobs`) lives in :mod:`ringmaster.adapters.grpo` and is re-exported here.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

try:
    from trl import SFTTrainer
except ImportError as exc:  # pragma: no cover - trl is an optional extra
    raise ImportError("ringmaster.adapters.trl needs trl: pip install 'axolotl-ringmaster[trl]'") from exc

from ..architectures import text_config
from ..errors import UnsupportedLayerError
from ..sharding.batch import IGNORE_INDEX
from ..sharding.loss import reduce_mean
from .accelerate import cp_num_items_in_batch
from .head_forward import install_head_forward


def _install_chunked_loss(model, chunk_size: int):
    """Give ``model.forward`` a ``ringmaster_chunked_loss=True`` mode: backbone + :func:`chunked_nll`.

    Per instance (like trl's fused head). The call still goes through the top module, so FSDP2's
    root hooks gather the embedding/head and ringmaster's pre-hook shards the batch.
    Returns ``restore()``.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ..sharding.loss import chunked_nll

    def router_term(model, out, kwargs):
        """``router_aux_loss_coef * aux_loss`` as the model's forward adds it (its router loss as rm.wire re-bound
        it, summed over the CP group: sharding/router.py), or None when the router loss is off."""
        on = kwargs.get("output_router_logits")
        if not (on if on is not None else getattr(text_config(model.config), "output_router_logits", False)):
            return None
        loss_fn = vars(model).get("_ringmaster_router_loss")
        logits = getattr(out, "router_logits", None)
        missing = [n for n in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(model, n)]
        if loss_fn is None or logits is None or missing:
            raise UnsupportedLayerError(
                f"{type(model).__name__}: the MoE router loss is on, but CPSFTTrainer's chunked loss head cannot add it "
                f"({'no router loss wired by rm.wire' if loss_fn is None else 'the backbone returned no router_logits' if logits is None else f'the model has no {missing}'}); "
                "set output_router_logits=False")
        return model.router_aux_loss_coef * loss_fn(logits, model.num_experts, model.num_experts_per_tok, None)

    def head(model, out, shift_labels, kwargs, num_items):
        weight = model.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor
            weight = weight.full_tensor()
        if num_items is None:
            num_items = shift_labels.ne(IGNORE_INDEX).sum().clamp_min(1)
        loss = chunked_nll(out.last_hidden_state, weight, shift_labels, num_items, chunk_size=chunk_size)
        router = router_term(model, out, kwargs)
        return CausalLMOutputWithPast(loss=loss if router is None else loss + router.to(loss.device))

    return install_head_forward(model, "ringmaster_chunked_loss", head)


def _data_parallel_shards(accelerator, pc, runtime) -> tuple[int, int] | None:
    """``(CP groups, this rank's group index)`` when accelerate shards the data over every rank, the CP ranks
    counted as data-parallel (DeepSpeed, whose engine is data-parallel over the whole world, or a distributed
    launch without ``ParallelismConfig(cp_size)``): every rank of a CP group must get the same batch, so the data
    is sharded per CP group instead. None where accelerate already replicates it over the CP group
    (``ParallelismConfig(cp_size)``) or runs one process. The group index comes from one all-gather at setup."""
    if runtime.cp_size <= 1 or accelerator.num_processes <= 1 or (pc is not None and getattr(pc, "cp_enabled", False)):
        return None
    world = dist.get_world_size()
    if accelerator.num_processes != world:
        raise ValueError(f"accelerate runs {accelerator.num_processes} processes in a world of {world}: ringmaster "
                         "cannot tell which ranks share a CP group's batch")
    first = min(dist.get_process_group_ranks(runtime.cp_group))   # a CP group is named by its lowest rank
    firsts: list = [None] * world
    dist.all_gather_object(firsts, first)
    groups = sorted(set(firsts))
    return len(groups), groups.index(first)


def _shard_per_cp_group(loader, num_shards: int, index: int) -> None:
    """Make accelerate's prepared ``loader`` yield the batches of data-parallel shard ``index`` of ``num_shards``
    (one per CP group), not of its process index among every rank: its batch sampler's (or iterable dataset's)
    shard, the attributes transformers' own ``BatchRebalanceSampler`` path resets the same way."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = num_shards, index
            return
    raise ValueError(
        f"{type(loader).__name__}: accelerate shards this data loader over every rank, counting the CP ranks as "
        "data-parallel, and ringmaster found no batch-sampler or iterable shard to shard per CP group instead "
        "(dispatch_batches=True?); every rank of a CP group needs the same batch: use accelerate's "
        "ParallelismConfig(cp_size=...) with FSDP2, or a map-style dataset without batch dispatching")


class _PackingCheckView:
    """While SFTTrainer.__init__ runs its "packing is not compatible with context parallelism"
    check, hide accelerate's ``cp_enabled`` (ringmaster keeps packed documents apart)."""

    _classes: dict = {}

    @classmethod
    def hide(cls, pc):
        base = type(pc)
        sub = cls._classes.get(base)
        if sub is None:
            sub = type(f"RingmasterOwned{base.__name__}", (base,), {"cp_enabled": property(lambda self: False)})
            cls._classes[base] = sub
        pc.__class__ = sub
        return lambda: setattr(pc, "__class__", base)


class CPSFTTrainer(SFTTrainer):
    """``SFTTrainer`` with ringmaster context parallelism.

    Extra arguments (everything else is ``SFTTrainer``'s):
      ringmaster_config: a :class:`~ringmaster.RingmasterConfig` (default: ``size`` from accelerate's
          ``cp_size``, else the world size). Ignored when the model is already wired (``rm.wire``).
      device_mesh: the mesh whose ``cp`` dim is the CP group (default: accelerate's mesh when its
          ParallelismConfig has ``cp_size > 1``, else the whole world).
      cp_loss: ``"chunked_nll"`` (default) or ``"trl"`` (trl's fused LM head).
      loss_chunk_size: tokens per chunk for ``chunked_nll``.
    """

    def __init__(self, *args, ringmaster_config=None, device_mesh=None, cp_loss: str = "chunked_nll",
                 loss_chunk_size: int = 1024, **kwargs):
        if cp_loss not in ("chunked_nll", "trl"):
            raise ValueError(f"cp_loss={cp_loss!r}: use 'chunked_nll' or 'trl'")
        self._rm_restores: list = []
        self.cp_loss = cp_loss
        self.loss_chunk_size = loss_chunk_size
        try:
            super().__init__(*args, **kwargs)
        finally:
            for restore in reversed(getattr(self, "_rm_packing_restore", [])):
                restore()
        self._rm_setup(ringmaster_config, device_mesh)

    # --- setup ---------------------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        pc = getattr(self.accelerator, "parallelism_config", None)
        self._rm_packing_restore = []
        if pc is not None and getattr(pc, "cp_enabled", False):
            self._rm_packing_restore.append(_PackingCheckView.hide(pc))

    def _rm_setup(self, cfg, device_mesh) -> None:
        from ..config import RingmasterConfig
        from ..wiring import unwire, wire

        from ..sharding.batch import ContextParallelContextManager
        from .accelerate import disable_torch_cp

        model = self.accelerator.unwrap_model(self.model)
        pc = getattr(self.accelerator, "parallelism_config", None)
        if device_mesh is None and pc is not None and getattr(pc, "cp_enabled", False):
            device_mesh = self.accelerator.torch_device_mesh
        runtime = getattr(model, "_ringmaster_runtime", None)
        if getattr(text_config(model.config), "output_router_logits", False):
            self._rm_router_loss(model, wire_now=runtime is None)
        if runtime is None:
            if cfg is None:
                size = pc.cp_size if pc is not None and pc.cp_enabled else dist.get_world_size()
                cfg = RingmasterConfig(size=size)
            runtime = wire(model, cfg, device_mesh=device_mesh)
            self._rm_restores.append(lambda: unwire(model))
            self._rm_wired = True
        if pc is not None and pc.cp_enabled and pc.cp_size != runtime.cp_size:
            raise ValueError(f"accelerate cp_size={pc.cp_size} but ringmaster's CP group has {runtime.cp_size} ranks")
        self.cp_runtime = runtime
        self._rm_restores.append(disable_torch_cp(self.accelerator, self))
        if self.cp_loss == "chunked_nll":
            self._rm_restores.append(_install_chunked_loss(model, self.loss_chunk_size))
        manager = ContextParallelContextManager([model], runtime.cp_group,
                                                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                                                load_balance=runtime.shard_load_balance)
        handles = manager.install()
        self._rm_restores.append(lambda: [h.remove() for h in handles])
        self.cp_manager = manager
        self._rm_data_shards = _data_parallel_shards(self.accelerator, pc, runtime)

    def _get_dataloader(self, *args, **kwargs):
        """The Trainer's data loader, sharded per CP group where accelerate shards it over every rank."""
        loader = super()._get_dataloader(*args, **kwargs)
        shards = getattr(self, "_rm_data_shards", None)
        if shards is not None:
            _shard_per_cp_group(loader, *shards)
        return loader

    def _rm_router_loss(self, model, wire_now: bool) -> None:
        """The MoE router loss under CP: ringmaster's chunked head adds it (summed over the group); trl's fused LM
        head computes it over each shard (it imports mixtral's load_balancing_loss_func inside its forward, which
        rm.wire cannot route), so that head is refused, and, when this trainer wires the model, taken off the
        instance for the wiring (the chunked head never calls it) and put back after."""
        if self.cp_loss == "trl" or self.compute_loss_func is not None or self.label_smoother is not None:
            raise UnsupportedLayerError(
                f"{type(model).__name__}: output_router_logits=True with trl's own loss path (cp_loss='trl', a "
                "compute_loss_func or label smoothing): trl's fused LM head computes the MoE router loss over each CP "
                "shard only; use cp_loss='chunked_nll' (ringmaster's head adds the router loss over the whole group) "
                "or set output_router_logits=False")
        fused = vars(model).get("forward")
        code = getattr(getattr(fused, "__func__", fused), "__code__", None)
        if wire_now and code is not None and getattr(code, "co_qualname", "").startswith("add_fused_lm_head."):
            del model.forward
            self._rm_restores.append(lambda: setattr(model, "forward", fused))

    def remove_context_parallel(self) -> None:
        """Undo the hooks, per-instance overrides and (if this trainer wired it) the wiring."""
        wired = getattr(self, "_rm_wired", False)
        while self._rm_restores:
            self._rm_restores.pop()()
        if wired:
            from ..runtime import teardown

            teardown()
            self._rm_wired = False

    # --- loss ----------------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples: list, device) -> torch.Tensor | None:
        if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            return None
        return cp_num_items_in_batch(self, batch_samples, device, self.cp_runtime.cp_group, self.cp_runtime.cp_size)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.cp_loss == "trl" or self.compute_loss_func is not None or self.label_smoother is not None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
        # eval passes no count: the pre-hook then takes the full batch's (global tokens / P)
        outputs = model(**inputs, ringmaster_chunked_loss=True,
                        **({"num_items_in_batch": num_items_in_batch} if num_items_in_batch is not None else {}))
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if mode == "train":
            ref = inputs.get("input_ids", inputs.get("position_ids"))
            self._total_train_tokens += int(ref.shape[0] * ref.shape[-1])
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if return_outputs:
            with torch.no_grad():
                outputs = model(**inputs)
            return loss, outputs
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is not None:
            loss = reduce_mean(loss.float(), self.cp_runtime.cp_group)   # on the group's device
        return loss, logits, labels


from .grpo import CPGRPOTrainer  # noqa: E402  (after SFTTrainer's import guard: one trl error message)

__all__ = ["CPGRPOTrainer", "CPSFTTrainer", "cp_num_items_in_batch"]

