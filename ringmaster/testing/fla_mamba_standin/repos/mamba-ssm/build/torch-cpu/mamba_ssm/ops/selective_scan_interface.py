"""Stand-in ``mamba_ssm.ops.selective_scan_interface``."""
from ringmaster.testing.fla_mamba_standin.reference import mamba_inner_fn, selective_scan_fn  # noqa: F401
