"""Jobs for tests/test_fla_mamba.py: axolotl 0.21's ``mamba_backend: fla`` mixers under CP, on CPU.

These run in a pool of their own (``fla_pool`` in test_fla_mamba.py): each worker has the stand-in
``fla`` package (tests/standins/fla_mamba/root) first on ``sys.path`` (``LocalPool(sys_path=)``),
maps the hub kernel repos kernels-community/mamba-ssm and causal-conv1d to their stand-ins
(LOCAL_KERNELS), and registers axolotl's
own class patch mapping (``axolotl.model_support.mamba._patch_mappings``: transformers builds axolotl's
MambaMixer / Mamba2Mixer) -- process-wide changes (axolotl's packing patch rewrites transformers' Mamba
classes) that must not reach the shared pool's workers.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

_READY = False


def _setup() -> None:
    global _READY
    if _READY:
        return
    import os

    from standins import fla_mamba as fla_mamba_standin

    if fla_mamba_standin.root() not in sys.path:   # the pool's sys_path put it first already
        sys.path.insert(0, fla_mamba_standin.root())
    os.environ["LOCAL_KERNELS"] = fla_mamba_standin.local_kernels(os.environ.get("LOCAL_KERNELS"))
    from axolotl.model_support.mamba import _patch_mappings
    from transformers.monkey_patching import register_patch_mapping

    register_patch_mapping(dict(_patch_mappings()), overwrite=True)
    import fla

    assert getattr(fla, "STANDIN", False), fla.__file__   # the stand-in, not another fla
    _READY = True


_BUILT: dict = {}


def build(bind: bool = True):
    """``tiny_model`` with ``mamba_backend: fla`` through axolotl's patch mapping; ``bind``: each view gets
    the hub kernels the way axolotl binds them at construction on a CUDA machine (``_bind_kernels``:
    ``kernels.get_kernel`` of the stand-in repos). Built once per worker and configuration, then deep-copied
    (transformers' patch-mapping pass costs ~0.5 s a build; axolotl's views survive deepcopy)."""
    import copy

    from ringmaster_tools.parity import tiny_model

    def make(model_type, attn_implementation="eager", seed=0, dtype=torch.float32, **overrides):
        _setup()
        key = (model_type, seed, dtype, bind, tuple(sorted(overrides.items())))
        if key not in _BUILT:
            model = tiny_model(model_type, "eager", seed, dtype=dtype, mamba_backend="fla", **overrides)
            if bind:
                for module in model.modules():
                    view = module.__dict__.get("_modules", {}).get("fla_mixer")
                    if view is not None:
                        view._bind_kernels()
            _BUILT[key] = model
        return copy.deepcopy(_BUILT[key])
    return make


def lora(targets=("in_proj", "out_proj")):
    """PEFT LoRA on the mixers' projections (random A and B: no gradient is structurally zero). axolotl's
    FLA backend lets PEFT target in_proj / out_proj only (its wrapper of PEFT's Mamba target check); a
    Mamba1 ``x_proj`` target goes through PEFT's own check instead (ringmaster keeps x_proj adapters live)."""
    def prepare(model):
        from unittest import mock

        from peft import LoraConfig, get_peft_model
        from peft.tuners import tuners_utils

        check = tuners_utils._check_lora_target_modules_mamba
        with mock.patch.object(tuners_utils, "_check_lora_target_modules_mamba",
                               getattr(check, "__wrapped__", check) if "x_proj" in targets else check):
            get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets),
                                             init_lora_weights=False))
    return prepare


def fla_parity(ctx, model_type, P=2, packed=False, peft=(), bind=True, seq_len=24, mutate=None, layers=1,
               strategy="auto"):
    """fp64 parity of the FLA-backed model under CP (Ulysses, contiguous) against the same model without CP:
    loss, logits, every parameter's gradient against its own norm. ``packed``: one packed row (the
    reference is axolotl's own packed path: position_ids -> its per-document split). ``mutate``: a
    ringmaster mechanism broken for this run (:data:`MUTATIONS`)."""
    import ringmaster as rm
    from ringmaster_tools.parity import compare, packed_batch

    _setup()
    mesh = ctx.mesh(P)
    batch = packed_batch(128, [9, 11, 4])  # a document crosses the shard boundary if packed else None
    cfg = rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy)   # auto at P=2: sequential
    undo = MUTATIONS[mutate]() if mutate else (lambda: None)
    try:
        r = compare(model_type, cfg, seq_len=seq_len, device_mesh=mesh, build=build(bind), fp64=True,
                    attn_implementation="eager",
                    prepare=lora(peft) if peft else None, batch=batch, num_hidden_layers=layers)
    finally:
        undo()
    r["fla_mixers"] = r.pop("recurrent_layers")
    return {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param", "grad_errs", "missing_grads",
                              "fla_mixers", "n_grads")}


