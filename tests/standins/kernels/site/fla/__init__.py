"""STAND-IN for ``fla`` (standins.kernels): CPU pure-torch test double, not the real package.
Nothing at the root: transformers then imports fla.ops.<kernel> (as for the real FLA's nested ops)."""

__ringmaster_standin__ = True
__version__ = "0.0.0+ringmaster.standin"
