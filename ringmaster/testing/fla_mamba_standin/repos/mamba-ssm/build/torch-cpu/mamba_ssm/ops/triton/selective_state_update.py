"""Stand-in ``mamba_ssm.ops.triton.selective_state_update``."""
from ringmaster.testing.fla_mamba_standin.reference import selective_state_update  # noqa: F401
