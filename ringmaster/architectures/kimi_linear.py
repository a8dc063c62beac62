"""Kimi Linear: Kimi Delta Attention (per-channel gated delta rule) interleaved with MLA softmax
attention, MoE MLPs.

``full_attention`` layers (``KimiLinearAttention``, MLA without RoPE on the queries' nope part)
dispatch through the attention interface and get Ulysses/Ring/USP; the ``linear_attention`` layers
get the conv halo and exact cross-rank state passing (:mod:`ringmaster.recurrent.kda`). The
forget gate module holds ``A_log``/``dt_bias`` (which marks a module stateful) but is token-local:
its layer's state passing covers it.
"""

from .spec import ArchitectureSpec, register_architecture

KIMI_LINEAR = register_architecture(ArchitectureSpec(
    name="kimi_linear",
    model_types=("kimi_linear",),
    attention_classes=("KimiLinearAttention",),
    recurrent_classes={"KimiLinearDeltaAttention": "kda"},
    ignore_classes=("KimiLinearForgetGate",),
    recurrent_kernels={"kda": {"conv": "causal_conv1d_fn", "scan": "chunk_kimi_delta_attention"}},
    notes="layer_types mixes linear_attention (KDA) and full_attention (MLA)",
))
