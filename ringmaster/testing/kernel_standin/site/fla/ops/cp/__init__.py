"""STAND-IN for ``fla.ops.cp`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
FLA's context-parallel context; the stand-in kernels honour ``cp_context`` by gathering the stream."""

__ringmaster_standin__ = True

from ringmaster.testing.kernel_standin.reference import FLACPContext, build_cp_context  # noqa: E402,F401
