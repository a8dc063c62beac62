"""STAND-IN for ``causal_conv1d`` (standins.kernels): CPU pure-torch test double, not the real package.
causal_conv1d_fn only (causal_conv1d_update keeps transformers' torch fallback)."""

__ringmaster_standin__ = True
__version__ = "0.0.0+ringmaster.standin"

from standins.kernels import as_package_function  # noqa: E402
from standins.kernels import reference as _reference  # noqa: E402

causal_conv1d_fn = as_package_function(_reference.causal_conv1d_fn, __name__)
