"""The generic path: a model no family registers, accepted when ringmaster can see it is safe.

A decoder needs no registration when (1) every attention module picks its kernel through
transformers' attention interface (its ``forward`` reads ``ALL_ATTENTION_FUNCTIONS``: that is
where ``rm.wire`` swaps in the CP function; ``_supports_attention_backend`` is not reliable in
transformers 5.24: bamba, jamba, biogpt dispatch without it), (2) no layer carries state along
the sequence (:mod:`.classify` fails closed), and (3) nothing else depends on where a token
sits in the *local* shard: convolutions over the sequence, per-sequence MoE statistics, random
draws shared along the sequence (:func:`cp_hazards`; per-element dropout is forked per rank). Learned absolute position tables are numbered from the full row by the
model's own rule, which ``rm.wire`` finds with a probe (:mod:`.positions`). The spec (attention classes, the
config's head attributes) is derived from the model itself.

A registered spec wins over the generic path (hybrids, VLMs, overrides), and a registered spec
with ``refuse`` set stops ``rm.wire`` with its reason. What the wiring cannot see statically
(a decoder layer that drops the ``ringmaster_batch`` kwarg, an attention called twice) the
first-forward accounting catches (:mod:`ringmaster.attention.accounting`).
"""

from __future__ import annotations

import ast
import inspect
import linecache
import re
from functools import lru_cache

import torch.nn as nn

from ..errors import UnsupportedLayerError
from .classify import _ATTENTION_LIKE, stateful_layers, unsupported_message
from .heads import head_splits
from .towers import tower_spec
from .spec import ArchitectureSpec, register_architecture, registered_architecture, text_config, unknown_family

_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS",)
# modules that pool or select keys from the layer's own (local) sequence outside the attention call:
# deepseek_v4's CSA/HCA compressors (one entry per compress_rate consecutive tokens) and their indexer
_SEQUENCE_POOLING_CLASS = re.compile(r"(Compressor|Indexer)$")
_HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "n_kv_heads")


@lru_cache(maxsize=None)
def dispatches(cls: type) -> bool:
    """Whether instances of ``cls`` pick their attention kernel through transformers' interface
    (read from the source of the class's own ``forward``; cached per class)."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(marker in source for marker in _DISPATCH_MARKERS)


def _has_linear_child(module) -> bool:
    return any(isinstance(child, nn.Linear) for child in module.children())


def generic_spec(model) -> ArchitectureSpec:
    """Derive a spec for an unregistered model, or raise :class:`UnsupportedLayerError` naming the
    layer that makes the generic path unsafe and the fix."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found = stateful_layers(model)
    if found:
        raise UnsupportedLayerError(unsupported_message(*found[0], model_type))
    modules = dict(model.named_modules())
    dispatching = [path for path, m in modules.items() if dispatches(type(m))]

    def inside(path: str, roots: list[str]) -> bool:
        return any(path == r or path.startswith(r + ".") or r.startswith(path + ".") for r in roots)

    for path, module in modules.items():
        cls = type(module).__name__
        if (_ATTENTION_LIKE.search(cls) and _has_linear_child(module) and not dispatches(type(module))
                and not inside(path, dispatching)):
            raise UnsupportedLayerError(
                f"layer {path!r} ({cls}) looks like attention but computes it itself instead of through "
                f"transformers' attention interface (its forward never reads ALL_ATTENTION_FUNCTIONS), so "
                f"ringmaster cannot put the CP attention there; model_type {model_type!r} is not supported "
                "generically. Register the family with rm.register_architecture(ArchitectureSpec(..., "
                "refuse=...)) or use a CP size of 1")
    if not dispatching:
        raise UnsupportedLayerError(
            f"no module of {type(model).__name__} (model_type {model_type!r}) dispatches attention through "
            "transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so ringmaster has nowhere to put the "
            "CP attention; use a CP size of 1 for this model")
    tcfg = text_config(model.config)
    heads = next((a for a in _HEAD_ATTRS if isinstance(getattr(tcfg, a, None), int)), None)
    if heads is None:
        raise UnsupportedLayerError(
            f"model_type {model_type!r}: found no head count in its config (looked for {_HEAD_ATTRS}); register "
            "the family with rm.register_architecture(ArchitectureSpec(..., num_heads_attr=...))")
    kv = next((a for a in _KV_HEAD_ATTRS if isinstance(getattr(tcfg, a, None), int)), heads)
    # the split of each call comes from the layer itself (heads.py); a layer whose numbers contradict
    # each other raises there, naming it
    head_splits(model, dispatching, tcfg, heads, kv)
    classes = tuple(dict.fromkeys(type(modules[p]).__name__ for p in dispatching))
    return ArchitectureSpec(name=f"{model_type} (generic)", model_types=(model_type,), attention_classes=classes,
                            num_heads_attr=heads, num_kv_heads_attr=kv, notes="derived by the generic path")


