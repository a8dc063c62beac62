"""Adapter jobs the gloo pool runs on every rank: axolotl 0.21's plugin, accelerate + FSDP2, trl.

Every job compares against the same model run without CP in the same process (fp32).
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist

import ringmaster as rm

# trainers, accelerate meshes and FSDP2 over dp x cp: every rank of the pool
# (ringmaster_tools.pool.RankContext: this module's jobs are never solo)
ALL_GROUPS = True

# -- helpers ---------------------------------------------------------------------------------


def tiny_tokenizer(vocab_size: int = 128):
    """An in-memory word-level tokenizer (no network): token ``t<i>`` has id i, pad id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="t3")
    fast.padding_side = "right"
    return fast


def features(lengths, vocab_size=128, seed=3, prompt=5):
    """Rows of input_ids / attention_mask / labels (the first ``prompt`` tokens unsupervised)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        labels = list(ids)
        labels[:prompt] = [-100] * prompt
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": labels})
    return rows


def accelerate_mesh(ctx, cp: int):
    """accelerate's own mesh for ParallelismConfig(dp_shard_size=W/cp, cp_size=cp) (built once per pool)."""
    key = ("accelerate", cp)
    if key not in ctx._meshes:
        from accelerate.parallelism_config import ParallelismConfig

        dp = ctx.world // cp
        pc = ParallelismConfig(dp_shard_size=dp, cp_size=cp) if dp > 1 else ParallelismConfig(cp_size=cp)
        ctx._meshes[key] = (pc, pc.build_device_mesh("cpu"))
    return ctx._meshes[key]


def grads_vs(model, reference, group, P):
    """(worst error, its parameter, parameters without a CP gradient, whole-gradient error, every
    parameter's error)."""
    from ringmaster_tools.parity import group_mean_grad_errors

    errs, missing, total = group_mean_grad_errors(model, reference, group, P)
    worst = max(errs, key=errs.get) if errs else None
    return (errs[worst] if worst else 0.0), worst, missing, total, errs


def cp_mean(value, group, P):
    t = torch.as_tensor(value, dtype=torch.float32).detach().clone()
    dist.all_reduce(t, group=group)
    return (t / P).item()


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def training_errors(weights: dict, losses: list, ref_weights: dict, ref_losses: list, initial) -> dict:
    """Two training runs compared: per-step losses and final weights (``{name: tensor}``), each weight against its
    own norm; ``weights_moved``: how far the reference moved from ``initial`` (a fresh model), so a run that did
    not train cannot pass."""
    from ringmaster_tools.parity import rel_err

    errs = {n: rel_err(weights[n], ref_weights[n]) for n in ref_weights}
    return {"losses": losses, "ref_losses": ref_losses, "weight_err": max(errs.values()),
            "worst_param": max(errs, key=errs.get),
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "weights_moved": max(rel_err(ref_weights[n], p) for n, p in initial.named_parameters())}


# -- axolotl 0.21's built-in plugin ----------------------------------------------------------


