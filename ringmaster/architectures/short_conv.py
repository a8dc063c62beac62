"""Hybrids with short convolutions: LFM2, LFM2-MoE, LFM3 (Liquid).

``full_attention`` / ``sliding_attention`` layers get Ulysses/Ring/USP through the attention
function; the ``conv`` layers (``Lfm*ShortConv``: a gated causal depthwise conv1d of
``conv_L_cache`` taps) get the halo of the previous shard (:mod:`ringmaster.recurrent.short_conv`).
MLP / MoE blocks are token-local.
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