def _patch(owner, name: str, new):
    old = vars(owner)[name]
    setattr(owner, name, new)
    return lambda: setattr(owner, name, old)


class _ZeroIn:
    """A segment whose incoming state is zeroed (``* 0``: the collectives keep their graph)."""

    def __init__(self, seg):
        self._seg = seg

    def __getattr__(self, name):
        return getattr(self._seg, name)

    def run(self, state_in):
        return self._seg.run(None if state_in is None else state_in * 0)

    def finish(self, aux, state_in):
        return self._seg.finish(aux, None if state_in is None else state_in * 0)


def drop_carried_state():
    """``pass_state`` as the Mamba1 / Mamba2 CP scans call it (``ringmaster.recurrent.mamba1`` / ``mamba2``
    module globals): the state carried in from the earlier shards zeroed. Only CP calls go through it,
    so wire's probe still passes and the model-level parity check has to catch it."""
    from ringmaster.recurrent import mamba1, mamba2

    real = mamba1.pass_state

    def mutated(segments, *args, **kwargs):
        return real([_ZeroIn(s) for s in segments], *args, **kwargs)

    undos = [_patch(mamba1, "pass_state", mutated), _patch(mamba2, "pass_state", mutated)]
    return lambda: [u() for u in reversed(undos)]


def drop_conv_halo():
    """``ringmaster.recurrent.conv.exchange_halos``: every shard's conv halo zeroed."""
    from ringmaster.recurrent import conv

    exchange = conv.exchange_halos
    return _patch(conv, "exchange_halos", lambda *a, **k: [h * 0 for h in exchange(*a, **k)])


MUTATIONS = {"state": drop_carried_state, "halo": drop_conv_halo}