def axolotl_plugin_step(ctx, P, model_type="llama", shard_in_collator=True, overrides=None, ours=False,
                        with_ref=False, cp=None, attn="sdpa", lens=None):
    """axolotl's ContextParallelPlugin on a HF Trainer: pre_model_load, post_trainer_create, one
    training_step through the Trainer, post_train_unload.

    ``cp``: the ``context_parallel:`` block (default Ulysses); ``attn``: the model's attention as
    axolotl's ``attn_implementation`` names it. ``flash_attention_2`` names the CPU flash stand-in
    (LOCAL_KERNELS): the CP model carries the name (Ring never calls it, it picks the hub kernel),
    the non-CP reference runs sdpa, and after unload the model is checked under sdpa again.

    On CPU accelerate refuses a ParallelismConfig (it needs FSDP2 on accelerators), so each rank
    runs a non-distributed Accelerator and gets the ParallelismConfig and mesh accelerate builds
    for ``dp_shard x cp`` installed on its state -- what an FSDP2 launch gives the plugin.
    """
    from axolotl.integrations.context_parallel.plugin import ContextParallelPlugin
    from axolotl.utils.collators import DataCollatorForSeq2Seq
    from axolotl.utils.dict import DictDefault
    from transformers import Trainer, TrainingArguments

    from ringmaster_tools.parity import tiny_model

    pc, mesh = accelerate_mesh(ctx, P)
    model = tiny_model(model_type, **(overrides or {}))
    reference = copy.deepcopy(model)
    ref_model = copy.deepcopy(model) if with_ref else None   # a separate reference model (DPO/GRPO style)
    if attn != "sdpa":
        from jobs_ring import as_flash_model

        as_flash_model(model, attn)
    tok = tiny_tokenizer()
    mbs = 1 if lens else 2 if model_type == "llama" else 1
    rows = features(lens or [64, 45][:mbs])
    cfg = DictDefault({
        "context_parallel": {"size": P, "backend": "ulysses", "shard_in_collator": shard_in_collator, **(cp or {})},
        "model_config_type": model.config.model_type, "micro_batch_size": mbs, "gradient_accumulation_steps": 1,
        "attn_implementation": attn, "sample_packing": False,
    })
    if ours:  # ringmaster's own plugin: the `ringmaster:` block, rm.wire, sharding in the pre-hook
        from ringmaster.adapters.axolotl import RingmasterArgs, RingmasterPlugin

        cfg = DictDefault(RingmasterArgs.model_validate(
            {"ringmaster": {"backend": "ulysses", **(cp or {})}, "context_parallel_size": P}).model_dump())
        cfg["gradient_accumulation_steps"] = 1
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=mbs, report_to=[], use_cpu=True,
                                 average_tokens_across_devices=True, save_strategy="no")
        collator = DataCollatorForSeq2Seq(tokenizer=tok, padding=True, pad_to_multiple_of=8)
        reference_batch = collator([dict(r) for r in rows])
        ref_out = reference(**reference_batch, use_cache=False)
        ref_out.loss.backward()

        plugin = RingmasterPlugin() if ours else ContextParallelPlugin()
        plugin.pre_model_load(cfg)
        trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=rows)
        if ref_model is not None:
            trainer.ref_model = ref_model
        state = trainer.accelerator.state
        state.parallelism_config, state.device_mesh = pc, mesh
        try:
            plugin.post_trainer_create(cfg, trainer)
            runtime = plugin.runtime if ours else plugin._runtime
            out["attn"] = model.config._attn_implementation
            out["backend"], out["ring_impl"] = runtime.backend.value, getattr(runtime.ring_impl, "value", None)
            out["layout"], out["rotate"] = runtime.shard_load_balance, runtime.binding.rotate
            out["schedule"] = runtime.binding.schedule
            out["collator_shards"] = collator.cp_shard is not None
            batch = trainer.data_collator([dict(r) for r in rows])
            out["presharded"] = "_cp_shard" in batch
            num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
            out["num_items"] = float(num_items)
            out["num_items_expected"] = float(reference_batch["labels"][:, 1:].ne(-100).sum()) / P
            loss = trainer.training_step(trainer.model, batch, num_items)
            group = runtime.cp_group
            out["loss_cp"] = cp_mean(loss, group, P)
            out["loss_ref"] = ref_out.loss.item()
            out["loss_err"] = abs(out["loss_cp"] - out["loss_ref"]) / abs(out["loss_ref"])
            (out["grad_err"], out["worst_param"], out["missing"], out["grad_err_total"],
             out["grad_errs"]) = grads_vs(model, reference, group, P)
            if ref_model is not None:  # the reference model gets the same shards: it must be CP-wired too
                out["ref_wired"] = rm.runtime_of(ref_model) is not None
                with torch.no_grad():
                    ref_loss = ref_model(**trainer.data_collator([dict(r) for r in rows])).loss
                out["ref_loss_err"] = abs(cp_mean(ref_loss, group, P) - out["loss_ref"]) / abs(out["loss_ref"])
        finally:
            plugin.post_train_unload(cfg)
            state.parallelism_config, state.device_mesh = None, None
            _reset_accelerate()
        out["restored_attn"] = model.config._attn_implementation
        if attn != "sdpa" and out["restored_attn"] == attn:
            model.set_attn_implementation("sdpa")  # the flash name has no CPU kernel of transformers' own
            out["restored_attn"] = "sdpa"
        out["hooks_left"] = len(model._forward_pre_hooks)
        out["collator_restored"] = collator.cp_shard is None
        out["trainer_restored"] = "_get_num_items_in_batch" not in vars(trainer)
        out["runtime_dropped"] = rm.runtime.active(required=False) is None
        if ref_model is not None:
            out["ref_unwired"] = rm.runtime_of(ref_model) is None
        with torch.no_grad():  # the unloaded model is the plain model again
            again = model(**reference_batch, use_cache=False).logits
            out["unload_logits_err"] = (again - reference(**reference_batch, use_cache=False).logits).abs().max().item()
    return out


