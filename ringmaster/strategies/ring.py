"""Ring attention (KV blocks rotate around the CP group). The block-kernel choice lives here."""

from __future__ import annotations

from ..config import RingImpl


def resolve_ring_impl(ring_impl, inner_attn: str | None) -> RingImpl:
    """Pick the ring block kernel: flash kernels from the hub when the model uses a flash kernel,
    aten's LSE-returning SDPA ops otherwise; an explicit choice is kept."""
    impl = ring_impl if isinstance(ring_impl, RingImpl) else RingImpl(ring_impl)
    if impl is not RingImpl.AUTO:
        return impl
    inner = inner_attn or "sdpa"
    if "flash" in inner or "/" in inner:
        return RingImpl.HF_KERNELS
    return RingImpl.TORCH_NATIVE
