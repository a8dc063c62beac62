"""STAND-IN for ``fla.ops.gated_delta_rule`` (standins.kernels): CPU pure-torch test double, not the real package.
FLA's chunk_gated_delta_rule (fused_recurrent_* keep transformers' torch fallback)."""

__ringmaster_standin__ = True

from standins.kernels import as_package_function  # noqa: E402
from standins.kernels import reference as _reference  # noqa: E402

chunk_gated_delta_rule = as_package_function(_reference.chunk_gated_delta_rule, __name__)
