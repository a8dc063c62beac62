"""``ring_impl='hf_kernels'``: the Hugging Face hub flash kernels' low-level functions as a ring
block kernel.

Each hub flash kernel exposes a forward that returns the LSE and a backward that takes the output
and LSE (the merged ones, here), in flash's layout ``[B, S, H, D]`` / varlen ``[T, H, D]``:

* FA2 (``kernels-community/flash-attn2``): ``_flash_attn_forward`` / ``_flash_attn_backward`` and
  ``_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward`` for document blocks;
* FA3 (``kernels-community/flash-attn3``, ``vllm-flash-attn3``): ``_flash_attn_forward`` /
  ``_flash_attn_backward``, varlen through ``cu_seqlens_q/k`` on the same functions;
* FA4: ``_flash_attn_fwd`` / ``_flash_attn_bwd`` (its LSE output is not differentiable; the ring
  never differentiates it: backward takes the merged LSE).

The interface is read from the functions' signatures once, when the runtime binds the kernel
(argument names differ between versions: ``causal``/``is_causal``, ``window_size_left/right`` or
a ``window_size`` tuple). Blocks map to calls as in :mod:`.flash_blocks`: causal and window
aligned bottom-right, documents through ``cu_seqlens``.

Logit soft-capping goes to the kernel's own ``softcap`` argument, forward and backward (refused before
any collective when its functions have none); MLA's narrower value heads are zero-padded to the
query/key head dim and the results sliced (:class:`.common.EqualHeadDims`, as transformers' flash
path pads them).

The real kernels are GPU-only and **not yet run on a GPU** here; CI runs this provider against
ringmaster's CPU stand-in (``standins.flash_repos``) loaded through ``LOCAL_KERNELS``.
"""

from __future__ import annotations

import copy
import inspect

import torch

from ...config import RingImpl
from .. import flash_kernels
from . import flash_blocks
from .common import EqualHeadDims
from .masks import as_block_mask

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def load_flash_kernel(inner: str) -> flash_kernels.FlashKernel:
    """The loaded kernel (its module: ``.module``) for the model's flash attention ``inner`` (``flash_attention_2/3/4``
    or a hub repo id), through the resolver Ulysses uses (:func:`ringmaster.attention.flash_kernels.load`: the installed
    package's interface module, else ``kernels.get_kernel`` with ``LOCAL_KERNELS`` honoured), so both
    backends run the same kernel for the same model."""
    if not flash_kernels.is_flash(inner):
        raise ValueError(f"ring_impl='hf_kernels' needs a flash model (flash_attention_2/3/4 or a hub kernel repo), "
                         f"the model uses {inner!r}; use ring_impl='aten'")
    return flash_kernels.load(inner)


_ALIASES = {"causal": ("causal", "is_causal"), "softmax_lse": ("softmax_lse", "lse")}
# passed only where the function has no default for them (defaults differ: FA4's softcap is None)
_ONLY_IF_REQUIRED = {"dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False,
                     "deterministic": False, "rng_state": None, "cu_seqlens_q": None, "cu_seqlens_k": None,
                     "max_seqlen_q": None, "max_seqlen_k": None, "seqused_q": None, "seqused_k": None,
                     "sequed_q": None, "sequed_k": None}


def hub_dtype_ok(device, dtype, inner: str | None = None) -> bool:
    """Flash kernels run fp16/bf16 on GPU; on CPU the provider runs the stand-in, in any float dtype."""
    return dtype in FLASH_DTYPES or torch.device(device).type == "cpu"


def flash_flags(left, right):
    """``(causal, (left, right))`` for a flash call: a band open to the left and closed at the diagonal
    is the kernel's own causal mode; anything else goes as a window."""
    causal = left is None and right == 0
    return causal, ((None, 0) if causal else (left, right))


