"""Architecture registry: which layers of a model family get which CP treatment.

A family module is data: an :class:`ArchitectureSpec` naming the attention classes, where the
head counts live in the config, and which recurrent layers exist. ``rm.wire`` looks the spec
up by ``config.model_type``, checks every layer of the model against it and fails closed on
anything stateful it does not know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_REGISTRY: dict[str, "ArchitectureSpec"] = {}

# class names that carry state along the sequence: sharding them without state passing is
# silently wrong, so an undeclared one stops `wire`
STATEFUL_PATTERN = re.compile(r"(Mamba|DeltaNet|GatedDelta|LinearAttention|LinearAttn|SSM|Ssm[A-Z]|RWKV|Rwkv|"
                              r"Recurrent|Retention|Hyena|xLSTM|XLSTM|ShortConv|Lightning)")


@dataclass(frozen=True)
class ArchitectureSpec:
    """What ringmaster needs to know about one model family.

    ``attention_classes``: class names of the self-attention modules whose kernel call goes
    through ``config._attn_implementation`` (these get Ulysses/Ring).
    ``recurrent_classes``: class name -> strategy for state-carrying layers ringmaster handles.
    ``ignore_classes``: class names that match the stateful pattern but carry no state.
    """

    name: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    num_heads_attr: str = "num_attention_heads"
    num_kv_heads_attr: str = "num_key_value_heads"
    recurrent_classes: dict = field(default_factory=dict)
    ignore_classes: tuple[str, ...] = ()
    supported_inner: tuple[str, ...] | None = None  # None: every kernel the model itself supports
    notes: str = ""


def register_architecture(spec: ArchitectureSpec, *, override: bool = False) -> ArchitectureSpec:
    """Add a model family. Raises if a model type is already claimed, unless ``override``."""
    if not isinstance(spec, ArchitectureSpec):
        raise TypeError(f"register_architecture needs an ArchitectureSpec, got {type(spec).__name__}")
    _load_builtin()  # a user's family must see the built-in claims (and not be overwritten by them later)
    for model_type in spec.model_types:
        if model_type in _REGISTRY and not override and _REGISTRY[model_type] is not spec:
            raise ValueError(
                f"model_type {model_type!r} is already registered by family {_REGISTRY[model_type].name!r}; "
                "pass override=True to replace it"
            )
    for model_type in spec.model_types:
        _REGISTRY[model_type] = spec
    return spec


def known_model_types() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def get_architecture(model_or_config) -> ArchitectureSpec:
    """The spec for a model (or its config), found by ``model_type`` (the text config's for VLMs)."""
    _load_builtin()
    config = getattr(model_or_config, "config", model_or_config)
    for cfg in (config, text_config(config)):
        model_type = getattr(cfg, "model_type", None)
        if model_type in _REGISTRY:
            return _REGISTRY[model_type]
    model_type = getattr(config, "model_type", None)
    raise ValueError(
        f"ringmaster does not know model_type {model_type!r}. Known families: {', '.join(known_model_types())}. "
        "Describe it with rm.register_architecture(rm.ArchitectureSpec(name=..., model_types=(...,), "
        "attention_classes=('MyAttention',))); see docs/models.md"
    )


_LOADED = False


def _load_builtin() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from . import llama, nemotron_h, qwen3_5, vlm  # noqa: F401  (register on import)
