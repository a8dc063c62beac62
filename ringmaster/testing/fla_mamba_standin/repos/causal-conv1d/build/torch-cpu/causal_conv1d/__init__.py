"""CPU stand-in for ``kernels-community/causal-conv1d`` (see ringmaster.testing.fla_mamba_standin)."""
from ringmaster.testing.fla_mamba_standin.reference import causal_conv1d_fn, causal_conv1d_update  # noqa: F401

STANDIN = True
__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
