"""Pool jobs for tests/test_deepspeed.py: DeepSpeed ZeRO under CP, on its CPU accelerator over gloo.

Every rank of the pool is one CP rank (world = CP group): DeepSpeed sees them as data-parallel ranks and
averages their gradients, which under ringmaster's convention (each rank's loss its share of the global loss,
``num_items_in_batch`` the group's target count / P) is the single-device gradient.
"""

from __future__ import annotations

import contextlib
import copy
import os


def _ds_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:   # partition every parameter, as a real model's sizes do (tiny ones would all persist)
        zero.update(stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}


def _launcher_env():
    """What a launcher sets (DeepSpeed reads them), and its CPU accelerator, whose collectives run on gloo (no
    shared-memory op compiled: ``ringmaster_tools.pool.without_deepspeed_shm_comm``)."""
    import torch.distributed as dist

    from ringmaster_tools.pool import without_deepspeed_shm_comm

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    without_deepspeed_shm_comm()
    for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size()),
                       ("LOCAL_SIZE", dist.get_world_size())):
        os.environ[key] = str(value)


def _cp_step(model, batch, group, P, backward):
    """One CP step of a wired ``model`` (or a DeepSpeed engine: ``backward(loss)``); the group's mean loss."""
    import torch.distributed as dist

    from ringmaster.adapters.raw import context_parallel_region

    with context_parallel_region(batch) as shard:
        out = model(**shard)
    backward(out.loss)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss / P


def zero_parity(ctx, model_name: str, backend: str = "ulysses", stage: int = 3, when: str = "after",
                probe_gathers: bool = True, seq_len: int = 64) -> dict:
    """One CP step of a tiny ``model_name`` (``ringmaster_tools.step_shape.MODELS``) under DeepSpeed ZeRO ``stage``
    against the same weights without DeepSpeed: the loss against the model without CP, every parameter's gradient
    against the same CP step without DeepSpeed (the same chunks, so the same rounding: transformers' gated-DeltaNet
    kernel computes in fp32 whatever its inputs) and, for the record, against the model without CP, each against its
    own norm. ``when``: ``"before"`` wires the model before ``deepspeed.initialize``, ``"after"`` wires
    ``engine.module`` after it, ``"zero_init"`` builds the model partitioned by HF's ``zero.Init`` (what
    ``Trainer(deepspeed=...)`` and axolotl do) and wires it before ``deepspeed.initialize``. ``probe_gathers=False``
    is the mutation: the wire-time probe of the recurrent layers runs on parameters ZeRO-3 has not gathered."""
    _launcher_env()
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import ringmaster as rm
    from ringmaster import compat
    from ringmaster_tools import step_shape
    from ringmaster_tools.parity import rel_err, tiny_batch

    mesh = ctx.mesh(2)
    group = mesh.get_group("cp")
    P = dist.get_world_size(group)
    config = _ds_config(stage)
    cfg = step_shape._cfg(backend, P)
    keep = HfDeepSpeedConfig(config) if when == "zero_init" else None   # HF builds the model under zero.Init
    torch.manual_seed(0)
    model = step_shape._model(model_name)
    if keep is not None:
        unset_hf_deepspeed_config()
    # the same weights, whole: the model without CP, and the same CP step without DeepSpeed
    ref = step_shape._model(model_name)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        for name, p in model.named_parameters():
            ref.get_parameter(name).data.copy_(p.data)
    batch = tiny_batch(ref.config.vocab_size, seq_len)
    plain = copy.deepcopy(ref)
    ref_out = ref(**batch)
    ref_out.loss.backward()
    rm.wire(plain, cfg, device_mesh=mesh)
    _cp_step(plain, batch, group, P, lambda loss: loss.backward())
    rm.unwire(plain)
    gathered = compat.zero3_gathered
    if not probe_gathers:
        compat.zero3_gathered = lambda module: contextlib.nullcontext()
    try:
        if when in ("before", "zero_init"):
            rm.wire(model, cfg, device_mesh=mesh)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=config, dist_init_required=False)
        if when == "after":
            rm.wire(engine.module, cfg, device_mesh=mesh)
    finally:
        compat.zero3_gathered = gathered
    partitioned = stage == 3 and any(getattr(p, "ds_numel", 0) and p.data.numel() < p.ds_numel
                                     for p in engine.module.parameters())
    loss = _cp_step(engine, batch, group, P, engine.backward)
    grads, truth, missing = {}, {}, []
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is None:
            missing.append(name)
            continue
        mean = plain.get_parameter(name).grad.clone()
        dist.all_reduce(mean, group=group)
        grads[name] = rel_err(g, mean / P)
        truth[name] = rel_err(g, ref.get_parameter(name).grad)
    rm.unwire(engine.module)
    engine.destroy()
    return {"loss": rel_err(loss, ref_out.loss), "grads": grads, "truth": max(truth.values()), "missing": missing,
            "partitioned": partitioned, "params": len(grads)}


def mismatched_batches(ctx) -> str:
    """A DeepSpeed ZeRO-1 engine whose ranks (one CP group) each get their own batch, as DeepSpeed's loader and the
    HF Trainer with ``deepspeed=`` hand them out: the error this rank raised, before any collective of the step."""
    _launcher_env()
    import deepspeed
    import torch

    import ringmaster as rm
    from ringmaster.validation import InputMismatchError
    from ringmaster_tools import step_shape
    from ringmaster_tools.parity import tiny_batch

    mesh = ctx.mesh(2)
    torch.manual_seed(0)
    model = step_shape._model("llama")
    rm.wire(model, step_shape._cfg("ulysses", 2), device_mesh=mesh)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=_ds_config(1), dist_init_required=False)
    batch = tiny_batch(model.config.vocab_size, 64, seed=1 + torch.distributed.get_rank())   # a batch per rank
    try:
        _cp_step(engine, batch, mesh.get_group("cp"), 2, engine.backward)
        return "ran"
    except InputMismatchError as exc:
        return str(exc)
    finally:
        rm.unwire(engine.module)
        engine.destroy()


