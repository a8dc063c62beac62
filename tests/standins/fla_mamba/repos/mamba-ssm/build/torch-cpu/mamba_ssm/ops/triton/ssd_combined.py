"""Stand-in ``mamba_ssm.ops.triton.ssd_combined``."""
from standins.fla_mamba.reference import (  # noqa: F401
    mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined)
