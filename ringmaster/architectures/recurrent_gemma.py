"""Recurrent Gemma (Griffin): recurrent blocks (conv1d + RG-LRU) interleaved with local (sliding
window) attention.

``RecurrentGemmaAttention`` dispatches through the attention interface (sliding window) and gets
Ulysses/Ring/USP; ``RecurrentGemmaRecurrentBlock`` gets the conv halo and exact cross-rank state
passing (:mod:`ringmaster.recurrent.rglru`). Every class of the family is named ``RecurrentGemma*``,
which the stateful-layer pattern matches: the token-local ones are listed in ``ignore_classes``, and
the RG-LRU itself (``RecurrentGemmaRglru``) is wired through its block.
"""

from .spec import ArchitectureSpec, register_architecture

RECURRENT_GEMMA = register_architecture(ArchitectureSpec(
    name="recurrent_gemma",
    model_types=("recurrent_gemma",),
    attention_classes=("RecurrentGemmaAttention",),
    recurrent_classes={"RecurrentGemmaRecurrentBlock": "rglru"},
    ignore_classes=("RecurrentGemmaRglru", "RecurrentGemmaRMSNorm", "RecurrentGemmaMlp",
                    "RecurrentGemmaRotaryEmbedding"),
    notes="block_types cycles recurrent, recurrent, attention",
))
