"""Resolve a flash-attention name to the kernel module itself, and call its varlen entry point.

Why: transformers picks the flash library from ``module.config._attn_implementation``, which
``wire`` has renamed to ringmaster's registered name, so under CP transformers' own flash path
cannot find the kernel any more. ringmaster resolves the model's original name here, once per
runtime, and calls the kernel directly:

- ``flash_attention_2`` -> the ``flash_attn`` package (``flash_attn.flash_attn_interface``) if
  importable, else the hub kernel ``kernels-community/flash-attn2``;
- ``flash_attention_3`` -> ``flash_attn_interface`` if importable, else
  ``kernels-community/vllm-flash-attn3`` (transformers' own fallback for that name);
- ``flash_attention_4`` -> ``flash_attn.cute`` (``.interface``) if importable, else
  ``kernels-community/flash-attn4``;
- a hub name ``org/repo`` (or ``org/repo@revision``) -> ``kernels.get_kernel``.

Hub kernels load through the ``kernels`` package directly (never transformers' hub-kernel gate,
which wants ``kernels>=0.18.2``), so ``LOCAL_KERNELS="org/repo=/path"`` maps a repo id to a local
repository: that is how CI runs these paths with ringmaster's CPU stand-in
(``standins.flash_repos``). The real kernels run on CUDA only; this module has run
on CPU with the stand-in, **not yet on a GPU**.

What each kernel supports is read from its varlen function's signature (``window_size``,
``softcap``, ``dropout_p``, ``s_aux`` / ``learnable_sink``), as transformers does, so a missing
feature is refused by name before any collective.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
from dataclasses import dataclass, field
from types import ModuleType

import torch

# the interface modules of the packages transformers imports for each name (they hold the varlen function
# transformers calls and the low-level forward/backward a ring block kernel needs), and its hub fallbacks
PACKAGES = {
    "flash_attention_2": "flash_attn.flash_attn_interface",
    "flash_attention_3": "flash_attn_interface",
    "flash_attention_4": "flash_attn.cute.interface",
}
HUB_FALLBACK = {
    "flash_attention_2": "kernels-community/flash-attn2",
    "flash_attention_3": "kernels-community/vllm-flash-attn3",
    "flash_attention_4": "kernels-community/flash-attn4",
}
# major versions transformers 5.24 loads (FLASH_ATTN_KERNEL_VERSIONS); 1 for any other repo
HUB_VERSIONS = {
    "kernels-community/flash-attn2": 4,
    "kernels-community/flash-attn3": 1,
    "kernels-community/vllm-flash-attn3": 1,
    "kernels-community/flash-attn4": 0,
}
_HUB = re.compile(r"^[^/:@|\s]+/[^/:@|\s]+(?:@[^/:@|\s]+)?$")


def is_hub(name: str | None) -> bool:
    """``org/repo`` or ``org/repo@revision``: a kernel on the Hugging Face hub."""
    return isinstance(name, str) and _HUB.match(name) is not None


def is_flash(name: str | None) -> bool:
    """Whether ``name`` is a flash kernel ringmaster resolves itself (package or hub)."""
    return name in PACKAGES or is_hub(name)


@dataclass(frozen=True)
class FlashKernel:
    """One resolved flash kernel: where it came from and what its varlen function accepts."""

    name: str                      # the model's attn_implementation
    source: str                    # the package or hub repo the module came from
    module: ModuleType = field(repr=False)
    params: frozenset = field(default_factory=frozenset)
    # what other code derives from this module once per loaded kernel (the ring's low-level interface, read from
    # its functions' signatures: ring/hub.hub_ops), kept as long as the kernel is
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def sink_kwarg(self) -> str | None:
        """The kernel's name for per-head sink logits (vllm FA3: ``s_aux``; FA4: ``learnable_sink``)."""
        return next((p for p in ("s_aux", "learnable_sink") if p in self.params), None)

    def check(self, *, sinks: bool, dropout: float, softcap: float | None, window: bool) -> None:
        """Refuse, naming the feature and the fix, what this kernel cannot compute."""
        where = f"attn_implementation={self.name!r} ({self.source})"
        if sinks and self.sink_kwarg is None:
            raise NotImplementedError(
                f"{where} has no attention-sink argument (s_aux / learnable_sink) and this model uses sinks; "
                "use kernels-community/vllm-flash-attn3 (FA3 with sinks) or flash_attention_4, or eager/flex_attention"
            )
        if dropout and "dropout_p" not in self.params:
            raise NotImplementedError(
                f"{where} has no dropout and attention dropout is {dropout}; set attention_dropout=0 "
                "or call model.eval()"
            )
        if softcap and "softcap" not in self.params:
            raise NotImplementedError(f"{where} has no softcap (the model caps logits at {softcap}); use eager")
        if window and "window_size" not in self.params:
            raise NotImplementedError(f"{where} has no window_size and the model has sliding-window layers; "
                                      "use flash_attention_2 or a hub flash kernel with windows")

    def varlen(self, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, *, scale: float, causal: bool,
               window: tuple[int, int] | None, softcap: float | None, dropout: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` packed by ``cu_seqlens`` -> out ``[T, Hq, D]``.

        ``window``: flash's inclusive (left, right) or None. ``sinks`` ``[Hq]``: passed detached; their
        gradient comes from :class:`SinkGrad` (vllm's FA3 backward returns none for them)."""
        kw = {"softmax_scale": scale, "causal": causal}
        for name, value in (("cu_seqlens_q", cu_seqlens), ("cu_seqlens_k", cu_seqlens),
                            ("max_seqlen_q", max_seqlen), ("max_seqlen_k", max_seqlen)):
            if name in self.params:
                kw[name] = value
        if window is not None:
            kw["window_size"] = window
        if softcap:
            kw["softcap"] = softcap
        if dropout:
            kw["dropout_p"] = dropout
        if "deterministic" in self.params:  # transformers' switch for the deterministic backward
            kw["deterministic"] = os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
        if sinks is not None:  # half precision in, as transformers passes them
            kw[self.sink_kwarg] = sinks.detach().to(q.dtype)
            for flag in ("return_attn_probs", "return_lse"):  # FA3 / FA4 return the LSE only when asked
                if flag in self.params:
                    kw[flag] = True
        res = self.module.flash_attn_varlen_func(q, k, v, **kw)
        out = res[0] if isinstance(res, (tuple, list)) else res
        if sinks is None or not sinks.requires_grad:
            return out
        if not isinstance(res, (tuple, list)) or len(res) < 2:
            raise NotImplementedError(f"{self.name!r} ({self.source}) returns no LSE, so the sink gradient cannot "
                                      "be formed; freeze the sinks or use a kernel that returns (out, lse)")
        return SinkGrad.apply(out, res[1], sinks)


class SinkGrad(torch.autograd.Function):
    """Identity on ``out``; gives the sink logits their gradient from the kernel's ``(out, lse)``.

    With ``p_sink = exp(s_aux - lse)`` (the LSE includes the sink), ``d out_i / d s_aux = -p_sink_i
    out_i``, so ``dL/ds_aux[h] = -sum_i p_sink[h, i] * (dout_i . out_i)[h]``. Exact for any kernel
    that normalises by the sink; the sinks go to the kernel detached, so nothing is counted twice."""

    @staticmethod
    def forward(ctx, out, lse, sinks):
        ctx.save_for_backward(out, lse, sinks)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        out, lse, sinks = ctx.saved_tensors
        wide = torch.float64 if out.dtype == torch.float64 else torch.float32
        delta = (dout.to(wide) * out.to(wide)).sum(-1).transpose(0, 1)          # [H, T]
        p_sink = torch.exp(sinks.to(wide)[:, None] - lse.to(wide))              # [H, T]
        return dout, None, (-(p_sink * delta).sum(-1)).to(sinks.dtype)


def _import(package: str) -> ModuleType | None:
    try:
        return importlib.import_module(package)
    except ImportError:
        return None


def _hub(repo: str) -> ModuleType:
    kernels = _import("kernels")
    if kernels is None:
        raise ImportError(
            f"the flash kernel {repo!r} loads through the `kernels` package: `pip install kernels` "
            f"(or map it to a local repository with LOCAL_KERNELS=\"{repo}=/path\")"
        )
    repo_id, _, revision = repo.partition("@")
    try:
        if revision:
            return kernels.get_kernel(repo_id, revision=revision)
        return kernels.get_kernel(repo_id, version=HUB_VERSIONS.get(repo_id, 1))
    except Exception as e:  # network, missing build variant, untrusted org: say which and how to fix
        raise ImportError(
            f"could not load the flash kernel {repo!r} with kernels.get_kernel: {e}. On a machine without the "
            f"hub, point LOCAL_KERNELS=\"{repo_id}=/path/to/local/repo\" at a local kernel repository"
        ) from e


_LOADED: dict[str, FlashKernel] = {}  # name -> kernel: a cache of loaded modules, never per-batch state


def load(name: str) -> FlashKernel:
    """The kernel for attn_implementation ``name`` (cached per name)."""
    if name in _LOADED:
        return _LOADED[name]
    if not is_flash(name):
        raise ValueError(f"{name!r} is not a flash kernel name: use one of {sorted(PACKAGES)} or a hub repo 'org/repo'")
    module, source = None, None
    if name in PACKAGES:
        module = _import(PACKAGES[name])
        source = PACKAGES[name]
    if module is None:
        source = HUB_FALLBACK.get(name, name)
        module = _hub(source)
    fn = getattr(module, "flash_attn_varlen_func", None)
    if fn is None:
        raise ValueError(f"the flash kernel {source!r} (for {name!r}) has no flash_attn_varlen_func, which "
                         "ringmaster's Ulysses calls for packed rows")
    kernel = FlashKernel(name, source, module, frozenset(inspect.signature(fn).parameters))
    _LOADED[name] = kernel
    return kernel


def window_size(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    """HF's window (key visible iff ``0 <= q - k < w``, or ``|q - k| < w`` without causal) in flash's
    inclusive (left, right) form."""
    if sliding_window is None or sliding_window <= 0 or math.isinf(sliding_window):
        return None
    w = int(sliding_window) - 1
    return (w, 0) if causal else (w, w)


def target_dtype(query: torch.Tensor, module) -> torch.dtype | None:
    """transformers' rule for fp32 activations reaching a flash kernel (e.g. PEFT's fp32 norms):
    the autocast dtype, else the quantized model's dtype, else the module's Linear weight dtype."""
    if query.dtype != torch.float32:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):
        return config.dtype
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return None if linear is None else linear.weight.dtype
