"""Stand-in ``mamba_ssm.ops.triton.selective_state_update``."""
from standins.fla_mamba.reference import selective_state_update  # noqa: F401
