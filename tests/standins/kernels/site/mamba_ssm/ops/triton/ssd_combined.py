"""STAND-IN for ``mamba_ssm.ops.triton.ssd_combined`` (standins.kernels): CPU pure-torch test double, not the real package.
mamba-ssm's Mamba2 SSD scan."""

__ringmaster_standin__ = True

from standins.kernels import as_package_function  # noqa: E402
from standins.kernels import reference as _reference  # noqa: E402

mamba_chunk_scan_combined = as_package_function(_reference.mamba_chunk_scan_combined, __name__)
