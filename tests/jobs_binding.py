"""Pool jobs for the per-runtime binding: several wired models in one process, the trainer-side
manager with every layout, a wrong layout on one rank, wire's use_cache handling and atomicity."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

import ringmaster as rm


def _reference(model, batch):
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out


def _errors(model, reference, out, ref_out, runtime, layout=None):
    from ringmaster_tools.parity import group_mean_grad_errors, rel_err

    group, P = runtime.cp_group, runtime.cp_size
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = rm.gather_sequence(out.logits.detach(), dim=1, group=group,
                                layout=layout or runtime.shard_load_balance)
    _, missing, total = group_mean_grad_errors(model, reference, group, P)
    return {"loss_err": abs(loss.item() / P - ref_out.loss.item()) / abs(ref_out.loss.item()),
            "logits_err": rel_err(logits, ref_out.logits), "grad_err_total": total, "missing": missing,
            "layout": runtime.shard_load_balance, "backend": runtime.config.backend.value,
            "attn": runtime.attn_implementation}


def two_models(ctx, P, cfgs, rounds=2, model_types=("llama", "llama")):
    """Wire one model per config in this process and run them alternately (forward and backward,
    ``rounds`` times each), each against its own non-CP reference."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    entries = []
    cfgs = [dict(cfg) for cfg in cfgs]
    sizes = [cfg.pop("P", P) for cfg in cfgs]   # a config may name its own CP size (another CP group)
    for i, (cfg, model_type) in enumerate(zip(cfgs, model_types)):
        model = tiny_model(model_type, seed=i, num_attention_heads=4, num_key_value_heads=2)
        entries.append({"model": model, "reference": copy.deepcopy(model),
                        "batch": tiny_batch(model.config.vocab_size, 64, seed=10 + i)})
    for e, cfg, size in zip(entries, cfgs, sizes):
        mesh = ctx.mesh(size, all_groups=len(set(sizes)) > 1)   # two CP sizes: every rank stays
        e["runtime"] = rm.wire(e["model"], rm.RingmasterConfig(size=size, **cfg), device_mesh=mesh)
    rm.teardown()  # nothing may depend on "the current runtime" from here on
    results = []
    try:
        for _ in range(rounds):
            for e in entries:
                for m in (e["model"], e["reference"]):
                    m.zero_grad(set_to_none=True)
                e["ref_out"] = _reference(e["reference"], e["batch"])
                with context_parallel_region(e["batch"], model=e["model"]) as shard:
                    e["out"] = e["model"](**shard)
                e["out"].loss.backward()
            results = [_errors(e["model"], e["reference"], e["out"], e["ref_out"], e["runtime"]) for e in entries]
    finally:
        for e in entries:
            rm.unwire(e["model"])
    return results


def manager_layout(ctx, P, load_balance, backend="auto", model_type="llama"):
    """A Ring-AUTO (or other) model hooked by ContextParallelContextManager built the way trainers
    build it, with ``load_balance`` given (or not): exact, or the error raised before any collective."""
    from ringmaster_tools.parity import tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    model = tiny_model(model_type, num_attention_heads=4, num_key_value_heads=1)  # 1 KV head: AUTO picks Ring
    reference = copy.deepcopy(model)
    batch = tiny_batch(model.config.vocab_size, 64)
    ref_out = _reference(reference, batch)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=mesh)
    kwargs = {} if load_balance == "unset" else {"load_balance": load_balance}
    handles = []
    try:
        manager = rm.ContextParallelContextManager([model], runtime.cp_group, **kwargs)
        handles = manager.install()
        out = model(**batch)
        out.loss.backward()
        result = _errors(model, reference, out, ref_out, runtime, layout=manager._layouts[id(model)])
        result["cut"] = manager._layouts[id(model)]
        return result
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        for handle in handles:
            handle.remove()
        rm.unwire(model)
        rm.teardown()