def get_architecture(model_or_config) -> ArchitectureSpec:
    """The spec for a model (or its config): the registered family by ``model_type`` (the text
    config's for VLMs), else, for a model, the one the generic path derives from its modules
    (raises :class:`UnsupportedLayerError` naming what makes it unsafe). A config alone of an
    unregistered family raises ``ValueError``. A refusing spec is returned as is; ``rm.wire``
    raises its reason."""
    spec = registered_architecture(model_or_config)
    if spec is not None:
        if isinstance(model_or_config, nn.Module):  # a text family inside a multimodal model: its towers
            return tower_spec(model_or_config, spec) or spec
        return spec
    if isinstance(model_or_config, nn.Module):
        return generic_spec(model_or_config)
    raise unknown_family(model_or_config)


# Dropout under CP: each rank's forward draws from its own forked random state (ringmaster.sharding.rng), so a
# per-element draw (nn.Dropout, F.dropout on activations, router jitter, Ulysses' attention-probability dropout)
# is the single-device distribution of masks and is not refused. What a fork cannot make right is a draw shared
# along the sequence: one decision per layer (LayerDrop) or per sample (drop path, stochastic depth) or per
# channel (feature dropout), which every rank would make alone for its shard of the same sequence.
_DROPOUT = re.compile(r"(dropout|pdrop|drop_rate|jitter_noise|layerdrop|layer_drop|drop_path|stochastic_depth)")
_SHARED_DRAW = re.compile(r"(layerdrop|layer_drop|drop_path|stochastic_depth)")
_DROP_PATH_CLASS = re.compile(r"(DropPath|StochasticDepth)")
_FEATURE_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)


@lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """The source of ``cls`` and of its bases that hold model code (not torch's, not transformers' shared
    machinery outside ``transformers.models``: PreTrainedModel, GenerationMixin); '' when unreadable."""
    parts = []
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if (klass is object or module.startswith("torch.") or module == "torch"
                or (module.startswith("transformers.") and not module.startswith("transformers.models."))):
            continue
        try:
            parts.append(_file_classes(inspect.getsourcefile(klass) or "").get(klass.__qualname__)
                         or inspect.getsource(klass))
        except (OSError, TypeError, SyntaxError):
            continue
    return "\n".join(parts)


@lru_cache(maxsize=64)
def _file_classes(filename: str) -> dict[str, str]:
    """qualname -> source (decorators included) of every class defined in the file ``filename``, from one parse of
    the file. ``inspect.getsource`` of a class parses the class's whole module file on every call (Python < 3.13),
    and a model's classes come from a few large modeling files: this reads each once. The first definition of a
    name wins, as in ``inspect``; a class not found here (a dynamic one) falls back to ``inspect.getsource``."""
    lines = linecache.getlines(filename)
    if not lines:
        return {}
    table: dict[str, str] = {}

    def visit(node, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                first = (child.decorator_list[0] if child.decorator_list else child).lineno
                table.setdefault(".".join([*stack, child.name]), "".join(lines[first - 1:child.end_lineno]))
                visit(child, [*stack, child.name])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*stack, child.name, "<locals>"])
            else:
                visit(child, stack)

    visit(ast.parse("".join(lines)), [])
    return table


def read_config_fields(model, config, pattern: re.Pattern = _DROPOUT) -> list[tuple[str, float]]:
    """The config fields matching ``pattern`` with a positive value that the model's code reads: the field's
    name appears in the source of a class of which ``model`` holds an instance (a field only a sequence-
    classification or multiple-choice head reads, gpt2's ``summary_first_dropout`` or gpt_neox's
    ``classifier_dropout``, is never read by the causal LM and is left alone)."""
    source = "\n".join(_class_source(cls) for cls in {type(m) for m in model.modules()})
    out = []
    for name, value in sorted(vars(config).items()):
        if (pattern.search(name) and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
                and re.search(rf"\b{re.escape(name)}\b", source)):
            out.append((name, value))
    return out


