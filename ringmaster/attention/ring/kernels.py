"""Block kernels: attention of a query block against one K/V block, returning ``(out, lse)``.

Every provider has the same interface, forward and backward:

    forward(q, k, v, scale, mask, softcap=None)                   -> out [B,H,Sq,D_v], lse [B,H,Sq] (fp32)
    backward(dout, q, k, v, out, lse, scale, mask, softcap=None)  -> dq, dk, dv
    check(q, v, softcap)    raises, before any collective, what the provider cannot run

``softcap`` (Gemma-2) caps every score at ``softcap * tanh(s / softcap)`` inside the block, forward and
backward; the LSE merge is unchanged by it. v's head dim ``D_v`` may differ from q/k's (MLA).

``mask`` is ``None`` (every key visible), ``"causal"`` (a square diagonal block), a bool
``[Sq, Sk]`` / ``[B, 1, Sq, Sk]`` tensor (True = attend), or a structured
:class:`.masks.BlockMask` (what the ring loop passes: a band of diagonals, documents, or both).
q is ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``: GQA is handled inside the kernel, never on the wire.

The backward receives the *merged* output and LSE of the whole ring, not the block's own:
``P = exp(S - lse_merged)`` is then exactly this block's share of the global softmax, so
the per-block gradients add up to the exact gradient for every provider (flash kernels'
backward ignores the LSE gradient, so merging through autograd would be wrong).

Providers: ``math`` (:mod:`.math_kernel`, the dense reference), ``aten`` (:mod:`.aten`, torch's
fused ops; ``torch_native`` is its former name), ``hf_kernels`` (:mod:`.hub`, the hub flash kernels).
"""

from __future__ import annotations

import torch

from ...config import RingImpl
from . import aten_cuda
from .aten import AtenKernel
from .hub import HfKernelsKernel, hub_dtype_ok
from .math_kernel import MathKernel

__all__ = ["MathKernel", "AtenKernel", "HfKernelsKernel", "TorchNativeKernel", "check_dtype", "get_kernel"]

TorchNativeKernel = AtenKernel  # the provider's former name


def check_dtype(impl: RingImpl, device, dtype: torch.dtype, inner: str | None = None) -> None:
    """Refuse a model dtype or device the chosen block kernel cannot run exactly, naming one that can.

    The math kernel runs only when asked for: ``aten`` covers fp16/bf16/fp32 on CUDA (flash, or
    memory-efficient attention for fp32) and every float dtype on CPU; fp64 on CUDA has no fused op.
    """
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"ring attention needs floating-point activations, the model is {dtype}")
    impl = RingImpl(impl)
    if impl in (RingImpl.ATEN, RingImpl.TORCH_NATIVE):
        if device.type == "cuda":
            aten_cuda.refuse_dtype(dtype)
        elif not AtenKernel.available(device):
            raise ValueError(f"ring_impl='aten' runs on cpu and cuda, the model is on {device}; "
                             "use ring_impl='math' there")
    if impl is RingImpl.HF_KERNELS and not hub_dtype_ok(device, dtype, inner):
        raise ValueError(f"ring_impl='hf_kernels' (flash attention) runs fp16/bf16 on GPU, the model is {dtype} on "
                         f"{device}; use ring_impl='aten' (fp32 through memory-efficient attention) or "
                         "ring_impl='math' for fp64")


def get_kernel(impl: RingImpl, inner: str | None = None):
    """The block kernel a runtime binds once at setup (``inner``: the model's attention, which names
    the hub flash kernel for ``hf_kernels``)."""
    impl = RingImpl(impl)
    if impl is RingImpl.MATH:
        return MathKernel()
    if impl in (RingImpl.ATEN, RingImpl.TORCH_NATIVE):
        return AtenKernel()
    if impl is RingImpl.HF_KERNELS:
        return HfKernelsKernel(inner)
    raise ValueError(f"resolve ring_impl={impl!r} first (strategies.ring.resolve_ring_impl)")


def kernel_name(kernel) -> str:
    """The block kernel as a custom op's string argument (:func:`kernel_named` builds it back inside the op):
    its ``RingImpl`` value, with the model's flash attention for a hub kernel (``"hf_kernels|flash_attention_2"``)."""
    name = getattr(kernel, "name", None)
    name = str(getattr(name, "value", name))
    inner = getattr(kernel, "inner", None) if name == RingImpl.HF_KERNELS.value else None
    return f"{name}|{inner}" if inner else name


def kernel_named(name: str):
    """The block kernel :func:`kernel_name` named (a hub kernel's module is loaded once per process:
    ``flash_kernels.load``)."""
    impl, _, inner = name.partition("|")
    return get_kernel(RingImpl(impl), inner or None)
