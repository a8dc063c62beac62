"""Stand-in ``mamba_ssm.ops.triton``."""
