"""STAND-IN for ``mamba_ssm.ops`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
"""

__ringmaster_standin__ = True