class _Fn:
    """One hub function and how to call it with ringmaster's canonical argument names."""

    def __init__(self, module, name: str, none_window: bool):
        self.name = name
        self.fn = getattr(module, name)
        self.params = inspect.signature(self.fn).parameters
        self.none_window = none_window  # FA4 spells "unbounded" None, FA2/FA3 spell it -1

    def has(self, name: str) -> bool:
        return name in self.params

    def __call__(self, window, **kw):
        args = {}
        for key, value in kw.items():
            for alias in _ALIASES.get(key, (key,)):
                if alias in self.params:
                    args[alias] = value
                    break
        for key, value in _ONLY_IF_REQUIRED.items():
            p = self.params.get(key)
            if key not in args and p is not None and p.default is inspect.Parameter.empty:
                args[key] = value
        args.update(self._window(*window))
        return self.fn(**args)

    def _window(self, left, right):
        unbounded = None if self.none_window else -1
        left = unbounded if left is None else left
        right = unbounded if right is None else right
        if "window_size_left" in self.params:
            return {"window_size_left": left, "window_size_right": right}
        if "window_size" in self.params:
            return {"window_size": (left, right)}
        if (left, right) != (unbounded, unbounded):
            raise NotImplementedError(
                f"the hub flash kernel's {self.name} takes no window_size, and this ring block needs the window "
                f"({left}, {right}); use ring_impl='aten'")
        return {}


