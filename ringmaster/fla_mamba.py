"""Mamba mixers backed by flash-linear-attention (``config.mamba_backend == "fla"``).

axolotl's context-parallel plugin asks for these when a model runs its Mamba layers through
FLA's kernels. ringmaster's Mamba2 state passing wraps the transformers mixers (and their
mamba-ssm / torch kernels); FLA-backed mixers are not wired yet, so none is reported as
supported and the plugin refuses the configuration instead of training it wrong.
"""

from __future__ import annotations


def fla_mamba_mixers(model) -> list:
    """The FLA-backed Mamba mixers of ``model`` that ringmaster can make exact under CP (none yet)."""
    return []
