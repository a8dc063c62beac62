"""Plain-attention decoder families: every mixing layer is softmax attention.

Sliding-window layers (Mistral, Gemma3, gpt-oss) and attention sinks (gpt-oss) need nothing
declared here: the window reaches the kernel through HF's mask builders and the
``sliding_window`` kwarg, sinks through the module's ``sinks`` parameter.
"""

from .spec import ArchitectureSpec, register_architecture

LLAMA = register_architecture(ArchitectureSpec(
    name="llama",
    model_types=("llama",),
    attention_classes=("LlamaAttention",),
))

MISTRAL = register_architecture(ArchitectureSpec(
    name="mistral",
    model_types=("mistral",),
    attention_classes=("MistralAttention",),
))

QWEN2 = register_architecture(ArchitectureSpec(
    name="qwen2",
    model_types=("qwen2",),
    attention_classes=("Qwen2Attention",),
))

QWEN3 = register_architecture(ArchitectureSpec(
    name="qwen3",
    model_types=("qwen3",),
    attention_classes=("Qwen3Attention",),
))

QWEN3_MOE = register_architecture(ArchitectureSpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    attention_classes=("Qwen3MoeAttention",),
))

GEMMA3 = register_architecture(ArchitectureSpec(
    name="gemma3_text",
    model_types=("gemma3_text",),
    attention_classes=("Gemma3Attention",),
    notes="mixed sliding/full layers from config.layer_types",
))

GPT_OSS = register_architecture(ArchitectureSpec(
    name="gpt_oss",
    model_types=("gpt_oss",),
    attention_classes=("GptOssAttention",),
    notes="attention sinks: module.sinks sliced to each rank's heads",
))

LLAMA4_TEXT = register_architecture(ArchitectureSpec(
    name="llama4_text",
    model_types=("llama4_text",),
    attention_classes=("Llama4TextAttention",),
    notes="chunked_attention layers (attention_chunk_size) masked as fixed-length documents of global "
          "positions; NoPE layers' query temperature rescaled to global positions (attention/layer_rules.py)",
))

GEMMA3N_TEXT = register_architecture(ArchitectureSpec(
    name="gemma3n_text",
    model_types=("gemma3n_text",),
    attention_classes=("Gemma3nTextAttention",),
    notes="cross-layer KV sharing (kv_sharing_modes): later layers reuse the shard's own K/V, which their "
          "CP attention gets like any other; exact with no extra wiring",
))

GEMMA4_TEXT = register_architecture(ArchitectureSpec(
    name="gemma4_text",
    model_types=("gemma4_text",),
    attention_classes=("Gemma4TextAttention",),
    notes="cross-layer KV sharing as gemma3n; logits_to_keep > 0 (queries sliced before the KV-shared layers) "
          "is refused",
))