# -- accelerate ParallelismConfig + FSDP2 ----------------------------------------------------


def fsdp2_dp_cp(ctx, model_type="llama", attn="sdpa", overrides=None, cfg_kwargs=None, seq_len=64):
    """dp_shard=2 x cp=2 from accelerate's ParallelismConfig, fully_shard over dp_shard_cp: two
    different batches (one per dp group); the FSDP2 gradient must equal the mean of the two
    single-device gradients, and each dp group's CP-mean loss its batch's loss."""
    from torch.distributed.fsdp import fully_shard

    from ringmaster.adapters.accelerate import setup_from_parallelism_config, teardown
    from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model

    pc, mesh = accelerate_mesh(ctx, 2)
    dp_rank = mesh["dp_shard"].get_local_rank()
    model = tiny_model(model_type, attn, **(overrides or {}))
    reference = copy.deepcopy(model)
    batches = [tiny_batch(model.config.vocab_size, seq_len, seed=11 + d) for d in range(2)]
    ref_losses = []
    for b in batches:
        out = reference(**b, use_cache=False)
        (out.loss / 2).backward()
        ref_losses.append(out.loss.item())

    cfg = rm.RingmasterConfig(size=2, backend="ulysses", **(cfg_kwargs or {}))
    runtime = setup_from_parallelism_config(pc, model, cfg)
    try:
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp_shard_cp"])
        fully_shard(model, mesh=mesh["dp_shard_cp"])
        out = model(**batches[dp_rank])  # full batch in; the pre-hook cuts this rank's shard
        out.loss.backward()
        loss = cp_mean(out.loss.detach(), runtime.cp_group, 2)
        worst, worst_name, sharded, flat, ref_flat = 0.0, None, 0, [], []
        for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
            g = p.grad
            if hasattr(g, "full_tensor"):
                sharded += 1
                g = g.full_tensor()
            flat.append(g.reshape(-1))
            ref_flat.append(p_ref.grad.reshape(-1))
            err = rel_err(g, p_ref.grad)
            if err > worst:
                worst, worst_name = err, name
    finally:
        teardown(runtime)
    return {"loss_err": abs(loss - ref_losses[dp_rank]) / ref_losses[dp_rank], "grad_err": worst,
            "grad_err_total": rel_err(torch.cat(flat), torch.cat(ref_flat)),
            "worst_param": worst_name, "sharded_grads": sharded, "recurrent": len(runtime.report.recurrent),
            "dims": tuple(mesh.mesh_dim_names)}


