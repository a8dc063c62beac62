"""Import path kept for axolotl 0.21 (``ringmaster.strategies.ring.resolve_ring_impl``): the code
lives in :mod:`ringmaster.attention.ring.select`."""

from ..attention.ring.select import resolve_ring_impl, resolve_rotate  # noqa: F401
