"""Which ring block kernel and which K/V rotation a runtime binds (decided once, at setup)."""

from __future__ import annotations

from ...config import RingImpl, RotateMethod


def is_flash_inner(inner_attn: str | None) -> bool:
    """The model runs a flash kernel: ``flash_attention_2/3`` or a hub kernel repo (``org/name``)."""
    inner = inner_attn or "sdpa"
    return inner.startswith("flash_attention") or "/" in inner


def resolve_ring_impl(ring_impl, inner_attn: str | None) -> RingImpl:
    """Pick the ring block kernel; every choice trains (forward and backward), on every device.

    AUTO: the hub flash kernels (``HF_KERNELS``) when the model uses a flash kernel, torch's fused
    ops (``ATEN``) otherwise. An explicit choice is kept; ``TORCH_NATIVE``, ``ATEN``'s former
    name, resolves to ``ATEN``."""
    impl = ring_impl if isinstance(ring_impl, RingImpl) else RingImpl(ring_impl)
    if impl is RingImpl.TORCH_NATIVE:
        return RingImpl.ATEN
    if impl is not RingImpl.AUTO:
        return impl
    return RingImpl.HF_KERNELS if is_flash_inner(inner_attn) else RingImpl.ATEN


def resolve_rotate(rotate_method) -> str:
    return "allgather" if RotateMethod(rotate_method) is RotateMethod.ALLGATHER else "alltoall"