def accelerate_overrides_are_per_instance(ctx):
    """setup_from_parallelism_config on an Accelerator replaces its CP hooks on that instance only."""
    from accelerate import Accelerator

    from ringmaster.adapters.accelerate import disable_torch_cp

    try:
        a, b = Accelerator(cpu=True), Accelerator(cpu=True)
        cls_prepare = Accelerator._prepare_cp
        restore = disable_torch_cp(a)
        args = a._prepare_cp("x", "y")
        with a._cp_context(buffers=[torch.zeros(2)], buffer_seq_dims=[0]):
            pass
        out = {"passthrough": args == ("x", "y"), "class_untouched": Accelerator._prepare_cp is cls_prepare,
               "other_untouched": "_prepare_cp" not in vars(b)}
        restore()
        out["restored"] = "_prepare_cp" not in vars(a)
    finally:
        _reset_accelerate()
    return out


# -- trl ---------------------------------------------------------------------------------------


def sft_steps(ctx, P, model_type="llama", cp_loss="chunked_nll", steps=3, packing=False, overrides=None):
    """CPSFTTrainer at cp=P for ``steps`` SGD steps against SFTTrainer without CP: per-step losses and
    final weights. Gradients are averaged over the CP group after each backward, as DDP/FSDP2 over
    the cp dim would."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from ringmaster.adapters.trl import CPSFTTrainer
    from ringmaster_tools.parity import tiny_model

    mesh = ctx.mesh(P)
    group = mesh["cp"].get_group()
    tok = tiny_tokenizer()
    rows = features([64, 40, 56, 64, 48, 64], seed=5)
    data = Dataset.from_list([{"input_ids": r["input_ids"], "completion_mask": [0] * 5 + [1] * (len(r["input_ids"]) - 5)}
                              for r in rows])

    def run(cp: bool, tmp):
        model = tiny_model(model_type, **(overrides or {}))
        kw = dict(output_dir=tmp, per_device_train_batch_size=2, max_steps=steps, learning_rate=0.5, optim="sgd",
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, report_to=[],
                  use_cpu=True, logging_steps=1, save_strategy="no", seed=0, data_seed=0, dataloader_drop_last=True,
                  max_length=None, pad_to_multiple_of=8 * P, dataset_num_proc=None, packing=packing,
                  padding_free=packing, completion_only_loss=True, average_tokens_across_devices=True,
                  remove_unused_columns=True, gradient_checkpointing=True, bf16=False)
        if packing:
            kw.update(max_length=128, pad_to_multiple_of=None, per_device_train_batch_size=1, packing_strategy="bfd")
        args = SFTConfig(**kw)
        losses = []
        if cp:
            trainer = CPSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                   ringmaster_config=rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=mesh,
                                   cp_loss=cp_loss)
        else:
            trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        original = trainer.training_step

        def training_step(*a, **k):
            loss = original(*a, **k)
            if cp:
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                        p.grad /= P
                loss = torch.tensor(cp_mean(loss, group, P))
            losses.append(loss.item())
            return loss

        trainer.training_step = training_step
        trainer.train()
        if cp:
            trainer.remove_context_parallel()
        _reset_accelerate()
        return model, losses

    with tempfile.TemporaryDirectory() as tmp:
        ref_model, ref_losses = run(False, os.path.join(tmp, "ref"))
        model, losses = run(True, os.path.join(tmp, "cp"))
    out = training_errors(dict(model.named_parameters()), losses, dict(ref_model.named_parameters()), ref_losses,
                          tiny_model(model_type, **(overrides or {})))
    out["restored"] = rm.runtime.active(required=False) is None and model.config._attn_implementation == "sdpa"
    return out


def sft_eval_loss(ctx, P):
    """CPSFTTrainer.evaluate(): the eval loss is reduced over the CP group and equals the non-CP one."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from ringmaster.adapters.trl import CPSFTTrainer
    from ringmaster_tools.parity import tiny_model

    mesh = ctx.mesh(P)
    tok = tiny_tokenizer()
    rows = features([64, 40, 56, 64], seed=9)
    data = Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (False, True):
            args = SFTConfig(output_dir=tmp, per_device_eval_batch_size=2, report_to=[], use_cpu=True,
                             pad_to_multiple_of=8 * P, save_strategy="no", max_length=None, bf16=False)
            model = tiny_model("llama")
            if cp:
                trainer = CPSFTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                                       processing_class=tok,
                                       ringmaster_config=rm.RingmasterConfig(size=P, backend="ulysses"),
                                       device_mesh=mesh)
            else:
                trainer = SFTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tok)
            out["cp" if cp else "ref"] = trainer.evaluate()["eval_loss"]
            if cp:
                trainer.remove_context_parallel()
            _reset_accelerate()
    out["err"] = abs(out["cp"] - out["ref"]) / abs(out["ref"])
    return out




