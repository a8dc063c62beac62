"""STAND-IN for ``mamba_ssm.ops.triton`` (standins.kernels): CPU pure-torch test double, not the real package.
"""

__ringmaster_standin__ = True
