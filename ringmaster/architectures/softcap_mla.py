"""Attention families with logit soft-capping (Gemma-2) or MLA (query/key heads wider than value
heads: DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite). Nothing to declare beyond the attention class:
the ``softcap`` kwarg reaches the kernels (ring block kernels apply it; Ulysses passes it to the
model's eager/flex/flash kernel and refuses sdpa), and the narrower value heads travel in their own
all-to-all (Ulysses) or beside K in the ring's K|V buffer."""

from .spec import ArchitectureSpec, register_architecture

GEMMA2 = register_architecture(ArchitectureSpec(
    name="gemma2",
    model_types=("gemma2",),
    attention_classes=("Gemma2Attention",),
    notes="attention logit softcap (attn_logit_softcapping); mixed sliding/full layers",
))

_MLA = (("deepseek_v2", "DeepseekV2Attention"), ("deepseek_v3", "DeepseekV3Attention"),
        ("minicpm3", "MiniCPM3Attention"), ("glm4_moe_lite", "Glm4MoeLiteAttention"))

MLA = [register_architecture(ArchitectureSpec(name=model_type, model_types=(model_type,), attention_classes=(cls,),
                                              notes="MLA: query/key head dim != value head dim"))
       for model_type, cls in _MLA]
