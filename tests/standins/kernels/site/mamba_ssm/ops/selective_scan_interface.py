"""STAND-IN for ``mamba_ssm.ops.selective_scan_interface`` (standins.kernels): CPU pure-torch test double, not the real package.
mamba-ssm's Mamba1 scan (no initial state; the last state's gradient is dropped, as upstream)."""

__ringmaster_standin__ = True

from standins.kernels import as_package_function  # noqa: E402
from standins.kernels import reference as _reference  # noqa: E402

selective_scan_fn = as_package_function(_reference.selective_scan_fn, __name__)