class _LaunchView:
    """While installed, an Accelerator answers ``num_processes`` and ``gather`` as the real
    ``dp_shard x cp`` launch's would (every rank of the world), for the token count and loss scale
    of ``average_tokens_across_devices``; data loading and wrapping keep the 1-process view."""

    _classes: dict = {}

    @classmethod
    def around(cls, trainer, name):
        original = getattr(trainer, name)

        def call(*a, **k):
            acc = trainer.accelerator
            base = type(acc)
            sub = cls._classes.get(base)
            if sub is None:
                def gather(self, t):
                    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                    dist.all_gather(out, t.contiguous())
                    return torch.stack(out) if t.dim() == 0 else torch.cat(out)

                sub = type(f"Launch{base.__name__}", (base,), {
                    "num_processes": property(lambda self: dist.get_world_size()), "gather": gather})
                cls._classes[base] = sub
            acc.__class__ = sub
            try:
                return original(*a, **k)
            finally:
                acc.__class__ = base

        setattr(trainer, name, call)


def sft_steps_fsdp2(ctx, model_type="llama", steps=3):
    """CPSFTTrainer at dp_shard=2 x cp=2 (accelerate's mesh, FSDP2 ``fully_shard`` over
    ``dp_shard_cp``) for ``steps`` SGD steps, each dp group on its own batches, against one
    SFTTrainer without CP that sees both dp groups' batches of a step as two micro-batches of one
    accumulation window (gradient_accumulation_steps=2): the global token mean the real launch's
    ``average_tokens_across_devices`` + FSDP2 gradient averaging gives."""
    from datasets import Dataset
    from torch.distributed.fsdp import fully_shard
    from trl import SFTConfig, SFTTrainer

    from ringmaster.adapters.trl import CPSFTTrainer
    from ringmaster_tools.parity import tiny_model

    pc, mesh = accelerate_mesh(ctx, 2)
    dp_rank = mesh["dp_shard"].get_local_rank()
    world = dist.group.WORLD
    tok = tiny_tokenizer()
    mbs, dp = 2, 2
    rows = features([64, 40, 56, 64, 48, 64, 32, 64, 40, 48, 64, 56][: mbs * dp * steps], seed=7)
    as_data = lambda rs: Dataset.from_list([  # noqa: E731
        {"input_ids": r["input_ids"], "completion_mask": [0] * 5 + [1] * (len(r["input_ids"]) - 5)} for r in rs])
    # micro-batch j of the reference is dp group (j % dp)'s batch of step j // dp
    micro = [rows[j * mbs:(j + 1) * mbs] for j in range(dp * steps)]
    mine = [r for j, m in enumerate(micro) if j % dp == dp_rank for r in m]

    def run(cp: bool, tmp):
        model = tiny_model(model_type)
        args = SFTConfig(output_dir=tmp, per_device_train_batch_size=mbs, gradient_accumulation_steps=1 if cp else dp,
                         max_steps=steps, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, max_grad_norm=1.0, report_to=[], use_cpu=True, logging_steps=1,
                         save_strategy="no", seed=0, data_seed=0, dataloader_drop_last=True, max_length=None,
                         pad_to_multiple_of=16, dataset_num_proc=None, completion_only_loss=True,
                         average_tokens_across_devices=True, train_sampling_strategy="sequential",
                         remove_unused_columns=True, gradient_checkpointing=False, bf16=False)
        losses = []
        if cp:
            for block in model.model.layers:
                fully_shard(block, mesh=mesh["dp_shard_cp"])
            fully_shard(model, mesh=mesh["dp_shard_cp"])
            trainer = CPSFTTrainer(model=model, args=args, train_dataset=as_data(mine), processing_class=tok,
                                   ringmaster_config=rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=mesh)
            _LaunchView.around(trainer, "_get_num_items_in_batch")
            _LaunchView.around(trainer, "compute_loss")
        else:
            trainer = SFTTrainer(model=model, args=args, train_dataset=as_data(rows), processing_class=tok)
        original = trainer.training_step

        def training_step(*a, **k):
            loss = original(*a, **k)
            if cp:  # each rank's loss is (world / global tokens) x its shard's sum: the world mean is the step's
                loss = torch.tensor(cp_mean(loss, world, dist.get_world_size()))
            losses.append(loss.item())
            return loss

        trainer.training_step = training_step
        trainer.train()
        out = {}
        if cp:
            out["sharded"] = sum(hasattr(p, "full_tensor") for p in model.parameters())
            trainer.remove_context_parallel()
        _reset_accelerate()
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in model.named_parameters()}
        if not cp:  # two micro-batches per step: the step's loss is their sum (each / window tokens)
            losses = [losses[i] + losses[i + 1] for i in range(0, len(losses), 2)]
        return weights, losses, out

    with tempfile.TemporaryDirectory() as tmp:
        ref_w, ref_losses, _ = run(False, os.path.join(tmp, "ref"))
        cp_w, losses, out = run(True, os.path.join(tmp, "cp"))
    out.update(training_errors(cp_w, losses, ref_w, ref_losses, tiny_model(model_type)),
               dims=tuple(mesh.mesh_dim_names), restored=rm.runtime.active(required=False) is None)
    return out


