"""STAND-IN for ``fla.ops.gated_delta_rule`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
FLA's chunk_gated_delta_rule (fused_recurrent_* keep transformers' torch fallback)."""

__ringmaster_standin__ = True

from ringmaster.testing.kernel_standin.reference import chunk_gated_delta_rule  # noqa: E402,F401