def wrong_layout_on_one_rank(ctx, P, validate=True):
    """Mutation: one rank cuts its batch head_tail while the others cut it contiguous (a Ring model,
    which plans with whatever layout the batch says)."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    reference = copy.deepcopy(model)
    batch = tiny_batch(model.config.vocab_size, 64)
    ref_out = reference(**batch, use_cache=False)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ring", load_balance="none",
                                                 validate_inputs=validate), device_mesh=mesh)
    try:
        plan = runtime.config   # the runtime's frozen plan: this rank alone gets one that cuts head_tail
        if runtime.cp_rank == 1:
            runtime.config = plan.replace(load_balance=rm.LoadBalance.HEAD_TAIL)
        with context_parallel_region(batch, runtime=runtime) as shard:
            out = model(**shard)
        runtime.config = plan
        logits = rm.gather_sequence(out.logits.detach(), dim=1, group=runtime.cp_group, layout="contiguous")
        return {"logits_err": rel_err(logits, ref_out.logits)}
    except Exception as exc:  # noqa: BLE001 - the test asserts on type and message
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        rm.unwire(model)
        rm.teardown()


def batch_for_another_model(ctx, P):
    """A shard cut for a head_tail Ring model, passed to a Ulysses model: refused before any collective."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    ring = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    ulysses = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    rt_ring = rm.wire(ring, rm.RingmasterConfig(size=P, backend="ring"), device_mesh=mesh)
    rm.wire(ulysses, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=mesh)
    try:
        with context_parallel_region(tiny_batch(128, 64), runtime=rt_ring) as shard:
            ulysses(**shard)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    finally:
        rm.unwire(ring)
        rm.unwire(ulysses)
        rm.teardown()
    return None


