"""STAND-IN for ``fla.ops.cp`` (standins.kernels): CPU pure-torch test double, not the real package.
FLA's context-parallel context; the stand-in kernels honour ``cp_context`` by gathering the stream."""

__ringmaster_standin__ = True

from standins.kernels.reference import FLACPContext, build_cp_context  # noqa: E402,F401
