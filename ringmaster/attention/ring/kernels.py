"""Block kernels: attention of a query block against one K/V block, returning ``(out, lse)``.

Every provider has the same interface, forward and backward:

    forward(q, k, v, scale, mask)                       -> out [B,H,Sq,D], lse [B,H,Sq] (fp32)
    backward(dout, q, k, v, out, lse, scale, mask)      -> dq, dk, dv

``mask`` is ``None`` (every key visible), ``"causal"`` (a diagonal block: Sq == Sk, top-left
aligned) or a bool ``[Sq, Sk]`` tensor (True = attend). q is ``[B, Hq, Sq, D]``, k/v
``[B, Hkv, Sk, D]``: GQA is expanded inside the kernel, never on the wire.

The backward receives the *merged* output and LSE of the whole ring, not the block's own:
``P = exp(S - lse_merged)`` is then exactly this block's share of the global softmax, so
the per-block gradients add up to the exact gradient for every provider (flash kernels'
backward ignores the LSE gradient, so merging through autograd would be wrong).
"""

from __future__ import annotations

import torch

from ...compat import has_module
from ...config import RingImpl
from .merge import acc_dtype

NEG_INF = float("-inf")


def _bool_mask(mask, sq: int, sk: int, device) -> torch.Tensor | None:
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown block mask {mask!r}")
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return mask


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    B, H, S, D = dx.shape
    return dx.view(B, H // groups, groups, S, D).sum(dim=2)


class MathKernel:
    """Pure torch, any device and dtype; computes in fp32 (fp64 for fp64). The reference provider."""

    name = RingImpl.MATH

    def _probs(self, q, k, scale, mask, lse=None):
        dt = acc_dtype(q)
        s = torch.matmul(q.to(dt), k.to(dt).transpose(-1, -2)) * scale
        m = _bool_mask(mask, q.shape[-2], k.shape[-2], q.device)
        if m is not None:
            s = s.masked_fill(~m, NEG_INF)
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(p), p)
        return p, lse

    def forward(self, q, k, v, scale, mask):
        g = q.shape[1] // k.shape[1]
        p, lse = self._probs(q, _expand(k, g), scale, mask)
        return torch.matmul(p, _expand(v, g).to(p.dtype)), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        g = q.shape[1] // k.shape[1]
        dt = acc_dtype(q)
        kx, vx = _expand(k, g).to(dt), _expand(v, g).to(dt)
        p, _ = self._probs(q, kx, scale, mask, lse=lse.to(dt))
        dout = dout.to(dt)
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, vx.transpose(-1, -2))
        delta = (dout * out.to(dt)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kx) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(dt)) * scale
        return dq.to(q.dtype), _reduce_groups(dk, g).to(k.dtype), _reduce_groups(dv, g).to(v.dtype)


class TorchNativeKernel:
    """aten's flash-attention ops, which return the LSE and take it back in backward
    (``_scaled_dot_product_flash_attention_for_cpu`` on CPU, ``_scaled_dot_product_flash_attention``
    on CUDA)."""

    name = RingImpl.TORCH_NATIVE

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _args(self, q, k, v, mask):
        g = q.shape[1] // k.shape[1]
        kx, vx = _expand(k, g).contiguous(), _expand(v, g).contiguous()
        causal = isinstance(mask, str)
        additive = None
        if isinstance(mask, torch.Tensor):
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, NEG_INF)
        return g, kx, vx, causal, additive

    def forward(self, q, k, v, scale, mask):
        g, kx, vx, causal, additive = self._args(q, k, v, mask)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.contiguous(), kx, vx, 0.0, causal, attn_mask=additive, scale=scale)
        else:
            if additive is not None:  # the CUDA flash op takes no mask: fall back for partial blocks
                return MathKernel().forward(q, k, v, scale, mask)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q.contiguous(), kx, vx, 0.0, causal, False, scale=scale)[:2]
        lse = lse.to(acc_dtype(q))
        if additive is not None:  # aten reports lse=0 for a row with no visible key: make it -inf
            lse = lse.masked_fill(~mask.any(-1), NEG_INF)
        return out.to(acc_dtype(q)), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        g, kx, vx, causal, additive = self._args(q, k, v, mask)
        if q.device.type != "cpu":
            return MathKernel().backward(dout, q, k, v, out, lse, scale, mask)
        # a row no key can see anywhere has lse=-inf; any finite value gives it P=0 through the mask
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(acc_dtype(q)).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), kx, vx, out.to(q.dtype).contiguous(),
            lse, 0.0, causal, attn_mask=additive, scale=scale)
        return dq, _reduce_groups(dk, g), _reduce_groups(dv, g)


class HfKernelsKernel:
    """flash-attention from the Hugging Face ``kernels`` hub (GPU only, import-guarded)."""

    name = RingImpl.HF_KERNELS

    def __init__(self):
        if not has_module("kernels") or not torch.cuda.is_available():
            raise RuntimeError(
                "ring_impl='hf_kernels' needs a CUDA GPU and `pip install 'kernels>=0.18.2'`; "
                "use ring_impl='torch_native' or 'math' on this machine"
            )
        raise NotImplementedError(
            "ring_impl='hf_kernels' is not wired in this ringmaster build; use 'torch_native' (aten flash) instead"
        )


def check_dtype(impl: RingImpl, device, dtype: torch.dtype) -> None:
    """Refuse a model dtype the chosen block kernel cannot run exactly, naming a provider that can."""
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ValueError(f"ring attention needs floating-point activations, the model is {dtype}")
    if impl is RingImpl.HF_KERNELS and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"ring_impl='hf_kernels' (flash attention) runs fp16/bf16 only, the model is {dtype}; "
                         "use ring_impl='math' for fp32/fp64 training")
    if impl is RingImpl.TORCH_NATIVE and device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"ring_impl='torch_native' on CUDA uses the flash kernel, which runs fp16/bf16 only, the "
                         f"model is {dtype}; use ring_impl='math' for {dtype} on GPU")


def get_kernel(impl: RingImpl):
    if impl is RingImpl.MATH:
        return MathKernel()
    if impl is RingImpl.TORCH_NATIVE:
        return TorchNativeKernel()
    if impl is RingImpl.HF_KERNELS:
        return HfKernelsKernel()
    raise ValueError(f"resolve ring_impl={impl!r} first (strategies.ring.resolve_ring_impl)")
