"""trl: ``CPGRPOTrainer``, a ``GRPOTrainer`` whose policy and reference model score completions under CP.

GRPO needs, for every prompt+completion row, the log-probability of each completion token under the
policy (with gradient), under the reference model (KL term) and under the policy that generated it
(importance ratio). trl computes all three in ``_get_per_token_logps_and_entropies`` with its fused LM
head on the whole row. This class overrides that one method:

- the row (prompt + completion, right-padded to a multiple of the shard count) is cut into this rank's
  shard by ringmaster's pre-hook (:class:`~ringmaster.ContextParallelContextManager`: shifted labels,
  global document structure from the attention mask, a check that every CP rank holds the same batch);
- the model runs its backbone on the shard and :func:`ringmaster.token_logprobs` projects only the
  completion tokens through the LM head in chunks (temperature, soft-capping and logit scale as the
  model has them), gathering ``[B, S]`` values in global order;
- trl's loss then runs unchanged on the gathered ``[B, completion]`` tensors, identically on every rank;
  the gather's backward returns each token's gradient to its owner, so the mean over the CP group of
  each rank's gradients is the single-device gradient (what DDP/FSDP2 averaging over the cp dim does).

The policy and the reference model are both wired (two runtimes in one process), each with its own
hooks. Generation is *not* sharded: a wired model cannot run ``generate`` (its attention needs the
shard's batch structure), so completions must come from vLLM (``use_vllm=True``, server or colocate)
or a ``rollout_func``; every rank of a CP group must receive the same completions (the pre-hook
refuses a batch the ranks disagree on). Multimodal inputs and the MoE auxiliary loss are refused.
trl's cross-process statistics see each CP group's batch P times: token-weighted means and the dapo
token count are unchanged, but ``top_entropy_quantile < 1`` takes its quantile over the repeated values
(linear interpolation between them moves slightly); that option is not checked under CP.
Checked on CPU (gloo) against ``GRPOTrainer`` without CP on fixed completions; not yet run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - trl is an optional extra
    raise ImportError("ringmaster.adapters.grpo needs trl: pip install 'axolotl-ringmaster[trl]'") from exc

from transformers.utils import ModelOutput

from ..errors import UnsupportedLayerError
from ..runtime import runtime_of
from ..sharding import balancers
from ..sharding.batch import ContextParallelContextManager
from ..sharding.documents import BATCH_KWARG
from ..sharding.logprobs import token_logprobs
from .head_forward import install_head_forward


@dataclass
class TokenLogprobsOutput(ModelOutput):
    """``log_probs`` / ``entropy``: ``[B, S]`` in global token order (position t scores token t+1; 0 where
    the label is -100)."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def install_logprob_forward(model, temperature: float = 1.0, chunk_size: int = 1024):
    """Give ``model.forward`` a ``ringmaster_token_logprobs=True`` mode: backbone on the shard, then
    :func:`token_logprobs` over the shard's ``shift_labels`` (``ringmaster_entropy=True`` adds entropies).

    Per instance, like trl's fused head (which it wraps, and which the other calls still reach). The
    call goes through the top module, so ringmaster's pre-hooks (shard, recurrent batch, first-forward
    ledger) and FSDP2's root hooks run. Returns ``restore()``.
    """
    def head(model, out, shift, kwargs, num_items, ringmaster_entropy=False):
        result = token_logprobs(out, shift, model=model, batch=kwargs.get(BATCH_KWARG), runtime=runtime_of(model),
                                temperature=temperature, chunk_size=chunk_size, entropy=ringmaster_entropy)
        logps, ent = result if ringmaster_entropy else (result, None)
        return TokenLogprobsOutput(log_probs=logps, entropy=ent)

    return install_head_forward(model, "ringmaster_token_logprobs", head, options=("ringmaster_entropy",))


