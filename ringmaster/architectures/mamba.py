"""Mamba families: pure Mamba1 (Mamba, FalconMamba), the Mamba1 hybrid Jamba, and pure Mamba2.

The Mamba1 mixers (causal conv1d + selective scan, state ``[d_inner, d_state]`` with a diagonal
decay) get the conv halo and exact cross-rank state passing (:mod:`ringmaster.recurrent.mamba1`);
pure Mamba2 mixers call the same kernels as the Mamba2 hybrids (:mod:`ringmaster.recurrent.mamba2`).
Jamba's attention layers get Ulysses/Ring/USP. The RMS norms whose class names say "Mamba" are
per-token (declared ignored). Mamba, FalconMamba and Mamba2 have no attention layer: the CP backend
only decides how the batch is cut.
"""

from .nemotron_h import MAMBA2_KERNELS
from .spec import ArchitectureSpec, register_architecture

# the module-level kernels transformers' Mamba1 mixers call by name (role -> name); wire intercepts them
MAMBA1_KERNELS = {"mamba1": {"conv": "causal_conv1d_fn", "scan": "mamba_selective_scan", "fused": "mamba_inner_fn"}}

MAMBA = register_architecture(ArchitectureSpec(
    name="mamba",
    model_types=("mamba",),
    attention_classes=(),
    recurrent_classes={"MambaMixer": "mamba1"},
    ignore_classes=("MambaRMSNorm",),
    recurrent_kernels=MAMBA1_KERNELS,
    notes="no attention layer; MambaForCausalLM calls its backbone without kwargs (the batch reaches the mixers "
          "through a pre-hook on the wired model)",
))

FALCON_MAMBA = register_architecture(ArchitectureSpec(
    name="falcon_mamba",
    model_types=("falcon_mamba",),
    attention_classes=(),
    recurrent_classes={"FalconMambaMixer": "mamba1"},
    ignore_classes=("FalconMambaRMSNorm", "FalconMambaWeightlessRMSNorm"),
    recurrent_kernels=MAMBA1_KERNELS,
    notes="Mamba1 with per-token RMS norms on dt, B and C",
))

JAMBA = register_architecture(ArchitectureSpec(
    name="jamba",
    model_types=("jamba",),
    attention_classes=("JambaAttention",),
    recurrent_classes={"JambaMambaMixer": "mamba1"},
    recurrent_kernels=MAMBA1_KERNELS,
    notes="attention / Mamba1 hybrid with MoE feed-forward layers",
))

MAMBA2 = register_architecture(ArchitectureSpec(
    name="mamba2",
    model_types=("mamba2",),
    attention_classes=(),
    recurrent_classes={"Mamba2Mixer": "mamba2"},
    ignore_classes=("Mamba2RMSNorm", "MambaRMSNormGated"),
    recurrent_kernels=MAMBA2_KERNELS,
    notes="no attention layer; Mamba2ForCausalLM calls its backbone without kwargs",
))

ZAMBA = register_architecture(ArchitectureSpec(
    name="zamba",
    model_types=("zamba",),
    attention_classes=("ZambaAttention",),
    recurrent_classes={"ZambaMambaMixer": "mamba1"},
    recurrent_kernels=MAMBA1_KERNELS,
    notes="Mamba1 mixers (one selective scan per mamba head) and a shared attention block whose weights are tied "
          "across the hybrid layers",
))

ZAMBA2 = register_architecture(ArchitectureSpec(
    name="zamba2",
    model_types=("zamba2",),
    attention_classes=("Zamba2Attention",),
    recurrent_classes={"Zamba2MambaMixer": "mamba2"},
    recurrent_kernels=MAMBA2_KERNELS,
    notes="Mamba2 mixers and shared attention blocks (tied weights, per-layer LoRA adapters on q/k/v and the MLP)",
))
