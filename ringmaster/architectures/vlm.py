"""Vision-language models: the text family that gets CP, and where the fused sequence starts.

The language model's pre-hook is where ringmaster cuts the sequence (see ``multimodal.py``);
the vision tower and projector run unsharded on every rank. A VLM spec is its text family's
spec plus the sharding fields (:meth:`ArchitectureSpec.vlm`), registered under the VLM's
top-level ``model_type``.
"""

from .spec import ArchitectureSpec, register_architecture
from .llama import LLAMA
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE

QWEN2_5_VL_TEXT = register_architecture(ArchitectureSpec(
    name="qwen2_5_vl_text",
    model_types=("qwen2_5_vl_text",),
    attention_classes=("Qwen2_5_VLAttention",),
    notes="3-row mrope position_ids",
))
QWEN3_VL_TEXT = register_architecture(ArchitectureSpec(
    name="qwen3_vl_text",
    model_types=("qwen3_vl_text",),
    attention_classes=("Qwen3VLTextAttention",),
    notes="mrope + deepstack visual embeddings added in the first layers",
))

QWEN2_5_VL = register_architecture(QWEN2_5_VL_TEXT.vlm(
    "qwen2_5_vl", ("qwen2_5_vl",), language_model="model.language_model", vision_modules=("model.visual",)))
QWEN3_VL = register_architecture(QWEN3_VL_TEXT.vlm(
    "qwen3_vl", ("qwen3_vl",), language_model="model.language_model", vision_modules=("model.visual",),
    deepstack_kwarg="deepstack_visual_embeds"))
QWEN3_5_VL = register_architecture(QWEN3_5.vlm(
    "qwen3_5_vl", ("qwen3_5",), language_model="model.language_model", vision_modules=("model.visual",)))
QWEN3_5_MOE_VL = register_architecture(QWEN3_5_MOE.vlm(
    "qwen3_5_moe_vl", ("qwen3_5_moe",), language_model="model.language_model", vision_modules=("model.visual",)))
LLAVA = register_architecture(LLAMA.vlm(
    "llava", ("llava",), language_model="model.language_model",
    vision_modules=("model.vision_tower", "model.multi_modal_projector")))
