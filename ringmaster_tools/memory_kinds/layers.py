"""The decoder layers of a model as the memory planner counts them: each layer's token mixers as
``rm.wire``'s classifier sees them (``ringmaster.architectures.classify_layers``: attention, or a
recurrent kind), its MLP (dense, mixture of experts, or none) and its norms. Works on a model
built on the meta device."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

_MLP = re.compile(r"(MLP|Mlp|FeedForward|FFN|Ffn|Moe|MoE|SparseMoe|Experts?Block)")
_NORM = re.compile(r"Norm(alization)?$|Norm[A-Z]|LayerNorm|RMSNorm")   # not InklingNormedEmbedding


@dataclass
class Part:
    path: str
    kind: str              # "attention", "mlp", "moe", "norm" or a recurrent kind (ringmaster.recurrent.registry)
    module: nn.Module = field(repr=False)
    dims: dict = field(default_factory=dict)


@dataclass
class Layer:
    path: str
    parts: list[Part]

    @property
    def mixers(self) -> list[str]:
        return [p.kind for p in self.parts if p.kind not in ("mlp", "moe", "norm")]

    @property
    def label(self) -> str:
        """``attention``, a recurrent kind, ``mlp only`` or ``a+b`` for a layer with two mixers."""
        kinds = list(dict.fromkeys(self.mixers))
        return "+".join(kinds) if kinds else "mlp only"


def is_moe(module: nn.Module) -> bool:
    """A mixture-of-experts block: it holds experts (a dense ``Glm4MoeMLP`` / ``AfmoeMLP`` does not)."""
    return hasattr(module, "experts") or hasattr(module, "input_linear") or "Sparse" in type(module).__name__


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of the longest ``ModuleList`` of the text model (its decoder layers)."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and (best is None or len(module) > len(best[1])):
            if "vision" in path or "visual" in path:
                continue
            best = (path, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers")
    return [(f"{best[0]}.{i}", layer) for i, layer in enumerate(best[1])]


def _inside(path: str, prefix: str) -> bool:
    return path.startswith(prefix + ".")


def describe(model: nn.Module) -> list[Layer]:
    """Every decoder layer's parts, the mixers classified exactly as ``rm.wire`` does."""
    from ringmaster.architectures import classify_layers, get_architecture

    from . import kind_model

    classes = classify_layers(model, get_architecture(model))
    mixers = [(p, "attention") for p in classes.attention] + [(p, k) for p, _, k in classes.recurrent]
    modules = dict(model.named_modules())
    layers = []
    for lpath, layer in decoder_layers(model):
        parts = [Part(p, k, modules[p]) for p, k in mixers if _inside(p, lpath)]
        taken = [p.path for p in parts]
        for name, child in layer.named_children():
            cpath = f"{lpath}.{name}"
            if any(cpath == t or _inside(t, cpath) or _inside(cpath, t) for t in taken):
                continue
            cls = type(child).__name__
            if _NORM.search(cls):
                parts.append(Part(cpath, "norm", child))
            elif _MLP.search(cls) or name in ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"):
                parts.append(Part(cpath, "moe" if is_moe(child) else "mlp", child))
        for part in parts:
            if part.kind == "norm":
                part.dims = norm_dims(part.module)
            else:
                part.dims = kind_model(part.kind).dims(part.module)
        layers.append(Layer(lpath, parts))
    return layers


def _norm_width(module: nn.Module) -> int:
    w = getattr(module, "weight", None)
    if w is not None:
        return w.shape[-1]
    return int(getattr(module, "hidden_size", 0) or getattr(module, "normalized_shape", (0,))[-1])


def _traced_saved(module: nn.Module, width: int, dtype, tokens: int) -> int:
    """Bytes ``module``'s graph saves for a [1, tokens, width] input of ``dtype``: a copy of the module with
    uninitialised CPU parameters (a norm's are one row: no memory to speak of; the values do not change
    what autograd saves) traced on one or two tokens."""
    import copy

    import torch

    from ..memory_probe import new_storage_hook, weight_storages

    traced = copy.deepcopy(module).to_empty(device="cpu").to(dtype)
    sizes: list[int] = []
    pack = new_storage_hook(weight_storages(traced), lambda t, st: sizes.append(st.nbytes()))
    x = torch.zeros(1, tokens, width, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module_out = traced(x)
    del module_out
    return sum(sizes)


def norm_dims(module: nn.Module) -> dict:
    """A norm's width and what it saves per token and per layer, for 4- and 2-byte activations, traced
    (``_traced_saved``; works for a module on the meta device): norms differ by family (Llama casts
    the normalised value back before the weight multiply, Nemotron-H multiplies in fp32, LayerNorm
    saves mean and rstd)."""
    import torch

    from . import norm_bytes

    width = _norm_width(module)
    out = {"width": width}
    for b, dtype in ((4, torch.float32), (2, torch.bfloat16)):
        try:
            one, two = (_traced_saved(module, width, dtype, n) for n in (1, 2))
            out[b] = (two - one, 2 * one - two)   # (per token, fixed)
        except Exception:  # noqa: BLE001 - a norm that cannot run alone: HF RMSNorm's count
            out[b] = (norm_bytes(width, b), 0)
    return out


def final_norm(model: nn.Module) -> dict | None:
    """Dims of the norm between the last decoder layer and the LM head (None when not found)."""
    layer_list = decoder_layers(model)[0][0].rpartition(".")[0]
    parent = layer_list.rpartition(".")[0]
    modules = dict(model.named_modules())
    owner = modules.get(parent, model)
    for name, child in owner.named_children():
        if _NORM.search(type(child).__name__) and "Embed" not in type(child).__name__:
            return norm_dims(child)
    return None
