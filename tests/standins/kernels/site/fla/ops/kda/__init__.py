"""STAND-IN for ``fla.ops.kda`` (standins.kernels): CPU pure-torch test double, not the real package.
FLA's chunk_kda (fused_recurrent_kda keeps transformers' torch fallback)."""

__ringmaster_standin__ = True

from standins.kernels import as_package_function  # noqa: E402
from standins.kernels import reference as _reference  # noqa: E402

chunk_kda = as_package_function(_reference.chunk_kda, __name__)
