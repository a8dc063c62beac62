"""STAND-IN for ``mamba_ssm`` (standins.kernels): CPU pure-torch test double, not the real package.
Only what transformers resolves for training: selective_scan_fn, mamba_chunk_scan_combined."""

__ringmaster_standin__ = True
__version__ = "0.0.0+ringmaster.standin"

from .ops.selective_scan_interface import selective_scan_fn  # noqa: E402,F401
