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
    """What a launcher sets (DeepSpeed reads them), and its CPU accelerator."""
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
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
    return {"loss": rel_err(loss, ref_out.loss), "grad": max(grads.values()), "truth": max(truth.values()),
            "missing": missing, "partitioned": partitioned, "params": len(grads),
            "worst": max(grads, key=grads.get)}


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
