"""STAND-IN for ``mamba_ssm.ops.selective_scan_interface`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
mamba-ssm's Mamba1 scan (no initial state; the last state's gradient is dropped, as upstream)."""

__ringmaster_standin__ = True

from ringmaster.testing.kernel_standin.reference import selective_scan_fn  # noqa: E402,F401
