"""Gated-DeltaNet hybrids: Qwen3-Next, Qwen3.5, Qwen3.5-MoE (text models), OLMo-hybrid, Lara-mini and
Bailing-hybrid (Kimi delta attention: the same rule with a per-channel decay).

``full_attention`` layers get Ulysses/Ring/USP through the attention function; the
``linear_attention`` layers (gated DeltaNet: causal conv1d + chunked gated delta rule) get the
conv halo and exact cross-rank state passing (:mod:`ringmaster.recurrent.gated_deltanet`).
The vision towers of the Qwen3.5 VLMs are not declared here (see the VLM families).
"""

from .spec import ArchitectureSpec, register_architecture

# the module-level kernels the gated-DeltaNet layers call by name (role -> name); wire intercepts them
GDN_KERNELS = {"gated_deltanet": {"conv": "causal_conv1d_fn", "scan": "torch_chunk_gated_delta_rule"}}

QWEN3_NEXT = register_architecture(ArchitectureSpec(
    name="qwen3_next",
    model_types=("qwen3_next",),
    attention_classes=("Qwen3NextAttention",),
    recurrent_classes={"Qwen3NextGatedDeltaNet": "gated_deltanet"},
    recurrent_kernels=GDN_KERNELS,
    notes="layer_types mixes linear_attention (gated DeltaNet) and full_attention (gated softmax attention)",
))

QWEN3_5 = register_architecture(ArchitectureSpec(
    name="qwen3_5_text",
    model_types=("qwen3_5_text",),
    attention_classes=("Qwen3_5Attention",),
    recurrent_classes={"Qwen3_5GatedDeltaNet": "gated_deltanet"},
    recurrent_kernels=GDN_KERNELS,
))

QWEN3_5_MOE = register_architecture(ArchitectureSpec(
    name="qwen3_5_moe_text",
    model_types=("qwen3_5_moe_text",),
    attention_classes=("Qwen3_5MoeAttention",),
    recurrent_classes={"Qwen3_5MoeGatedDeltaNet": "gated_deltanet"},
    recurrent_kernels=GDN_KERNELS,
))

OLMO_HYBRID = register_architecture(ArchitectureSpec(
    name="olmo_hybrid",
    model_types=("olmo_hybrid",),
    attention_classes=("OlmoHybridAttention",),
    recurrent_classes={"OlmoHybridGatedDeltaNet": "gated_deltanet"},
    recurrent_kernels=GDN_KERNELS,
    notes="same kernels as Qwen3.5 (causal_conv1d_fn + torch_chunk_gated_delta_rule)",
))

LARA_MINI = register_architecture(ArchitectureSpec(
    name="lara_mini",
    model_types=("lara_mini",),
    attention_classes=("LaraMiniAttention",),
    recurrent_classes={"LaraMiniGatedDeltaNet": "gated_deltanet"},
    recurrent_kernels=GDN_KERNELS,
    notes="Qwen3.5's gated DeltaNet (same kernels), MoE MLPs, sliding and full attention layers",
))

# Kimi delta attention (KDA): the gated delta rule with a per-channel decay (``g`` is [b, l, h, d_k]);
# still linear in (state, values) jointly, so the gated-DeltaNet segment (values [v | 0], initial state
# [0 | I]) gives its chunk map unchanged: the same kind, other kernel names
KDA_KERNELS = {"gated_deltanet": {"conv": "causal_conv1d_fn", "scan": "chunk_kimi_delta_attention",
                                  "state_update": "recurrent_kimi_delta_attention"}}

BAILING_HYBRID = register_architecture(ArchitectureSpec(
    name="bailing_hybrid",
    model_types=("bailing_hybrid",),
    attention_classes=("BailingHybridAttention",),
    recurrent_classes={"BailingHybridDeltaAttention": "gated_deltanet"},
    # holds the decay's A_log / dt_bias but computes a per-token gate: no state along the sequence
    ignore_classes=("BailingHybridForgetGate",),
    recurrent_kernels=KDA_KERNELS,
    notes="linear_attention layers are Kimi delta attention (per-channel decay); full_attention layers are MLA",
))
