"""Hybrids with short convolutions: LFM2, LFM2-MoE, LFM3 (Liquid); Inkling, Inkling2, Inkling2-loop (refused).

``full_attention`` / ``sliding_attention`` layers get Ulysses/Ring/USP through the attention
function; the ``conv`` layers (``Lfm*ShortConv``: a gated causal depthwise conv1d of
``conv_L_cache`` taps) get the halo of the previous shard (:mod:`ringmaster.recurrent.short_conv`).
MLP / MoE blocks are token-local. The Inkling families declare their short convolutions but are
refused for their attention's relative position bias (see their ``refuse`` reasons).
"""

from .spec import ArchitectureSpec, register_architecture

# the module-level kernel the short-conv layers call by name (role -> name); wire intercepts it
SHORT_CONV_KERNELS = {"short_conv": {"conv": "causal_conv1d_fn"}}

LFM2 = register_architecture(ArchitectureSpec(
    name="lfm2",
    model_types=("lfm2",),
    attention_classes=("Lfm2Attention",),
    recurrent_classes={"Lfm2ShortConv": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    notes="layer_types mixes conv (gated short conv, 3 taps) and full_attention",
))

LFM2_MOE = register_architecture(ArchitectureSpec(
    name="lfm2_moe",
    model_types=("lfm2_moe",),
    attention_classes=("Lfm2MoeAttention",),
    recurrent_classes={"Lfm2MoeShortConv": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    notes="as lfm2, with MoE MLPs after num_dense_layers",
))

LFM3 = register_architecture(ArchitectureSpec(
    name="lfm3",
    model_types=("lfm3",),
    attention_classes=("Lfm3Attention",),
    recurrent_classes={"Lfm3ShortConv": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    notes="layer_types mixes conv (7 taps), sliding_attention and full_attention",
))


# Inkling: short convolutions on the k/v projections and on the residual stream around attention and MLP
# (``x + conv(x)``), all through ``causal_conv1d_fn``: declared, exact with the halo (checked layer by
# layer in tests/test_recurrent_variants.py). The families stay refused for their attention.
_INKLING_BIAS = (
    "adds a hidden-state-conditioned relative position bias to every attention score (`position_bias`, "
    "[batch, heads, q, kv], built from the distances torch.arange gives over the *local* shard) and passes it "
    "to the attention function; ringmaster CP would have to rebuild it from global positions inside each "
    "attention block (a per-query score_mod over the distance), which it does not. ")
_INKLING_CONVS = ("The short convolutions ({}) are declared as 'short_conv' and are exact under CP on their own. "
                  "Use a CP size of 1 for this family")

INKLING_TEXT = register_architecture(ArchitectureSpec(
    name="inkling_text",
    model_types=("inkling_text",),
    attention_classes=("InklingAttention",),
    recurrent_classes={"InklingShortConvolution": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    refuse=("InklingAttention " + _INKLING_BIAS + "Its log-scaled queries also use local positions. "
            + _INKLING_CONVS.format("InklingShortConvolution: k_sconv, v_sconv, attn_sconv, mlp_sconv")),
))

_INKLING2_DYNAMIC = ("The full-attention layers' {} (k/v) computes per-token taps inline (unfold, no kernel "
                     "call ringmaster could give the previous shard's halo), so it has no CP path either. ")

INKLING2_TEXT = register_architecture(ArchitectureSpec(
    name="inkling2_text",
    model_types=("inkling2_text",),
    attention_classes=("Inkling2SlidingAttention", "Inkling2FullAttention"),
    recurrent_classes={"Inkling2ShortConvolution": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    refuse=("Inkling2SlidingAttention / Inkling2FullAttention (Inkling2RelativePositionBias) " + _INKLING_BIAS
            + _INKLING2_DYNAMIC.format("Inkling2DynamicShortConvolution")
            + _INKLING_CONVS.format("Inkling2ShortConvolution: the sliding layers' k_proj.sconv / v_proj.sconv")),
))

INKLING2_LOOP_TEXT = register_architecture(ArchitectureSpec(
    name="inkling2_loop_text",
    model_types=("inkling2_loop_text",),
    attention_classes=("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention"),
    recurrent_classes={"Inkling2LoopShortConvolution": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    refuse=("Inkling2LoopSlidingAttention / Inkling2LoopFullAttention (Inkling2LoopRelativePositionBias) "
            + _INKLING_BIAS + _INKLING2_DYNAMIC.format("Inkling2LoopDynamicShortConvolution")
            + _INKLING_CONVS.format("Inkling2LoopShortConvolution: the sliding layers' k_proj.sconv / "
                                    "v_proj.sconv")),
))
