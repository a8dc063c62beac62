"""Jobs for tests/test_logprobs.py: ``rm.token_logprobs`` and ``CPGRPOTrainer`` against the same model
without CP, in float64 (per-parameter exactness through the hybrids' recurrent kernels)."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import types

import torch
import torch.distributed as dist

import ringmaster as rm

# trainers and world barriers: every rank of the pool
# (ringmaster_tools.pool.RankContext: this module's jobs are never solo)
ALL_GROUPS = True

BACKENDS = {"ulysses": dict(backend="ulysses"), "ring": dict(backend="ring", load_balance="head_tail")}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    from ringmaster_tools.parity import rel_err

    return float("inf") if tuple(a.shape) != tuple(b.shape) else rel_err(a, b)


def reference_logprobs(model, batch, temperature: float = 1.0):
    """Full logits, ``log_softmax``, the shifted label's value and the entropy (0 where the label is -100)."""
    from ringmaster.sharding.batch import shift_labels

    labels = shift_labels(batch["labels"])
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    keep = labels != -100
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    ent = -(logp.exp() * logp).sum(-1) * keep
    return lp, ent


def _mutate(kind: str | None):
    """``order``: the gather puts the shards back in contiguous order whatever the layout; ``local``: no gather
    (each rank keeps its shard's values). Both patch ``ringmaster.sharding.logprobs.gather_sequence``."""
    from ringmaster.sharding import logprobs

    if kind is None:
        return lambda: None
    original = logprobs.gather_sequence
    if kind == "order":
        def mutated(local, dim=1, group=None, layout=None, runtime=None):
            return original(local, dim=dim, group=group, layout="contiguous")
    elif kind == "local":
        def mutated(local, dim=1, group=None, layout=None, runtime=None):
            return local
    else:
        raise ValueError(kind)
    logprobs.gather_sequence = mutated
    return lambda: setattr(logprobs, "gather_sequence", original)


def logprob_parity(ctx, P, cases, seq_len=32, chunk_size=7, temperature=0.7, mutation=None):
    """For each ``(model_type, backend)``: ``token_logprobs`` (with entropy) on the CP shard of a wired fp64
    model vs the full logits of the same weights without CP; the loss ``sum(w1 * logp) + sum(w2 * entropy)``
    (random fixed weights, computed identically on every rank from the gathered values) backpropagated,
    every parameter's CP-group-mean gradient against its own reference norm."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import group_mean_grad_errors, keep_fp64, tiny_batch, tiny_model

    out = {}
    undo = _mutate(mutation)
    try:
        with keep_fp64():
            for model_type, backend in cases:
                model = tiny_model(model_type, dtype=torch.float64)
                reference = copy.deepcopy(model)
                batch = tiny_batch(model.config.vocab_size, seq_len, batch_size=2, seed=3)
                g = torch.Generator().manual_seed(11)
                w1, w2 = (torch.randn(2, seq_len, generator=g, dtype=torch.float64) for _ in range(2))
                ref_lp, ref_ent = reference_logprobs(reference, batch, temperature)
                ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()

                runtime = rm.wire(model, rm.RingmasterConfig(size=P, **BACKENDS[backend]), device_mesh=ctx.mesh(P))
                try:
                    with context_parallel_region(batch, runtime=runtime) as shard:
                        labels = shard.pop("shift_labels")
                        for key in ("labels", "num_items_in_batch"):
                            shard.pop(key)
                        hidden = model(**shard, output_hidden_states=True, logits_to_keep=1)
                        lp, ent = rm.token_logprobs(hidden, labels, model=model, batch=shard, entropy=True,
                                                    chunk_size=chunk_size, temperature=temperature)
                    if lp.shape == w1.shape:
                        ((lp * w1).sum() + (ent * w2).sum()).backward()
                    else:   # the "local" mutation: still run every rank's backward (no rank may hang)
                        ((lp * w1[:, :lp.shape[1]]).sum() + (ent * w2[:, :lp.shape[1]]).sum()).backward()
                    errs, missing, _ = group_mean_grad_errors(model, reference, runtime.cp_group, P)
                finally:
                    rm.unwire(model)
                    rm.teardown()
                worst = max(errs, key=errs.get)
                out[f"{model_type}/{backend}"] = {
                    "layout": runtime.shard_load_balance, "recurrent": len(runtime.report.recurrent),
                    "lp_err": _err(lp.detach(), ref_lp.detach()), "ent_err": _err(ent.detach(), ref_ent.detach()),
                    "grad_err": errs[worst], "worst_param": worst, "n_grads": len(errs), "missing": missing,
                    "n_params": sum(1 for _ in reference.parameters())}
    finally:
        undo()
    return out


# -- GRPO ------------------------------------------------------------------------------------


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def grpo_inputs(vocab: int, B: int = 4, prompt: int = 6, completion: int = 9, seed: int = 7):
    """A fixed GRPO batch as ``_generate_and_score_completions`` leaves it: left-padded prompts, right-padded
    completions (prompt + completion = 15 tokens: the trainer pads the row to the shard count)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (B, prompt), generator=g)
    prompt_mask = torch.ones(B, prompt, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[3, :1] = 0
    completion_ids = torch.randint(3, vocab, (B, completion), generator=g)
    completion_mask = torch.ones(B, completion, dtype=torch.long)
    completion_mask[0, 6:] = 0
    completion_mask[2, 4:] = 0
    prompt_ids[prompt_mask == 0] = 0
    completion_ids[completion_mask == 0] = 0
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.randn(B, generator=g, dtype=torch.float64),
            "num_items_in_batch": completion_mask.sum().double()}