def fp64_step(ctx, job, *args, **kwargs):
    """``job`` (a job of this module taking ``overrides``) with the model in float64 and everything
    under ``ringmaster_tools.parity.keep_fp64``: per-parameter errors of recurrent models measure CP, not fp32
    cancellation in the A_log / dt_bias gradients."""
    from ringmaster_tools.parity import keep_fp64

    kwargs["overrides"] = {**(kwargs.get("overrides") or {}), "dtype": torch.float64}
    with keep_fp64():
        return job(ctx, *args, **kwargs)


def data_shards_per_cp_group(ctx) -> dict:
    """The data sharding CPSFTTrainer applies where accelerate shards over every rank (DeepSpeed on a GPU host, a
    launch without ParallelismConfig(cp_size)): a map-style loader prepared by accelerate for this rank among all four
    (``num_processes=4``, as accelerate sees such a launch), its batches before and after
    ``_shard_per_cp_group``, and the shards ``_data_parallel_shards`` computes for the ("dp", "cp") = (2, 2) mesh."""
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from ringmaster.adapters.trl import _data_parallel_shards, _shard_per_cp_group

    mesh = ctx.mesh(2)
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime = SimpleNamespace(cp_size=2, cp_group=mesh["cp"].get_group())
    shards = _data_parallel_shards(SimpleNamespace(num_processes=world), None, runtime)

    def batches(fix: bool):
        loader = prepare_data_loader(DataLoader(list(range(16)), batch_size=2), num_processes=world, process_index=rank,
                                     put_on_device=False)
        if fix:
            _shard_per_cp_group(loader, *shards)
        return [b.tolist() for b in loader]

    out = {"shards": shards, "dp_rank": mesh["dp"].get_local_rank(), "before": batches(False), "after": batches(True),
           "replicated_pc": _data_parallel_shards(SimpleNamespace(num_processes=world),
                                                  SimpleNamespace(cp_enabled=True), runtime)}
    _reset_accelerate()
    return out