LAUNCHER_KEYS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_SIZE", "ACCELERATE_USE_DEEPSPEED")


def sft_deepspeed(ctx, stage: int = 2, model_type: str = "llama", steps: int = 3) -> dict:
    """CPSFTTrainer with ``deepspeed=`` (ZeRO ``stage``, the HF Trainer's own DeepSpeed path through accelerate, on
    DeepSpeed's CPU accelerator) against CPSFTTrainer without DeepSpeed (one process as accelerate sees it, the
    gradients averaged over the CP group by hand: tests/test_adapters_trl.py checks that run against SFTTrainer
    without CP): ``steps`` SGD steps, per-step losses (the CP group's mean) and the final weights. DeepSpeed's engine
    averages the gradients over both ranks (its data-parallel world). On a CPU host accelerate's DeepSpeed state
    counts one process, so it does not shard the data and ``shards`` is None; on a GPU host it counts every rank and
    CPSFTTrainer shards the data per CP group (tests/test_adapters_trl.py, at the data loader)."""
    import tempfile

    import torch.distributed as dist
    from datasets import Dataset
    from deepspeed.utils import safe_get_full_fp32_param
    from trl import SFTConfig

    import ringmaster as rm
    from jobs_adapters import _reset_accelerate, cp_mean, features, tiny_tokenizer, training_errors
    from ringmaster.adapters.trl import CPSFTTrainer
    from ringmaster_tools.parity import tiny_model

    mesh = ctx.mesh(2)
    group = mesh["cp"].get_group()
    P = dist.get_world_size(group)
    tok = tiny_tokenizer()
    rows = features([64, 40, 56, 64, 48, 64], seed=5)
    data = Dataset.from_list([{"input_ids": r["input_ids"], "completion_mask": [0] * 5 + [1] * (len(r["input_ids"]) - 5)}
                              for r in rows])

    def run(deepspeed: bool, tmp):
        for key in LAUNCHER_KEYS:
            os.environ.pop(key, None)
        if deepspeed:
            _launcher_env()
        model = tiny_model(model_type)
        # no train_batch_size: DeepSpeed computes micro x accumulation x world, every rank counted as data-parallel
        # (on a CPU host accelerate counts one process under DeepSpeed, so HF's "auto" would give micro x accumulation)
        config = {**_ds_config(stage), "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                  "gradient_clipping": "auto"}
        config.pop("train_batch_size", None)
        args = SFTConfig(output_dir=tmp, per_device_train_batch_size=2, max_steps=steps, learning_rate=0.5, optim="sgd",
                         lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                         report_to=[], use_cpu=not deepspeed, logging_steps=1, save_strategy="no", seed=0, data_seed=0,
                         dataloader_drop_last=True, max_length=None, pad_to_multiple_of=8 * P, dataset_num_proc=None,
                         completion_only_loss=True, average_tokens_across_devices=True, remove_unused_columns=True,
                         bf16=False, deepspeed=config if deepspeed else None)
        trainer = CPSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                               ringmaster_config=rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=mesh)
        losses, original = [], trainer.training_step

        def training_step(*a, **k):
            loss = original(*a, **k)
            if not deepspeed:   # DeepSpeed averages the gradients over its data-parallel ranks, the CP group here
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                        p.grad /= P
            losses.append(cp_mean(loss, group, P))
            return loss

        trainer.training_step = training_step
        trainer.train()
        shards = getattr(trainer, "_rm_data_shards", None)
        weights = {n: (safe_get_full_fp32_param(p) if deepspeed else p).detach().clone()
                   for n, p in trainer.model.named_parameters()}
        trainer.remove_context_parallel()
        if deepspeed:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            trainer.model_wrapped.destroy()
            unset_hf_deepspeed_config()   # the Trainer's ZeRO-3 config would build later models under zero.Init
        _reset_accelerate()
        for key in LAUNCHER_KEYS:
            os.environ.pop(key, None)
        return weights, losses, shards

    with tempfile.TemporaryDirectory() as tmp:
        ref_w, ref_losses, _ = run(False, os.path.join(tmp, "plain"))
        ds_w, losses, shards = run(True, os.path.join(tmp, "ds"))
    return {**training_errors(ds_w, losses, ref_w, ref_losses, tiny_model(model_type)), "shards": shards}


def shm_comm(ctx) -> dict:
    """DeepSpeed's communication started on this pool's ranks as every job here starts it (:func:`_launcher_env`):
    whether DeepSpeed built its shared-memory all-reduce op, and the buffers in /dev/shm named for this pool's port."""
    import deepspeed
    import torch.distributed as dist

    from ringmaster_tools.pool import deepspeed_shm_buffers

    _launcher_env()
    deepspeed.comm.init_distributed(dist_backend="gloo")
    dist.barrier()
    return {"op_built": deepspeed.comm.comm.cdb.shm_comm_op is not None,
            "buffers": deepspeed_shm_buffers(int(os.environ["MASTER_PORT"]))}
