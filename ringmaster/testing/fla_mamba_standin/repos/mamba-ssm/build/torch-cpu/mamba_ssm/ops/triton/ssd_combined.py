"""Stand-in ``mamba_ssm.ops.triton.ssd_combined``."""
from ringmaster.testing.fla_mamba_standin.reference import (  # noqa: F401
    mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined)
