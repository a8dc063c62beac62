"""MiniMax (MiniMax-Text-01 / M1): lightning attention (linear, scalar decay per head) interleaved
with softmax attention, MoE MLPs.

``full_attention`` layers (``MiniMaxAttention``) dispatch through the attention interface and get
Ulysses/Ring/USP; the ``linear_attention`` layers get exact cross-rank state passing
(:mod:`ringmaster.recurrent.lightning`).
"""

from .spec import ArchitectureSpec, register_architecture

MINIMAX = register_architecture(ArchitectureSpec(
    name="minimax",
    model_types=("minimax",),
    attention_classes=("MiniMaxAttention",),
    recurrent_classes={"MiniMaxLightningAttention": "lightning"},
    notes="layer_types mixes linear_attention (lightning attention) and full_attention",
))