def full_logit_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                     compute_aux_loss=False, **multimodal):
    """GRPOTrainer's ``_get_per_token_logps_and_entropies`` by its definition, without trl's fused head
    (which accumulates in float32 even for a float64 model): full logits / temperature, ``log_softmax``,
    the next token's value and the entropy, 0 where trl masks (padding, the prompt)."""
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    labels = labels[:, 1:]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits / self.temperature, dim=-1)
    keep = labels != -100
    lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    ent = -(logp.exp() * logp).sum(-1) * keep
    return lp[:, -logits_to_keep:], (ent[:, -logits_to_keep:] if compute_entropy else None), None


def grpo_loss_parity(ctx, P, cases):
    """For each ``(model_type, backend)``: one GRPO loss (dapo, beta=0.1: policy, reference and old-policy
    log-probs, clipping, KL, the entropy metric) and its gradient, ``CPGRPOTrainer`` vs ``GRPOTrainer``
    without CP, on fixed completions, called as the trainer calls them (``_get_per_token_logps_and_entropies``
    for the reference model and the old policy, then ``_compute_loss``). The non-CP trainer's log-probs are
    computed by their definition in float64 (:func:`full_logit_logps`): trl's fused head accumulates in
    float32, so it is checked against that definition separately (``trl_head_err``). Generation is not
    driven: the CP trainer cannot generate with the wired policy (vLLM or a rollout_func supplies it)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from jobs_adapters import tiny_tokenizer
    from ringmaster.adapters.grpo import CPGRPOTrainer
    from ringmaster_tools.parity import group_mean_grad_errors, keep_fp64, rel_err, tiny_model

    tok = tiny_tokenizer()
    data = Dataset.from_list([{"prompt": "t5 t6 t7"}] * 4)
    out = {}
    # transformers saves on world rank 0 only: one directory for every rank
    shared = [tempfile.mkdtemp(prefix="rm_grpo_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    tmp = shared[0]
    for model_type, _ in cases:
        if dist.get_rank() == 0:
            tiny_model(model_type, dtype=torch.float64).save_pretrained(os.path.join(tmp, model_type))
    dist.barrier()
    with keep_fp64():
        for model_type, backend in cases:
            path = os.path.join(tmp, model_type)

            def build(cls, **kw):
                from transformers import AutoModelForCausalLM

                args = GRPOConfig(output_dir=os.path.join(tmp, f"out{dist.get_rank()}"), per_device_train_batch_size=4,
                                  num_generations=4, beta=0.1, temperature=0.8, use_cpu=True, report_to=[],
                                  max_completion_length=9,
                                  model_init_kwargs={"dtype": torch.float64, "attn_implementation": "sdpa"},
                                  save_strategy="no", bf16=False, epsilon=0.05)
                policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
                g = torch.Generator().manual_seed(5)   # the policy moved away from the reference: the KL has a gradient
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02 * p.abs().mean())
                trainer = cls(model=policy, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                              train_dataset=data, processing_class=tok, **kw)
                trainer.current_gradient_accumulation_steps = 1
                return trainer

            def step(trainer, inputs):
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
                k = inputs["completion_ids"].shape[1]
                with torch.no_grad():
                    ref_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, k)
                    old_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k, batch_size=2)
                g = torch.Generator().manual_seed(9)   # an off-policy batch: ratios away from 1, some clipped
                noise = 0.1 * torch.randn(old_lp.shape, generator=g, dtype=torch.float64)
                inputs = {**inputs, "ref_per_token_logps": ref_lp, "old_per_token_logps": old_lp + noise}
                with torch.no_grad():
                    lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k,
                                                                            compute_entropy=True)
                loss = trainer._compute_loss(trainer.model, inputs)
                loss.backward()
                return loss.detach(), ref_lp, old_lp, lp, ent

            reference = build(GRPOTrainer)
            inputs = grpo_inputs(reference.model.config.vocab_size)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():   # trl's own fused head, float32 inside
                k = inputs["completion_ids"].shape[1]
                trl_lp, trl_ent, _ = reference._get_per_token_logps_and_entropies(reference.model, ids, mask, k,
                                                                                  compute_entropy=True)
            reference._get_per_token_logps_and_entropies = types.MethodType(full_logit_logps, reference)
            ref_loss, ref_ref_lp, ref_old_lp, ref_lp_, ref_ent = step(reference, inputs)
            _reset_accelerate()
            cp_trainer = build(CPGRPOTrainer, ringmaster_config=rm.RingmasterConfig(size=P, **BACKENDS[backend]),
                               device_mesh=ctx.mesh(P))
            try:
                group = cp_trainer.cp_runtime.cp_group
                wired = [m for m in (cp_trainer.model, cp_trainer.ref_model) if rm.runtime_of(m) is not None]
                loss, ref_lp, old_lp, lp_, ent = step(cp_trainer, inputs)
                errs, missing, _ = group_mean_grad_errors(cp_trainer.model, reference.model, group, P)
            finally:
                cp_trainer.remove_context_parallel()
                _reset_accelerate()
            worst = max(errs, key=errs.get)
            out[f"{model_type}/{backend}"] = {
                "wired_models": len(wired), "loss": float(ref_loss), "loss_err": rel_err(loss, ref_loss),
                "ref_lp_err": rel_err(ref_lp, ref_ref_lp), "lp_err": rel_err(lp_, ref_lp_),
                "ent_err": rel_err(ent, ref_ent), "old_lp_err": rel_err(old_lp, ref_old_lp),
                "trl_head_err": max(rel_err(trl_lp, ref_lp_), rel_err(trl_ent, ref_ent)),
                "grad_err": errs[worst], "worst_param": worst, "n_grads": len(errs), "missing": missing,
                "restored": rm.runtime_of(cp_trainer.model) is None and rm.runtime.active(required=False) is None}
            del reference, cp_trainer
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
