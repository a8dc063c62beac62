"""STAND-IN for ``mamba_ssm.ops.triton.ssd_combined`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
mamba-ssm's Mamba2 SSD scan."""

__ringmaster_standin__ = True

from ringmaster.testing.kernel_standin.reference import mamba_chunk_scan_combined  # noqa: E402,F401
