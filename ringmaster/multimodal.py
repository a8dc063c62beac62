"""Vision-language models: shard the fused sequence after the vision encoder, never before.

A VLM builds its long sequence inside the model: the vision tower encodes whole images, the
image embeddings are scattered into the text embeddings at the placeholder tokens, and the
multimodal RoPE positions are computed over the whole sequence. So the full batch enters the
model on every rank, and a forward pre-hook on the language model (the first module that
only sees the fused sequence) cuts this rank's shard of every per-token tensor: the fused
``inputs_embeds``, the 3-row mrope ``position_ids``, the visual masks, and the deepstack
embeddings (re-selected for the visual tokens this rank holds, not chunked blindly).

The vision tower runs on every rank. That costs redundant encoder compute but no
communication, and it is exact for the gradient convention: each rank back-propagates its
shard's loss into the embeddings of its own image tokens, and the mean over the CP group of
the vision tower's gradients is the single-device gradient. Encoding once and broadcasting
would need a broadcast forward and an all-reduce of the embedding gradients backward.
"""

from __future__ import annotations


import torch

from .architectures import ArchitectureSpec
from .errors import UnsupportedLayerError
from .sharding import balancers
from .sharding.batch import shard_tensor
from .sharding.documents import BATCH_KWARG, positions_from_doc_ids

# labels stay aligned with the fused sequence, so only they are cut before the model
LABEL_KEYS = ("labels", "shift_labels")


def _reselect_deepstack(embeds, mask_full: torch.Tensor, mask_local: torch.Tensor, positions: torch.Tensor):
    """Rows of each deepstack tensor that belong to the visual tokens of this shard."""
    order = mask_full.reshape(-1).long().cumsum(0).view_as(mask_full) - 1  # visual index of each position
    rows = order[:, positions][mask_local]
    return [e.index_select(0, rows.to(e.device)) for e in embeds]


def shard_language_model_inputs(spec: ArchitectureSpec):
    """The forward pre-hook that cuts the fused sequence for this rank."""
    def pre_hook(module, args, kwargs):
        cpb = kwargs.get(BATCH_KWARG)
        if cpb is None:
            raise RuntimeError(
                f"{spec.name}: the language model was called without `ringmaster_batch`; shard VLM batches with "
                "context_parallel_region(batch) or ContextParallelContextManager (the full batch goes in, the "
                "vision encoder runs, then ringmaster cuts the fused sequence)"
            )
        kwargs = dict(kwargs)
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or embeds.shape[1] != cpb.seq_len:
            raise RuntimeError(f"{spec.name}: expected full-length inputs_embeds ({cpb.seq_len} tokens) at the "
                               f"language model, got {None if embeds is None else tuple(embeds.shape)}")
        positions = balancers.shard_positions(cpb.seq_len, cpb.size, cpb.rank, cpb.layout, device=embeds.device)
        mask_full = kwargs.get(spec.deepstack_mask_kwarg)
        if kwargs.get("position_ids") is None:  # e.g. LLaVA: the text model would number the shard from 0
            docs = cpb.docs_on(embeds.device)
            kwargs["position_ids"] = (positions_from_doc_ids(docs) if docs is not None else
                                      torch.arange(cpb.seq_len, device=embeds.device).expand(embeds.shape[0], -1))
        for key, dim in spec.sequence_kwargs.items():
            value = kwargs.get(key)
            if isinstance(value, torch.Tensor):
                kwargs[key] = shard_tensor(value, dim, cpb.rank, cpb.size, cpb.layout).contiguous()
        if spec.deepstack_kwarg and kwargs.get(spec.deepstack_kwarg) is not None and mask_full is not None:
            kwargs[spec.deepstack_kwarg] = _reselect_deepstack(kwargs[spec.deepstack_kwarg], mask_full,
                                                               kwargs[spec.deepstack_mask_kwarg], positions)
        kwargs["attention_mask"] = None  # full-length; the CP attention masks from ringmaster_batch
        return args, kwargs

    return pre_hook


class TowerOrder:
    """Fail closed if a module declared as running unsharded (``vision_modules``: towers, projectors)
    runs after the language model started in the same forward of the whole model: it would see the
    sharded sequence, not whole images. Bound to one wired model; the flags live only between the
    model's own pre- and post-hooks (a submodule called on its own is not checked)."""

    def __init__(self, spec: ArchitectureSpec):
        self.spec, self.in_forward, self.text_started = spec, False, False

    def model_pre(self, module, args, kwargs):
        self.in_forward, self.text_started = True, False

    def model_post(self, module, args, kwargs, output):
        self.in_forward = False

    def language_pre(self, module, args, kwargs):
        self.text_started = self.in_forward

    def tower_pre(self, path: str):
        def hook(module, args):
            if self.in_forward and self.text_started:
                raise UnsupportedLayerError(
                    f"{self.spec.name}: {path!r} ({type(module).__name__}) ran after the language model "
                    f"{self.spec.language_model!r} started, so it saw the CP-sharded sequence, not whole inputs; "
                    "ringmaster runs only towers that encode before the text sequence unsharded. Register the family "
                    "with an ArchitectureSpec whose vision_modules name only such towers, or use a CP size of 1")
        return hook


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for handle in self.handles:
            handle.remove()


def wire_multimodal(model, spec: ArchitectureSpec, attn_implementation: str | None):
    """Install the language-model pre-hook (and the tower order check) and switch only the text
    model's attention: a plain ``set_attn_implementation(name)`` on a VLM would switch the vision
    tower too. Returns a handle whose ``remove()`` drops the hooks (``rm.wire`` restores the configs'
    attention implementations itself)."""
    language_model = model.get_submodule(spec.language_model)
    config = model.config
    original = {"text_config": config.get_text_config()._attn_implementation}
    if getattr(config, "vision_config", None) is not None:
        original["vision_config"] = config.vision_config._attn_implementation
    if attn_implementation is not None:
        model.set_attn_implementation({**original, "text_config": attn_implementation})
    order = TowerOrder(spec)
    handles = [language_model.register_forward_pre_hook(shard_language_model_inputs(spec), with_kwargs=True),
               language_model.register_forward_pre_hook(order.language_pre, with_kwargs=True),
               model.register_forward_pre_hook(order.model_pre, with_kwargs=True),
               model.register_forward_hook(order.model_post, with_kwargs=True, always_call=True)]
    handles += [model.get_submodule(path).register_forward_pre_hook(order.tower_pre(path))
                for path in spec.vision_modules]
    return _Handles(handles)