def plugin_step(ctx, P, model_type, peft=False):
    """axolotl's own ContextParallelPlugin on a ``mamba_backend: fla`` model (hub kernels bound), the way
    tests/jobs_adapters.axolotl_plugin_step drives it: a HF Trainer, pre_model_load,
    post_trainer_create, one training_step, post_train_unload; float64 under keep_fp64, every
    parameter's gradient against its own norm. ``attn_implementation: eager`` (a pure Mamba model has
    no sdpa path, and transformers runs its sdpa check on any name containing "sdpa")."""
    import copy
    import tempfile

    import jobs_adapters as ja
    from axolotl.integrations.context_parallel.plugin import ContextParallelPlugin
    from axolotl.utils.collators import DataCollatorForSeq2Seq
    from axolotl.utils.dict import DictDefault
    from transformers import Trainer, TrainingArguments

    import ringmaster as rm
    from ringmaster.fla_mamba import fla_mamba_mixers
    from ringmaster_tools.parity import keep_fp64

    _setup()
    pc, mesh = ja.accelerate_mesh(ctx, P)
    out: dict = {}
    with keep_fp64(), tempfile.TemporaryDirectory() as tmp:
        model = build()(model_type, "eager", dtype=torch.float64, num_hidden_layers=1)
        if peft:   # axolotl's adapter flow: the Trainer gets the PeftModel (in_proj / out_proj LoRA)
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                     target_modules=["in_proj", "out_proj"]))
        reference = copy.deepcopy(model)
        rows = ja.features([40])
        cfg = DictDefault({"context_parallel": {"size": P, "backend": "ulysses", "shard_in_collator": True},
                           "model_config_type": model_type, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
                           "attn_implementation": "eager", "sample_packing": False})
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                                 average_tokens_across_devices=True, save_strategy="no")
        collator = DataCollatorForSeq2Seq(tokenizer=ja.tiny_tokenizer(), padding=True, pad_to_multiple_of=8)
        reference_batch = collator([dict(r) for r in rows])
        ref_loss = reference(**reference_batch, use_cache=False).loss
        ref_loss.backward()
        plugin = ContextParallelPlugin()
        plugin.pre_model_load(cfg)
        trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=rows)
        state = trainer.accelerator.state
        state.parallelism_config, state.device_mesh = pc, mesh
        try:
            plugin.post_trainer_create(cfg, trainer)
            out["fla_mixers"] = len(fla_mamba_mixers(model))
            out["wired"] = [m._ringmaster_recurrent for m in fla_mamba_mixers(model)]
            out["trained"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            out["attn"] = model.config._attn_implementation
            batch = trainer.data_collator([dict(r) for r in rows])
            num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
            loss = trainer.training_step(trainer.model, batch, num_items)
            group = plugin._runtime.cp_group
            out["loss_err"] = abs(ja.cp_mean(loss.double(), group, P) - ref_loss.item()) / abs(ref_loss.item())
            out["grad_err"], out["worst_param"], out["missing"], _, _ = ja.grads_vs(model, reference, group, P)
        finally:
            plugin.post_train_unload(cfg)
            state.parallelism_config, state.device_mesh = None, None
            ja._reset_accelerate()
        out["unwired"] = not any("_ringmaster_recurrent" in vars(m) for m in fla_mamba_mixers(model))
        out["runtime_dropped"] = rm.runtime.active(required=False) is None
        with torch.no_grad():
            again = model(**reference_batch, use_cache=False).logits
            out["unload_logits_err"] = (again - reference(**reference_batch, use_cache=False).logits).abs().max().item()
    return out


def mixers_and_refusals(ctx):
    """``fla_mamba_mixers`` on FLA-backed and plain models, and what it (or the wired layer) refuses, naming
    the layer: an adapter on dt_proj, FLA's triton conv backend, an unbound view on a CUDA machine, and the
    hub kernels bound over ringmaster's after wiring (axolotl's lazy bind)."""
    from unittest import mock

    import ringmaster as rm
    from ringmaster.errors import UnsupportedLayerError
    from ringmaster.fla_mamba import fla_mamba_mixers
    from ringmaster_tools.parity import keep_fp64

    _setup()
    small = {"num_hidden_layers": 1, "dtype": torch.float64}      # the parity cases' builds, reused
    out = {"found": {}, "refused": {}}
    out["standin_err"] = {}
    for model_type in ("mamba", "mamba2"):
        model = build()(model_type, **small)
        out["found"][model_type] = len(fla_mamba_mixers(model))
        # the stand-in hub kernels (fused and unfused kernel path, no CP) against FLA's own torch path
        view = model.backbone.layers[0].mixer.fla_mixer
        x = torch.randn(2, 10, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        with keep_fp64(), torch.no_grad():
            torch_path = (view.slow_forward if model_type == "mamba" else view.torch_forward)(x)[0]
            fused = view.cuda_kernels_forward(x)[0]
            unfused = view.cuda_kernels_forward(x, None, True)[0]
        out["standin_err"][model_type] = max((fused - torch_path).abs().max().item(),
                                             (unfused - torch_path).abs().max().item())
    from ringmaster_tools.parity import tiny_model
    out["found"]["plain_mamba"] = len(fla_mamba_mixers(tiny_model("mamba", "eager", num_hidden_layers=1)))
    # a hybrid asking for FLA: axolotl backs only mamba / mamba2 models' mixers with FLA, so nothing is found
    # (and axolotl's plugin refuses the run: "found no supported mixers")
    out["found"]["nemotron_h"] = len(fla_mamba_mixers(tiny_model("nemotron_h", mamba_backend="fla")))

    def refusal(case, model, fn=fla_mamba_mixers, error=UnsupportedLayerError):
        try:
            fn(model)
        except error as exc:
            out["refused"][case] = str(exc)
        else:
            out["refused"][case] = "not refused"

    class Adapted(torch.nn.Module):   # what PEFT's LoRA layers look like to ringmaster: a base_layer inside
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    model = build()("mamba", **small)
    mixer = model.backbone.layers[0].mixer
    mixer.dt_proj = Adapted(mixer.dt_proj)
    refusal("dt_proj_adapter", model)
    model = build()("mamba2", **small)
    handle = rm.wire_recurrent_layers(model, group=ctx.mesh(2)["cp"].get_group())
    model.backbone.layers[0].mixer.conv1d = Adapted(model.backbone.layers[0].mixer.conv1d)  # after the wiring
    refusal("conv1d_adapter_after_wire", model, lambda m: m(input_ids=torch.zeros(1, 8, dtype=torch.long)))
    handle.restore()
    model = build()("mamba2", **small)
    model.backbone.layers[0].mixer.fla_mixer.backend = "triton"
    refusal("triton_backend", model)
    model = build(bind=False)("mamba2", **small)
    with mock.patch("torch.cuda.is_available", return_value=True):
        refusal("unbound_on_cuda", model)
    model = build()("mamba2", **small)
    handle = rm.wire_recurrent_layers(model, group=ctx.mesh(2)["cp"].get_group())
    group = ctx.mesh(2)["cp"].get_group()
    refusal("wired_twice", model, lambda m: rm.wire_recurrent_layers(m, group=group))
    model.backbone.layers[0].mixer.fla_mixer._bind_kernels()     # axolotl binding again, after the wiring
    refusal("rebound_after_wire", model, lambda m: m(input_ids=torch.zeros(1, 8, dtype=torch.long)), RuntimeError)
    handle.restore()
    return out


def native_build(model_type, attn_implementation="eager", seed=0, dtype=torch.float32, **overrides):
    """``tiny_model`` through axolotl's patch mapping with its default ``mamba_backend: transformers``:
    axolotl's MambaMixer / Mamba2Mixer, each with the instance-level forward axolotl gives it
    (``_native_forward``: the transformers mixer forward behind a ``segments`` kwarg)."""
    import copy

    from ringmaster_tools.parity import tiny_model

    _setup()
    from axolotl.monkeypatch.models.mamba import modeling as packing

    # what axolotl applies under sample_packing (PatchManager._apply_ssm_packing_patches): the mixer class
    # forward becomes its packed-row splitter, so the instance forward's chain is three deep. Mamba2's needs
    # seq_idx kernels (use_kernels: true) and refuses a packed row on CPU outside CP; under CP the segments
    # never reach it
    getattr(packing, f"patch_{model_type}_modeling_packing")(kernels_enabled=model_type == "mamba2")
    key = ("native", model_type, seed, dtype, tuple(sorted(overrides.items())))
    if key not in _BUILT:
        _BUILT[key] = tiny_model(model_type, "eager", seed, dtype=dtype, **overrides)
    return copy.deepcopy(_BUILT[key])


def skip_composed_rebind():
    """``ringmaster.intercept.composed_forward`` as if axolotl's instance forward were not
    recognised: wire must then refuse the layer (the instance forward would bypass the state passing)."""
    from ringmaster import intercept

    return _patch(intercept, "composed_forward", lambda module: None)


def keep_local_segments():
    """``drop_local_segments`` as the Mamba mixers' guard calls it (``ringmaster.recurrent.mixer``): a no-op,
    so axolotl's packed-row splitter cuts each shard at the documents of its *local* position_ids."""
    from ringmaster.recurrent import mixer

    return _patch(mixer, "drop_local_segments", lambda ctx, kwargs, key="segments": None)


MUTATIONS["no_composed_rebind"] = skip_composed_rebind
MUTATIONS["local_segments"] = keep_local_segments


def _chain(fn):
    while fn is not None:
        yield fn
        fn = getattr(fn, "__wrapped__", None)


def native_parity(ctx, model_type, P=2, packed=False, mutate=None, seq_len=24, strategy="auto"):
    """fp64 parity of a ``mamba_backend: transformers`` (axolotl's default) model under CP against the same
    model without CP. ``packed``: one packed row (3 documents, one across the shard boundary); the reference
    runs each document alone (axolotl's default mapping has no CPU packed path for the native mixers). Also
    reports that axolotl's instance forward is what the wired layer composes with and what the undo puts back."""
    import ringmaster as rm
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    _setup()
    mixer_cls = {"mamba": "MambaMixer", "mamba2": "Mamba2Mixer"}.get(model_type)
    probe = native_build(model_type)
    m = probe.backbone.layers[0].mixer
    out = {"axolotl_mixer": type(m).__module__.startswith("axolotl") and type(m).__name__ == mixer_cls,
           "instance_forward": "forward" in vars(m)}
    original = vars(m).get("forward")   # none on falcon_mamba (axolotl's packing patch is class-level there)
    rm.wire(probe, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    out["rebound"] = vars(m)["forward"] is not original
    rm.unwire(probe)
    rm.teardown()
    out["restored"] = vars(m).get("forward") is original
    batch = packed_batch(128, [9, 11, 4]) if packed else None
    undo = MUTATIONS[mutate]() if mutate else (lambda: None)
    try:
        r = compare(model_type, rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy), seq_len=seq_len,
                    device_mesh=ctx.mesh(P), build=native_build, fp64=True, attn_implementation="eager", batch=batch,
                    reference_forward=per_document_forward if packed else None, num_hidden_layers=1)
    except Exception as e:   # noqa: BLE001 -- the mutation's refusal is the result
        if mutate is None:
            raise
        return {**out, "error": f"{type(e).__name__}: {e}"}
    finally:
        undo()
    out["chain"] = [f.__code__.co_qualname for f in _chain(getattr(original, "__func__", type(m).forward))]
    out.update({k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param", "missing_grads", "n_grads",
                                  "recurrent_layers")})
    return out
