"""Stand-in ``mamba_ssm.ops.selective_scan_interface``."""
from standins.fla_mamba.reference import mamba_inner_fn, selective_scan_fn  # noqa: F401