def _shared_draw_hazards(model, config, skip: tuple[str, ...] = ()) -> list[str]:
    """Draws a per-rank fork cannot make right: LayerDrop / drop path fields the model reads, feature dropout
    and drop-path modules (outside ``skip``: a VLM's vision tower runs whole on every rank, unforked)."""
    out = [f"config.{name}={value}: the model draws one decision per layer or per sample from it (LayerDrop, drop "
           "path), shared along the sequence; under CP each rank draws from its own forked random state, so the "
           "ranks would skip different layers (or samples) of one sequence, and Ring/Ulysses collectives would "
           f"pair different layers. Set {name}=0.0 for CP training"
           for name, value in read_config_fields(model, config, _SHARED_DRAW)]
    for path, module in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        cls = type(module).__name__
        p = getattr(module, "p", None) if isinstance(module, _FEATURE_DROPOUT) else None
        if p:
            out.append(f"layer {path!r} ({cls}) drops whole channels with p={p}: one draw shared along the sequence, "
                       "which each CP rank would make alone for its shard; set its dropout to 0.0 for CP training")
        elif _DROP_PATH_CLASS.search(cls) and (getattr(module, "drop_prob", None) or getattr(module, "p", None)):
            out.append(f"layer {path!r} ({cls}) drops whole samples (drop path): one draw per sample shared along the "
                       "sequence, which each CP rank would make alone for its shard; set its drop probability to 0.0 "
                       "for CP training")
    return out


def unforked_dropout(model) -> list[str]:
    """Dropout a model reached through ``rm.setup`` (not ``rm.wire``) would apply unforked: every rank of the CP
    group would draw the same masks. ``nn.Dropout`` modules with ``p > 0`` and dropout config fields the model's
    code reads (:func:`read_config_fields`)."""
    out = [f"layer {path!r} ({type(m).__name__}) drops with p={m.p}"
           for path, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    out += [f"config.{name}={value}" for name, value in read_config_fields(model, text_config(model.config))]
    return out


def _config_hazards(config) -> list[str]:
    # the router loss (output_router_logits) is summed over the group by rm.wire (sharding/router.py), which refuses
    # what it does not recognise
    out = []
    for name, value in sorted(vars(config).items()):
        if "capacity" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out.append(
                f"config.{name}={value}: MoE expert capacity drops tokens by their rank within the sequence; "
                "under CP each rank would count capacity over its shard. Set it to 0/None or use a CP size of 1")
    return out


def cp_hazards(model, spec: ArchitectureSpec, recurrent_paths=()) -> list[str]:
    """What would make the wired model silently wrong beyond its attention: convolutions over the
    sequence outside declared recurrent layers, per-sequence MoE statistics, random draws shared along the
    sequence (LayerDrop, drop path, feature dropout: :func:`_shared_draw_hazards`; per-element dropout runs
    under a per-rank forked random state, :mod:`ringmaster.sharding.rng`). Learned/absolute position tables are not a hazard here: ``rm.wire`` probes
    how the model numbers them and numbers each shard the same way, or refuses naming the table
    (:mod:`.positions`). Registered families are vouched for by their parity tests (only the MoE
    config and shared-draw checks apply to them); the generic path gets every check."""
    out = _config_hazards(text_config(model.config))
    out += _shared_draw_hazards(model, text_config(model.config), tuple(spec.vision_modules))
    if registered_architecture(model) is spec:
        return out
    skip = tuple(spec.vision_modules) + tuple(recurrent_paths)
    for path, module in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        cls = type(module).__name__
        if _SEQUENCE_POOLING_CLASS.search(cls):
            out.append(
                f"layer {path!r} ({cls}) pools or selects keys from the layer's own sequence outside the attention "
                "interface (a compressor of consecutive tokens, a top-k indexer): under CP it would see only the "
                "rank's shard, so its entries (and the keys they add to attention) are not the single-device ones. "
                "Use layers without it (deepseek_v4: layer_types all 'sliding_attention') or a CP size of 1")
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
            out.append(
                f"layer {path!r} ({cls}) convolves along the sequence outside attention: each rank would miss "
                "the neighbouring shard's tokens. Declare the layer as recurrent (a conv halo) in an "
                "ArchitectureSpec or use a CP size of 1")
    return out


def refuse_if_unsafe(model, spec: ArchitectureSpec, recurrent_paths=()) -> None:
    """Raise before anything changes: the spec's own refusal, else the first hazard."""
    if spec.refuse:
        raise UnsupportedLayerError(f"family {spec.name!r} is refused under CP: {spec.refuse}")
    hazards = cp_hazards(model, spec, recurrent_paths)
    if hazards:
        more = len(hazards) - 1
        raise UnsupportedLayerError(hazards[0] if not more else
                                    hazards[0] + f" (and {more} more, first: {hazards[1]})")


def refuse(model_types: tuple[str, ...], reason: str, name: str | None = None) -> ArchitectureSpec:
    """Register a refusal: ``rm.wire`` on these model types raises ``reason``."""
    return register_architecture(ArchitectureSpec(name=name or model_types[0], model_types=model_types,
                                                  attention_classes=(), refuse=reason))