class _HubOps:
    """A loaded hub flash module in :class:`.flash_blocks.FlashOps` form."""

    def __init__(self, module, label: str):
        self.label = label
        self.softcap = None  # the model's logit cap on a per-call copy (:meth:`capped`), else None
        if hasattr(module, "_flash_attn_fwd"):                      # FA4
            fwd = _Fn(module, "_flash_attn_fwd", none_window=True)
            bwd = _Fn(module, "_flash_attn_bwd", none_window=True)
            self._fwd, self._bwd, self._vfwd, self._vbwd, self.flavor = fwd, bwd, fwd, bwd, "fa4"
        elif hasattr(module, "_flash_attn_forward"):
            self._fwd = _Fn(module, "_flash_attn_forward", none_window=False)
            self._bwd = _Fn(module, "_flash_attn_backward", none_window=False)
            if self._fwd.has("cu_seqlens_q"):                        # FA3: varlen on the same functions
                self._vfwd, self._vbwd, self.flavor = self._fwd, self._bwd, "fa3"
            else:                                                     # FA2
                self._vfwd = _Fn(module, "_flash_attn_varlen_forward", none_window=False) \
                    if hasattr(module, "_flash_attn_varlen_forward") else None
                self._vbwd = _Fn(module, "_flash_attn_varlen_backward", none_window=False) \
                    if hasattr(module, "_flash_attn_varlen_backward") else None
                self.flavor = "fa2"
        else:
            raise ValueError(
                f"ring_impl='hf_kernels': the kernel {label!r} has neither _flash_attn_forward (FA2/FA3) nor "
                "_flash_attn_fwd (FA4); use ring_impl='aten'")

    def takes_softcap(self) -> bool:
        fns = [self._fwd, self._bwd] + ([self._vfwd, self._vbwd] if self._vfwd is not None else [])
        return all(fn.has("softcap") for fn in fns if fn is not None)

    def capped(self, softcap):
        """These ops calling the kernel with ``softcap`` (a shallow copy: the bound instance never changes)."""
        if not softcap:
            return self
        ops = copy.copy(self)
        ops.softcap = softcap
        return ops

    def _cap(self) -> dict:
        return {"softcap": float(self.softcap)} if self.softcap else {}

    def dense_fwd(self, q, k, v, scale, left, right):
        causal, window = flash_flags(left, right)
        res = self._fwd(window, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), softmax_scale=scale,
                        causal=causal, return_lse=True, **self._cap())
        return res[0], res[1]

    def varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):
        if self._vfwd is None:
            raise NotImplementedError(f"the hub flash kernel {self.label!r} has no varlen forward for packed documents; "
                                      "use ring_impl='aten'")
        causal, window = flash_flags(left, right)
        res = self._vfwd(window, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                         max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_lse=True, **self._cap())
        return res[0], res[1]

    def _backward(self, fn, dout, q, k, v, out, lse, scale, left, right, **varlen):
        causal, window = flash_flags(left, right)
        q, k, v, dout, out = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), out.contiguous()
        grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
        res = fn(window, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(), softmax_scale=scale,
                 causal=causal, **varlen, **self._cap(), **{n: g for n, g in grads.items() if fn.has(n)})
        if all(fn.has(n) for n in grads) and self.flavor != "fa4":
            return grads["dq"], grads["dk"], grads["dv"]   # FA2/FA3 write the gradients in place
        return res[0], res[1], res[2]

    def dense_bwd(self, dout, q, k, v, out, lse, scale, left, right):
        return self._backward(self._bwd, dout, q, k, v, out, lse, scale, left, right)

    def varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right):
        if self._vbwd is None:
            raise NotImplementedError(f"the hub flash kernel {self.label!r} has no varlen backward; use ring_impl='aten'")
        return self._backward(self._vbwd, dout, q, k, v, out, lse, scale, left, right, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def hub_ops(inner: str, softcap=None) -> _HubOps:
    """The low-level forward/backward functions (dense and varlen) of the flash kernel the model's attention ``inner``
    names, calling it with ``softcap``: read from their signatures once per loaded kernel (the ops of a compiled
    block ask for them on every call: the ring's blocks, Ulysses' varlen call in :mod:`ringmaster.attention.flash_op`)."""
    kernel = load_flash_kernel(inner)
    ops = kernel.memo.get("hub_ops")
    if ops is None:
        ops = kernel.memo["hub_ops"] = _HubOps(kernel.module, inner)
    return ops.capped(softcap)


class HfKernelsKernel:
    """The block-kernel interface over a hub flash kernel, resolved from the model's attention
    (``flash_attention_2/3`` or a hub repo id) once, when the runtime binds it."""

    name = RingImpl.HF_KERNELS

    def __init__(self, inner: str | None = None, module=None):
        inner = inner or "flash_attention_2"
        self.inner = inner
        self.ops = _HubOps(module, inner) if module is not None else hub_ops(inner)

    def check(self, q, v, softcap=None) -> None:
        """Refuse, before any collective, a softcap this kernel's functions cannot take."""
        if softcap and not self.ops.takes_softcap():
            raise NotImplementedError(
                f"ring_impl='hf_kernels': the flash kernel {self.inner!r} takes no softcap (the model caps logits at "
                f"{softcap}); use ring_impl='math' or a kernel with softcap (flash-attn2/3)")

    def forward(self, q, k, v, scale, mask, softcap=None):
        self.check(q, v, softcap)
        if not hub_dtype_ok(q.device, q.dtype):  # rm.setup callers (axolotl) skip wire's check_dtype
            raise ValueError(f"ring_impl='hf_kernels' (flash attention) runs fp16/bf16 on GPU, the activations are "
                             f"{q.dtype} on {q.device}; use ring_impl='aten' (fp32 through memory-efficient "
                             "attention) or ring_impl='math' for fp64")
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if m.dense is not None:
            raise NotImplementedError("ring_impl='hf_kernels' runs band and document blocks (what the ring plans); "
                                      "an arbitrary dense mask needs ring_impl='aten'")
        dims = EqualHeadDims(q, v)
        out, lse = flash_blocks.forward(self.ops.capped(softcap), *dims.inputs(q, k, v), scale, m)
        return dims.outputs(out), lse

    def backward(self, dout, q, k, v, out, lse, scale, mask, softcap=None):
        m = as_block_mask(mask, q.shape[-2], k.shape[-2])
        if m.dense is not None:
            raise NotImplementedError("ring_impl='hf_kernels' runs band and document blocks; use ring_impl='aten'")
        dims = EqualHeadDims(q, v)
        grads = flash_blocks.backward(self.ops.capped(softcap), dims.pad(dout), *dims.inputs(q, k, v), dims.pad(out), lse, scale, m)
        return dims.grads(*grads)
