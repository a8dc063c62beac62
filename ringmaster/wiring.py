"""``rm.wire``: one walk over ``named_modules()`` that checks every layer against the family
spec, switches attention to the CP wrapper, and reports what it changed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .architectures import STATEFUL_PATTERN, ArchitectureSpec, get_architecture, text_config
from .config import Backend, RingmasterConfig
from .strategies.state_passing import UnsupportedLayerError, stateful_layers, unsupported_message

_ATTENTION_LIKE = re.compile(r"(Attention|Attn)$")


def _holds_ssm_params(module) -> bool:
    direct = module.__dict__.get("_parameters", {})
    return "A_log" in direct or "dt_bias" in direct


@dataclass
class WireReport:
    family: str
    attn_implementation: str | None
    inner_attn: str | None
    attention: list[str] = field(default_factory=list)
    recurrent: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ringmaster wired family={self.family} attention={self.attn_implementation} (inner {self.inner_attn})",
                 f"  {len(self.attention)} attention layers" + (f": {self.attention[0]} ..." if self.attention else "")]
        lines += [f"  recurrent {path}: {kind}" for path, kind in self.recurrent]
        return "\n".join(lines)


def classify_layers(model, spec: ArchitectureSpec, skip: tuple[str, ...] = ()) -> tuple[list[str], list[tuple[str, str]]]:
    """Paths of attention and recurrent layers; raises on anything stateful or attention-like
    that the spec does not declare (a renamed class in a new transformers, a swapped-in kernel)."""
    attention, recurrent = [], []
    for path, module in model.named_modules():
        if any(path == prefix or path.startswith(prefix + ".") for prefix in skip):
            continue  # a VLM's vision tower runs unsharded on every rank
        cls = type(module).__name__
        if cls in spec.attention_classes:
            attention.append(path)
        elif cls in spec.recurrent_classes:
            recurrent.append((path, spec.recurrent_classes[cls]))
        elif cls in spec.ignore_classes:
            continue
        elif STATEFUL_PATTERN.search(cls) or _holds_ssm_params(module):
            raise UnsupportedLayerError(
                f"layer {path!r} ({cls}) carries state along the sequence and family {spec.name!r} does not "
                "declare how to pass it across CP ranks; sharding it would train silently wrong. Declare it in "
                "the family's ArchitectureSpec.recurrent_classes (or ignore_classes if it is stateless) and "
                "re-register with rm.register_architecture(spec, override=True)"
            )
        elif _ATTENTION_LIKE.search(cls) and hasattr(module, "q_proj"):
            raise UnsupportedLayerError(
                f"layer {path!r} ({cls}) looks like attention but family {spec.name!r} declares only "
                f"{spec.attention_classes}; add it to attention_classes and re-register the spec"
            )
    if not attention and not recurrent:
        raise UnsupportedLayerError(
            f"found no layer of {spec.attention_classes} in {type(model).__name__}; the family spec "
            f"{spec.name!r} does not match this model's classes"
        )
    return attention, recurrent


def wire(model, cfg: RingmasterConfig | None = None, device_mesh=None, cp_dim: str = "cp"):
    """Make ``model`` context parallel: look up its family, validate, set up the runtime,
    switch attention in place. Returns the runtime; ``runtime.report`` says what changed and
    ``runtime.report`` + ``unwire(model)`` undo it."""
    from .runtime import setup
    from .strategies.ulysses import kv_replication

    if getattr(model, "_ringmaster_runtime", None) is not None:
        raise RuntimeError(
            f"{type(model).__name__} is already wired by ringmaster; call rm.unwire(model) before wiring again"
        )
    import torch.distributed as dist

    if cfg is None:
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        cfg = RingmasterConfig(size=size)
    try:
        spec = get_architecture(model)
    except ValueError:
        found = stateful_layers(model)
        if found:  # name the layer that makes this model unsafe, not just the unknown family
            path, cls = found[0]
            raise UnsupportedLayerError(unsupported_message(path, cls, getattr(model.config, "model_type", None))
                                        ) from None
        raise
    tcfg = text_config(model.config)
    num_heads = getattr(tcfg, spec.num_heads_attr, None)
    num_kv = getattr(tcfg, spec.num_kv_heads_attr, None) or num_heads
    from .multimodal import get_multimodal

    multimodal = get_multimodal(model)
    inner = tcfg._attn_implementation or model.config._attn_implementation or "sdpa"
    if spec.supported_inner is not None and inner not in spec.supported_inner:
        raise ValueError(f"family {spec.name!r} supports attn_implementation in {spec.supported_inner} under CP, "
                         f"the model uses {inner!r}")
    attention, recurrent = classify_layers(model, spec, skip=multimodal.vision_modules if multimodal else ())
    recurrent_layers = []
    if recurrent:
        from .strategies.state_passing import check_recurrent_layers

        modules = dict(model.named_modules())
        # validate every recurrent layer before anything is changed (raises naming the layer)
        recurrent_layers = check_recurrent_layers(model, [(path, modules[path], kind) for path, kind in recurrent])
    if not cfg.normalized:
        from .mesh import intra_node_size

        cfg.normalize(num_kv_heads=num_kv, intra_node_size=intra_node_size(), num_heads=num_heads)
    if cfg.ulysses_size > 1 and num_heads is not None:
        kv_replication(num_heads, num_kv, cfg.ulysses_size)  # raises with the splits that work
    if model.training and getattr(tcfg, "use_cache", False):
        raise ValueError(
            f"{type(model).__name__} is in training mode with use_cache=True; under CP a KV cache would hold only "
            "this rank's shard. Set model.config.use_cache = False (model.config.get_text_config().use_cache for "
            "a VLM) before rm.wire"
        )
    if cfg.ring_size > 1:
        from .ring.kernels import check_dtype
        from .strategies.ring import resolve_ring_impl

        param = next(model.parameters())
        check_dtype(resolve_ring_impl(cfg.ring_impl, inner), param.device, param.dtype)
    runtime = setup(cfg, num_kv_heads=num_kv, device_mesh=device_mesh, cp_dim=cp_dim, inner_attn=inner,
                    num_heads=num_heads)
    runtime.extras["original_attn_implementation"] = inner
    if multimodal is not None:
        from .multimodal import wire_multimodal

        runtime.extras["multimodal"] = multimodal
        runtime.extras["multimodal_wiring"] = wire_multimodal(model, multimodal, runtime.attn_implementation)
    elif runtime.attn_implementation is not None:
        model.set_attn_implementation(runtime.attn_implementation)
    if recurrent_layers:
        from .strategies.state_passing import wire_recurrent_layers

        try:
            runtime.extras["recurrent_wiring"] = wire_recurrent_layers(model, group=runtime.cp_group,
                                                                       layers=recurrent_layers)
        except Exception:
            model.set_attn_implementation(inner)
            raise
    runtime.report = WireReport(family=spec.name, attn_implementation=runtime.attn_implementation,
                                inner_attn=inner, attention=attention, recurrent=recurrent)
    model._ringmaster_runtime = runtime
    return runtime


def unwire(model) -> None:
    """Restore the model's original attention implementation and recurrent layers; forget the wiring."""
    runtime = getattr(model, "_ringmaster_runtime", None)
    if runtime is None:
        return
    wiring = runtime.extras.pop("recurrent_wiring", None)
    if wiring is not None:
        wiring.restore()
    if "multimodal_wiring" in runtime.extras:
        runtime.extras.pop("multimodal_wiring").restore()
    else:
        model.set_attn_implementation(runtime.extras["original_attn_implementation"])
    model._ringmaster_runtime = None