_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class CPGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose per-token log-probs (policy, reference, old policy) are computed under CP.

    Extra arguments (everything else is ``GRPOTrainer``'s):
      ringmaster_config: a :class:`~ringmaster.RingmasterConfig` for the models this trainer wires
          (default: ``size`` = the world size). A model already wired (``rm.wire``) keeps its runtime.
      device_mesh: the mesh whose ``cp`` dim is the CP group (default: the whole world).
      logprob_chunk_size: tokens per chunk through the LM head (:func:`ringmaster.token_logprobs`).
    """

    def __init__(self, *args, ringmaster_config=None, device_mesh=None, logprob_chunk_size: int = 1024, **kwargs):
        self._rm_restores: list = []
        self._rm_wired: list = []
        self.logprob_chunk_size = logprob_chunk_size
        super().__init__(*args, **kwargs)
        try:
            self._rm_setup(ringmaster_config, device_mesh)
        except BaseException:
            self.remove_context_parallel()
            raise

    def _rm_setup(self, cfg, device_mesh) -> None:
        from ..config import RingmasterConfig
        from ..wiring import wire

        from .accelerate import disable_torch_cp

        models = [self.accelerator.unwrap_model(self.model)]
        if self.ref_model is not None:
            models.append(self.accelerator.unwrap_model(self.ref_model))
        for model in models:
            runtime = getattr(model, "_ringmaster_runtime", None)
            if runtime is None:
                config = cfg if cfg is not None else RingmasterConfig(size=torch.distributed.get_world_size())
                runtime = wire(model, config, device_mesh=device_mesh)
                self._rm_wired.append(model)
            self._rm_restores.append(install_logprob_forward(model, self.temperature, self.logprob_chunk_size))
            manager = ContextParallelContextManager([model], runtime.cp_group, load_balance=runtime.shard_load_balance)
            handles = manager.install()
            self._rm_restores.append(lambda handles=handles: [h.remove() for h in handles])
        self._rm_restores.append(disable_torch_cp(self.accelerator, self))
        self.cp_runtime = runtime_of(models[0])

    def remove_context_parallel(self) -> None:
        """Undo the hooks and per-instance forwards, and unwire the models this trainer wired."""
        from ..runtime import teardown
        from ..wiring import unwire

        while self._rm_restores:
            self._rm_restores.pop()()
        wired = bool(self._rm_wired)
        while self._rm_wired:
            unwire(self._rm_wired.pop())
        if wired:   # a runtime the caller set up (a model wired before) stays
            teardown()

    def _generate_single_turn(self, *args, **kwargs):
        if not self.use_vllm and getattr(self, "rollout_func", None) is None:
            raise NotImplementedError(
                "CPGRPOTrainer cannot generate with the wired policy (transformers' generate would run CP attention "
                "on unsharded decoding steps); generate with vLLM (GRPOConfig(use_vllm=True), server or colocate) "
                "or pass a rollout_func, so every CP rank scores the same completions")
        return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """trl's method under CP: ``([B, logits_to_keep] log-probs, entropies or None, None)``, the same on
        every rank of the CP group."""
        given = sorted(k for k, v in extra.items() if v is not None)
        unknown = sorted(set(extra) - set(_MULTIMODAL))
        if given or unknown:
            raise NotImplementedError(f"CPGRPOTrainer scores text-only batches; got {given or unknown}: train "
                                      "multimodal GRPO without CP")
        if compute_aux_loss:
            raise UnsupportedLayerError(
                "the MoE auxiliary load-balancing loss is a per-sequence statistic each rank would compute over its "
                "shard only; set router_aux_loss_coef=0 / output_router_logits=False for CP GRPO")
        runtime = runtime_of(self.accelerator.unwrap_model(model))
        if runtime is None:
            raise RuntimeError(f"{type(model).__name__} scores CP shards but is not wired; CPGRPOTrainer wires the "
                               "policy and the reference model it holds")
        parts = runtime.cp_size * balancers.chunks_per_rank(runtime.shard_load_balance)
        S = input_ids.shape[1]
        pad = (-S) % parts   # right padding (mask 0, label -100) leaves every earlier token's value unchanged
        pad_id = getattr(self, "pad_token_id", None) or 0
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, :-logits_to_keep] = -100   # only the completion tokens are scored
            if pad:
                ids = F.pad(ids, (0, pad), value=pad_id)
                mask = F.pad(mask, (0, pad), value=0)
                labels = F.pad(labels, (0, pad), value=-100)
            with self.accelerator.autocast():
                out = model(input_ids=ids, attention_mask=mask, labels=labels, ringmaster_token_logprobs=True,
                            ringmaster_entropy=compute_entropy)
            # position t holds log p(token t+1): the completion's tokens S-k .. S-1 sit at S-k-1 .. S-2
            logps.append(out.log_probs[:, S - 1 - logits_to_keep:S - 1])
            if compute_entropy:
                entropies.append(out.entropy[:, S - 1 - logits_to_keep:S - 1])
        return torch.cat(logps, 0), (torch.cat(entropies, 0) if compute_entropy else None), None


__all__ = ["CPGRPOTrainer", "TokenLogprobsOutput", "install_logprob_forward"]
