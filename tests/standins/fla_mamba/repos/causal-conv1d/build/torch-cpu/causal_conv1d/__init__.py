"""CPU stand-in for ``kernels-community/causal-conv1d`` (see standins.fla_mamba)."""
from standins.fla_mamba.reference import causal_conv1d_fn, causal_conv1d_update  # noqa: F401

STANDIN = True
__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]
