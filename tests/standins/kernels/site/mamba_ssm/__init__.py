"""STAND-IN for ``mamba_ssm`` (standins.kernels): CPU pure-torch test double, not the real package.
Only what transformers resolves for Mamba1 training: selective_scan_fn (the SSD scan runs for real: realkernels.mamba)."""

__ringmaster_standin__ = True
__version__ = "0.0.0+ringmaster.standin"

from .ops.selective_scan_interface import selective_scan_fn  # noqa: E402,F401
