"""STAND-IN for ``mamba_ssm.ops`` (standins.kernels): CPU pure-torch test double, not the real package.
"""

__ringmaster_standin__ = True
