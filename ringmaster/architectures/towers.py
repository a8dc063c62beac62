"""A multimodal model whose text family is registered: derive its VLM spec from the module tree.

gemma3 (a SigLIP vision tower) and moss_transcribe_diarize (an audio tower around a qwen3 text
model) are found in the registry through their *text* config's ``model_type``, but the text
family's spec does not describe the encoder towers, whose attention is not the text sequence's.
Such a model is a VLM in ringmaster's sense (:mod:`ringmaster.multimodal`): the towers encode whole
images / audio clips on every rank before the fused text sequence exists, and the language
model's pre-hook cuts the sequence after them. So the spec is the text family's, plus:

- ``language_model``: the module whose config *is* the model's text config (HF builds it with
  ``AutoModel.from_config(config.text_config)``);
- ``vision_modules``: its siblings that hold modules of their own (towers, projectors), which run
  unsharded and are neither classified nor hazard-checked.

That a tower really runs before the language model, not on its sharded output, is checked on
every forward (:func:`ringmaster.multimodal.wire_multimodal` installs the order check).
"""

from __future__ import annotations

import torch.nn as nn

from .spec import ArchitectureSpec, text_config


def language_model_path(model) -> str | None:
    """The shortest path of a submodule whose ``config`` is the model's text config (not the model itself)."""
    tcfg = text_config(model.config)
    if tcfg is model.config:
        return None
    found = [path for path, module in model.named_modules() if path and getattr(module, "config", None) is tcfg]
    return min(found, key=lambda p: p.count(".")) if found else None


def tower_spec(model, spec: ArchitectureSpec) -> ArchitectureSpec | None:
    """``spec`` (a text family found through ``model``'s text config) as a VLM spec of ``model``, or
    None when ``model`` is the text model itself, or has no language model with sibling towers."""
    model_type = getattr(model.config, "model_type", None)
    if spec.multimodal or spec.refuse or not isinstance(model, nn.Module) or model_type in spec.model_types:
        return None
    path = language_model_path(model)
    if path is None:
        return None
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    towers = tuple(f"{parent_path}.{name}" if parent_path else name for name, child in parent.named_children()
                   if child is not model.get_submodule(path) and any(True for _ in child.children()))
    if not towers:
        return None
    return spec.vlm(f"{model_type} ({spec.name} text model)", (model_type,), language_model=path,
                    vision_modules=towers, notes=f"derived: towers {towers} run before {path}")
