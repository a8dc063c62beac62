"""Mamba2 hybrids: Nemotron-H, Bamba, Falcon-H1, GraniteMoeHybrid.

Attention blocks get Ulysses/Ring/USP; the Mamba2 mixers (causal conv1d + SSD chunk scan)
get the conv halo and exact cross-rank state passing (:mod:`ringmaster.recurrent.mamba2`);
MLP / MoE blocks are per-token and untouched. All four mixers call the same module-level
kernels (``causal_conv1d_fn``, ``mamba2_chunk_scan``, the fused
``mamba2_split_conv1d_scan_combined`` that CP routes around).
"""

from .spec import ArchitectureSpec, register_architecture

# the module-level kernels transformers' Mamba2 mixers call by name (role -> name); wire intercepts them
MAMBA2_KERNELS = {"mamba2": {"conv": "causal_conv1d_fn", "scan": "mamba2_chunk_scan",
                             "fused": "mamba2_split_conv1d_scan_combined"}}

NEMOTRON_H = register_architecture(ArchitectureSpec(
    name="nemotron_h",
    model_types=("nemotron_h",),
    attention_classes=("NemotronHAttention",),
    recurrent_classes={"NemotronHMamba2Mixer": "mamba2"},
    recurrent_kernels=MAMBA2_KERNELS,
))

BAMBA = register_architecture(ArchitectureSpec(
    name="bamba",
    model_types=("bamba",),
    attention_classes=("BambaAttention",),
    recurrent_classes={"BambaMixer": "mamba2"},
    recurrent_kernels=MAMBA2_KERNELS,
))

FALCON_H1 = register_architecture(ArchitectureSpec(
    name="falcon_h1",
    model_types=("falcon_h1",),
    attention_classes=("FalconH1Attention",),
    recurrent_classes={"FalconH1Mixer": "mamba2"},
    recurrent_kernels=MAMBA2_KERNELS,
    notes="attention and Mamba2 mixer run in parallel inside each layer",
))

GRANITE_MOE_HYBRID = register_architecture(ArchitectureSpec(
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    attention_classes=("GraniteMoeHybridAttention",),
    recurrent_classes={"GraniteMoeHybridMambaLayer": "mamba2"},
    recurrent_kernels=MAMBA2_KERNELS,
))
