"""STAND-IN for ``causal_conv1d`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
causal_conv1d_fn only (causal_conv1d_update keeps transformers' torch fallback)."""

__ringmaster_standin__ = True
__version__ = "0.0.0+ringmaster.standin"

from ringmaster.testing.kernel_standin.reference import causal_conv1d_fn  # noqa: E402,F401
