"""Hybrids with short convolutions: LFM2, LFM2-MoE, LFM3 (Liquid); Inkling; Inkling2, Inkling2-loop.

``full_attention`` / ``sliding_attention`` layers get Ulysses/Ring/USP through the attention
function; the ``conv`` layers (``Lfm*ShortConv``: a gated causal depthwise conv1d of
``conv_L_cache`` taps) get the halo of the previous shard (:mod:`ringmaster.recurrent.short_conv`).
MLP / MoE blocks are token-local. Inkling's attention adds a hidden-state-conditioned relative
position bias, rebuilt from global positions by :mod:`ringmaster.attention.relbias`. Inkling2 and
Inkling2-loop add per-token attention sinks (:mod:`ringmaster.attention.token_sinks`), attention residuals
over layer depth that call the attention interface (run locally: :mod:`ringmaster.attention.local`) and the
full layers' dynamic short convs (:mod:`ringmaster.recurrent.dynamic_conv`).
"""

from .spec import ArchitectureSpec, RelativeBiasSite, register_architecture

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
# (``x + conv(x)``), all through ``causal_conv1d_fn``: declared, exact with the halo. The attention adds a
# hidden-state-conditioned relative position bias: its bias module returns per-token states under CP and the
# CP attention builds the bias from global positions (attention/relbias.py); the full layers' log scaling
# of queries and bias by the *local* token index is moved to the global one there too.


def _inkling_states(bias_module, relative_states, query_positions, key_positions):
    """InklingRelativeLogits' per-token features: its ``relative_states`` input ``[B, S, H, d]``."""
    return relative_states


def _inkling_log_scale(module):
    """(alpha, n_floor) of a full layer's log scaling (queries and bias by the local token index), else None."""
    config = module.config
    if module.is_sliding or config.log_scaling_n_floor is None:
        return None
    return float(config.log_scaling_alpha), float(config.log_scaling_n_floor)


def _inkling2_states(bias_module, hidden_states, relative_distance, position_ids):
    """Inkling2RelativePositionBias' per-token features ``[B, S, H, d]``: its linear + (log-scaled) L2 clip;
    the log scale reads ``position_ids``, which are global under CP."""
    states = bias_module.linear(hidden_states).view(*hidden_states.shape[:-1], bias_module.num_heads, -1)
    return bias_module.norm(states, position_ids)


INKLING_TEXT = register_architecture(ArchitectureSpec(
    name="inkling_text",
    model_types=("inkling_text",),
    attention_classes=("InklingAttention",),
    recurrent_classes={"InklingShortConvolution": "short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    relative_bias={"InklingAttention": RelativeBiasSite(module="rel_logits_proj", states=_inkling_states,
                                                        log_scale=_inkling_log_scale)},
    notes="short convs (k/v, around attention and MLP): conv halo; relative position bias rebuilt from global "
          "positions inside the CP attention (Ulysses: eager with a dense bias; Ring: math block kernel)",
))

# Inkling2 / Inkling2-loop: the relative bias as Inkling's; per-token sinks (sink_proj) carried with the queries;
# the block / message attention residuals (a per-token attention over layer depth through the attention
# interface: q [B, S, n, D]) run the wrapped kernel locally; the full layers' dynamic short convs (per-token
# taps computed inline) get ringmaster's forward with the conv halo.

INKLING2_TEXT = register_architecture(ArchitectureSpec(
    name="inkling2_text",
    model_types=("inkling2_text",),
    attention_classes=("Inkling2SlidingAttention", "Inkling2FullAttention"),
    recurrent_classes={"Inkling2ShortConvolution": "short_conv",
                       "Inkling2DynamicShortConvolution": "dynamic_short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    relative_bias={c: RelativeBiasSite(module="relative_position_bias", states=_inkling2_states)
                   for c in ("Inkling2SlidingAttention", "Inkling2FullAttention")},
    local_attention=("Inkling2BlockAttentionResidual",),
    notes="short convs (conv halo) and the full layers' dynamic short convs (conv halo of the windows); relative "
          "position bias rebuilt from global positions; per-token sinks carried with the queries; the block "
          "attention residuals (attention over layer depth) run the wrapped kernel locally",
))

INKLING2_LOOP_TEXT = register_architecture(ArchitectureSpec(
    name="inkling2_loop_text",
    model_types=("inkling2_loop_text",),
    attention_classes=("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention"),
    recurrent_classes={"Inkling2LoopShortConvolution": "short_conv",
                       "Inkling2LoopDynamicShortConvolution": "dynamic_short_conv"},
    recurrent_kernels=SHORT_CONV_KERNELS,
    relative_bias={c: RelativeBiasSite(module="relative_position_bias", states=_inkling2_states)
                   for c in ("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention")},
    local_attention=("Inkling2LoopBlockAttentionResidual", "Inkling2LoopMessageAttentionResidual"),
    notes="as inkling2_text; the loop layers' message attention residuals (over layer depth) also run locally",
))
