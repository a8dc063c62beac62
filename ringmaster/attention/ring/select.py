"""Which ring block kernel and which K/V rotation a runtime binds (decided once, at setup)."""

from __future__ import annotations

from ...config import RingImpl, RotateMethod


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


def resolve_rotate(rotate_method) -> str:
    return "allgather" if RotateMethod(rotate_method) is RotateMethod.ALLGATHER else "alltoall"