def default_config_trains(ctx, P, model_type="llama"):
    """A freshly built HF model in train mode with its default config (use_cache=True): rm.wire warns,
    switches the cache off, trains exactly; unwire restores use_cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    before = bool(model.config.use_cache)
    reference = copy.deepcopy(model)
    batch = tiny_batch(128, 64)
    ref_out = reference(**batch)
    ref_out.loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime = rm.wire(model, rm.RingmasterConfig(size=P), device_mesh=ctx.mesh(P))
    during = bool(model.config.use_cache)
    try:
        with context_parallel_region(batch, runtime=runtime) as shard:
            out = model(**shard)
        out.loss.backward()
        result = _errors(model, reference, out, ref_out, runtime)
    finally:
        rm.unwire(model)
        rm.teardown()
    result.update(before=before, during=during, after=bool(model.config.use_cache),
                  warned=[str(w.message) for w in caught if "use_cache" in str(w.message)])
    return result


# --------------------------------------------------------------------------- atomic wire, probe

try:  # the kernels the fake layers below call by module-global name (what wire intercepts)
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule
except ImportError:  # pragma: no cover - transformers is a test dependency
    causal_conv1d_fn = torch_chunk_gated_delta_rule = None
my_delta_rule = torch_chunk_gated_delta_rule   # the same kernel under another name (a renamed release)


class FakeGatedDeltaNet(torch.nn.Module):
    """Calls both gated-DeltaNet kernels by name; ``mode="blind"`` then ignores their outputs (a layer
    whose output no longer depends on the state ringmaster passes), ``mode="bypass"`` never calls them."""

    def __init__(self, hidden: int, mode: str):
        super().__init__()
        self.mode = mode
        self.proj = torch.nn.Linear(hidden, hidden)
        self.conv_weight = torch.nn.Parameter(torch.randn(hidden, 4))

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        if self.mode == "bypass":
            return self.proj(hidden_states)
        b, l, h = hidden_states.shape
        x = causal_conv1d_fn(hidden_states.transpose(1, 2), self.conv_weight, None, activation="silu").transpose(1, 2)
        q = k = torch.nn.functional.normalize(x.reshape(b, l, 1, h), dim=-1)
        v = x.reshape(b, l, 1, h)
        g = -torch.ones(b, l, 1, dtype=x.dtype) * 0.1
        beta = torch.full((b, l, 1), 0.5, dtype=x.dtype)
        if self.mode == "renamed":
            y, _ = my_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False)
        else:
            y, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False)
        out = self.proj(hidden_states)
        return out if self.mode == "blind" else out + y.reshape(b, l, h)


class _Container(torch.nn.Module):
    def __init__(self, mode: str, hidden: int = 16, model_type: str | None = None):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(hidden_size=hidden, model_type=model_type)
        self.mixer = FakeGatedDeltaNet(hidden, mode)


def probe_outcome(ctx, mode, declare_rename=False):
    """wire_recurrent_layers on a fake layer: error None when wiring (and its probe) passed, else the
    error. ``declare_rename``: a family spec declares the renamed scan kernel (``my_delta_rule``)."""
    from ringmaster.architectures import spec as spec_module

    registry = dict(spec_module._REGISTRY)
    model_type = None
    if declare_rename:
        model_type = "ringmaster_fake_renamed"
        rm.register_architecture(rm.ArchitectureSpec(
            name=model_type, model_types=(model_type,), attention_classes=(),
            recurrent_classes={"FakeGatedDeltaNet": "gated_deltanet"},
            recurrent_kernels={"gated_deltanet": {"scan": "my_delta_rule"}}))
    container = _Container(mode, model_type=model_type)
    try:
        wiring = rm.wire_recurrent_layers(container, layers=[("mixer", container.mixer, "gated_deltanet")])
    except rm.UnsupportedLayerError as exc:
        return {"error": str(exc), "restored": "forward" not in vars(container.mixer)}
    finally:
        spec_module._REGISTRY.clear()
        spec_module._REGISTRY.update(registry)
    wired = "forward" in vars(container.mixer)
    wiring.restore()
    return {"error": None, "wired": wired, "restored": "forward" not in vars(container.mixer)}


def _snapshot(model):
    configs = {}
    for module in (model, *model.modules()):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = (config._attn_implementation, getattr(config, "use_cache", None))
    forwards = sorted(path for path, m in model.named_modules() if "forward" in vars(m))
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return {"configs": configs, "forwards": forwards, "hooks": hooks,
            "wired": getattr(model, "_ringmaster_runtime", None) is not None}


def wire_fails_midway(ctx, P, step):
    """Make rm.wire fail at ``step`` on a hybrid model with use_cache=True; the model (and the current
    runtime) must be exactly as before."""
    import ringmaster.recurrent.wiring as recurrent_wiring
    import ringmaster.wiring as wiring
    from ringmaster import runtime as runtime_module
    from ringmaster_tools.parity import tiny_model

    model = tiny_model("qwen3_5_text", use_cache=True)
    before = _snapshot(model)
    current = runtime_module.active(required=False)
    original_probe, original_switch = recurrent_wiring.probe_layer, wiring._switch_attention
    calls = {"n": 0}

    def failing_probe(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second recurrent layer: one is already wired
            raise rm.UnsupportedLayerError("injected probe failure")
        return original_probe(*args, **kwargs)

    def failing_switch(model_, spec, name, undo):
        original_switch(model_, spec, name, undo)
        raise RuntimeError("injected failure after the attention switch")

    if step == "probe":
        recurrent_wiring.probe_layer = failing_probe
    else:
        wiring._switch_attention = failing_switch
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
        error = None
    except (rm.UnsupportedLayerError, RuntimeError) as exc:
        error = str(exc)
    finally:
        recurrent_wiring.probe_layer, wiring._switch_attention = original_probe, original_switch
    after = _snapshot(model)
    return {"error": error, "same": before == after, "before": repr(before), "after": repr(after),
            "current_kept": runtime_module.active(required=False) is current}


def setup_path(ctx, model_type: str, padded: bool = False, check: bool = True):
    """The low-level path (rm.setup + set_attn_implementation, as axolotl's built-in plugin does, no
    rm.wire): a model that needs only the attention kernel trains exactly; one that needs what only
    rm.wire installs is refused at its first sharded forward, before any collective."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch
    from ringmaster_tools.zoo import build_tiny

    P = 2
    model = build_tiny(model_type, dtype=torch.float32)
    reference = copy.deepcopy(model)
    batch = tiny_batch(model.config.vocab_size, 32, seed=3)
    if padded:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][0, :5] = 0   # left padding: OPT numbers tokens by the mask count
        batch["labels"][0, :5] = -100
    tcfg = model.config.get_text_config()
    rt = rm.setup(rm.RingmasterConfig(size=P, backend="ulysses"),
                  num_kv_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
                  device_mesh=ctx.mesh(P), num_heads=tcfg.num_attention_heads)
    model.set_attn_implementation(rt.attn_implementation)
    from ringmaster import runtime as rt_module

    saved = list(rt_module._SETUP_PATH_CHECKS)
    if not check:   # the mutation: the low-level path unchecked, as before
        rt_module._SETUP_PATH_CHECKS.clear()
    try:
        ref_out = _reference(reference, batch)
        try:
            with context_parallel_region(batch, model=model, runtime=rt) as shard:
                out = model(**shard)
                out.loss.backward()
        except rm.UnsupportedLayerError as e:
            return {"refused": str(e)}
        return _errors(model, reference, out, ref_out, rt)
    finally:
        rt_module._SETUP_PATH_CHECKS[:] = saved
        rm.teardown()
