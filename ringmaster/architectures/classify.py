"""One classifier: which modules of a model are CP attention, which are recurrent (and of which
kind), and which stateful or attention-like module nobody declared (fail closed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedLayerError
from ..recurrent.fla_mamba import fla_view
from ..recurrent.registry import known_kinds
from .spec import ArchitectureSpec

# class names that carry state along the sequence: sharding them without state passing is
# silently wrong, so an undeclared one stops `wire`
STATEFUL_PATTERN = re.compile(r"(Mamba|DeltaNet|GatedDelta|LinearAttention|LinearAttn|SSM|Ssm[A-Z]|RWKV|Rwkv|"
                              r"Recurrent|Retention|Hyena|xLSTM|XLSTM|ShortConv|Lightning)")


_ATTENTION_LIKE = re.compile(r"(Attention|Attn)$")


def _holds_ssm_params(module) -> bool:
    direct = module.__dict__.get("_parameters", {})
    return "A_log" in direct or "dt_bias" in direct


def _is_stateful(module) -> bool:
    return bool(STATEFUL_PATTERN.search(type(module).__name__)) or _holds_ssm_params(module)


def stateful_layers(model, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """``(path, class name)`` of every innermost module that carries state along the sequence: a class
    name matching the stateful pattern, or a module holding SSM parameters (``A_log``/``dt_bias``)."""
    found = [(path, type(module).__name__) for path, module in model.named_modules()
             if not _skipped(path, skip) and _is_stateful(module)]

    # name the mixer itself, not the decoder layer around it (JambaMambaDecoderLayer > JambaMambaMixer)
    def inside(q: str, p: str) -> bool:
        return q != p and (p == "" or q.startswith(p + "."))

    return [(p, c) for p, c in found if not any(inside(q, p) for q, _ in found)]


def unsupported_message(path: str, cls: str, model_type: str | None = None) -> str:
    who = f"model_type {model_type!r}" if model_type else "this model's family"
    kinds = known_kinds()
    return (
        f"layer {path!r} ({cls}) carries recurrent state along the sequence and {who} does not declare how to "
        "pass it across CP ranks; sharding it would train silently wrong. ringmaster passes state exactly for the "
        f"recurrent kinds {kinds} (ringmaster.recurrent.registry) when the layer calls the kernels its kind "
        "intercepts; another recurrence is not supported. If the layer is one of those kinds, declare it in an "
        f"ArchitectureSpec (recurrent_classes={{{cls!r}: <kind>}}) and register it with "
        "rm.register_architecture(spec, override=True); otherwise use a CP size of 1 for this model"
    )


def _skipped(path: str, skip: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(prefix + ".") for prefix in skip)


@dataclass
class Classification:
    """``attention``: paths of CP attention modules; ``recurrent``: ``(path, module, kind)``."""

    spec: ArchitectureSpec | None
    attention: list[str] = field(default_factory=list)
    recurrent: list[tuple[str, Any, str]] = field(default_factory=list)


def classify_layers(model, spec: ArchitectureSpec | None) -> Classification:
    """Classify every module of ``model`` once against ``spec``; raise (naming the layer and the fix)
    on anything stateful or attention-like the spec does not declare (a renamed class in a new
    transformers, a swapped-in kernel). ``spec=None`` (a model no family describes) only checks
    that no module carries state along the sequence. A VLM's vision modules are skipped: they run
    unsharded on every rank."""
    skip = spec.vision_modules if spec is not None else ()
    result = Classification(spec)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if spec is None:
        found = stateful_layers(model)
        if found:
            raise UnsupportedLayerError(unsupported_message(*found[0], model_type))
        return result
    stateful_parents = {p for p, _ in stateful_layers(model, skip)}
    declared = {}   # path -> a module declared recurrent: axolotl's FLA view inside it is wired with it
    for path, module in model.named_modules():
        if _skipped(path, skip):
            continue
        cls = type(module).__name__
        if cls in spec.attention_classes:
            result.attention.append(path)
        elif cls in spec.recurrent_classes:
            result.recurrent.append((path, module, spec.recurrent_classes[cls]))
            declared[path] = module
        elif cls in spec.ignore_classes:
            continue
        elif _is_stateful(module):
            if path not in stateful_parents:
                continue  # a container (decoder layer) around a stateful module: the inner one is judged
            parent = declared.get(path.rpartition(".")[0])
            if parent is not None and fla_view(parent) is module:
                continue  # axolotl's FLA view of a declared mixer (recurrent/fla_mamba.py wires it with the mixer)
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
    if not result.attention and not result.recurrent:
        raise UnsupportedLayerError(
            f"found no layer of {spec.attention_classes} in {type(model).__name__}; the family spec "
            f"{spec.name!r} does not match this model's classes"
        )
    return result
