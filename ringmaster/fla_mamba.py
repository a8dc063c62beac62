"""Mamba mixers backed by flash-linear-attention (``config.mamba_backend == "fla"``): the import path
axolotl 0.21's context-parallel plugin calls (``ringmaster.fla_mamba.fla_mamba_mixers``).

axolotl's ``mamba_backend: fla`` keeps the transformers Mamba/Mamba2 mixer and its parameters and runs
it through a view of flash-linear-attention's layer (``mixer.fla_mixer``), whose kernel path axolotl
re-binds to the hub kernels (``kernels-community/mamba-ssm``, ``causal-conv1d``). ringmaster wires those
mixers exactly under CP, composing with axolotl's re-binding, PEFT LoRA on their projections included
(``rm.wire`` / ``wire_recurrent_layers``; the code is :mod:`ringmaster.recurrent.fla_mamba`). The plugin
refuses ``mamba_backend: fla`` when this returns nothing for every model. Stand-in verified on CPU
(tests/standins/fla_mamba: fla and the hub kernels); not yet run on a GPU.
"""

from __future__ import annotations

from .recurrent.fla_mamba import check_fla_mixer, fla_mixers


def fla_mamba_mixers(model) -> list:
    """The FLA-backed Mamba/Mamba2 mixers of ``model`` (axolotl's ``mamba_backend: fla``) that ringmaster
    wires exactly under CP: ``[]`` when axolotl backed none with FLA. A FLA-backed mixer ringmaster cannot
    make exact raises (``UnsupportedLayerError``, naming the layer and the fix) instead of being left out."""
    return [module for path, module, kind in fla_mixers(model) if check_fla_mixer(module, path, kind)]
