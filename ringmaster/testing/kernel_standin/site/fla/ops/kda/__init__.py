"""STAND-IN for ``fla.ops.kda`` (ringmaster.testing.kernel_standin): CPU pure-torch test double, not the real package.
FLA's chunk_kda (fused_recurrent_kda keeps transformers' torch fallback)."""

__ringmaster_standin__ = True

from ringmaster.testing.kernel_standin.reference import chunk_kda  # noqa: E402,F401
