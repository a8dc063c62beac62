"""Vision-language models: the text family that gets CP, and where the fused sequence starts.

The language model's pre-hook is where ringmaster cuts the sequence (see ``multimodal.py``);
the vision tower and projector run unsharded on every rank.
"""

from ..multimodal import MultimodalSpec, register_multimodal
from . import ArchitectureSpec, register_architecture

register_architecture(ArchitectureSpec(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl_text",),
    attention_classes=("Qwen2_5_VLAttention",),
    notes="3-row mrope position_ids",
))
register_architecture(ArchitectureSpec(
    name="qwen3_vl",
    model_types=("qwen3_vl_text",),
    attention_classes=("Qwen3VLTextAttention",),
    notes="mrope + deepstack visual embeddings added in the first layers",
))

register_multimodal(MultimodalSpec(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    language_model="model.language_model",
    vision_modules=("model.visual",),
))
register_multimodal(MultimodalSpec(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    language_model="model.language_model",
    vision_modules=("model.visual",),
    deepstack_kwarg="deepstack_visual_embeds",
))
register_multimodal(MultimodalSpec(
    name="qwen3_5_vl",
    model_types=("qwen3_5", "qwen3_5_moe"),
    language_model="model.language_model",
    vision_modules=("model.visual",),
))
register_multimodal(MultimodalSpec(
    name="llava",
    model_types=("llava",),
    language_model="model.language_model",
    vision_modules=("model.vision_tower", "model.multi_modal_projector"),
))
