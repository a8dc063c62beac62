"""``recurrent="fla_cp"``: hand gated DeltaNet / KDA state passing to flash-linear-attention's own
context parallelism instead of ringmaster's ``scan`` / ``sequential`` (opt-in).

FLA ships a context-parallel entry point for its delta-rule chunk kernels (``fla.ops.cp``; read at 0.6.0):
``build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None, layout=)`` describes how
a varlen token stream of batch 1, split over the ranks of ``group``, maps onto this rank, and
``chunk_gated_delta_rule(..., cp_context=)`` / ``chunk_kda(..., cp_context=)`` exchange the states themselves
(no ``initial_state`` / ``output_final_state`` in that mode). FLA's two layouts are ringmaster's two static
ones: ``"contiguous"`` (one part per rank) and ``"zigzag"`` (rank r holds parts r and 2P-1-r, stored
[front; back]: ringmaster's ``head_tail``). ringmaster uses it per batch row: the row's global document starts
(the batch's host runs; one document for a dense row) become the context's ``cu_seqlens`` and
``cu_seqlens_cpu`` (so FLA reads no boundary back from the device), and the layer's own kernel (transformers'
wrapper around FLA's function) is called with ``cp_context``. The short convolution keeps ringmaster's halo
exchange (no ``conv1d_kernel_size``).

Requirements, each refused at ``wire`` with the reason: the layer's kernel must be FLA's (transformers
resolved ``fla``, and the function takes ``cp_context``: through the torch fallback it would be filtered
out and the rows silently computed without the other ranks' state), and ``fla.ops.cp.build_cp_context`` must
take ``layout`` (flash-linear-attention >= 0.6.0). Checked on CPU against the real FLA 0.6.0 (its Triton
kernels and its CP under Triton's interpreter, tests/test_real_kernels.py), both layouts; not yet run on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from ..sharding.documents import row_cu_seqlens

STRATEGY = "fla_cp"
FLA_LAYOUTS = {"contiguous": "contiguous", "head_tail": "zigzag"}   # ringmaster's static layout -> FLA's


def kernel_implementation(fn: Callable):
    """The function transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper calls (the package's,
    or the torch fallback): its closure's ``implementation``; ``fn`` itself when it is not such a wrapper."""
    code = getattr(fn, "__code__", None)
    if code is not None and "implementation" in code.co_freevars and fn.__closure__:
        return fn.__closure__[code.co_freevars.index("implementation")].cell_contents
    return fn


def _params(fn) -> dict:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def kernel_takes(kernel: Callable, package: str, params) -> bool:
    """The function behind ``kernel`` (:func:`kernel_implementation`) is ``package``'s and takes every one of
    ``params``: where a package-specific keyword may go. transformers' torch fallbacks swallow unknown keywords, so
    one passed to them would be silently ignored."""
    impl = kernel_implementation(kernel)
    module = getattr(impl, "__module__", "") or ""
    return (module == package or module.startswith(package + ".")) and set(params) <= set(_params(impl))


def takes_varlen(kernel: Callable) -> bool:
    """The layer's kernel is flash-linear-attention's and takes its varlen boundaries on the host too
    (``cu_seqlens`` and ``cu_seqlens_cpu``: no device read of them); never transformers' torch fallback."""
    return kernel_takes(kernel, "fla", ("cu_seqlens", "cu_seqlens_cpu"))


def unavailable_reason(kernel: Callable) -> str | None:
    """Why ``recurrent="fla_cp"`` cannot run with this layer kernel (None: it can)."""
    impl = kernel_implementation(kernel)
    module = getattr(impl, "__module__", "") or ""
    name = f"{module}.{getattr(impl, '__name__', impl)}"
    if not (module == "fla" or module.startswith("fla.")):
        return (f"the layer's kernel is {name}, not flash-linear-attention's "
                "(install flash-linear-attention before transformers imports the model)")
    if "cp_context" not in _params(impl):
        return f"{name} takes no cp_context (flash-linear-attention >= 0.6.0 does)"
    try:
        build = importlib.import_module("fla.ops.cp").build_cp_context
    except (ImportError, AttributeError) as exc:
        return f"fla.ops.cp.build_cp_context is unavailable ({exc}); flash-linear-attention >= 0.6.0 ships it"
    if not {"layout", "cu_seqlens_cpu"} <= set(_params(build)):
        return ("fla.ops.cp.build_cp_context takes no layout / cu_seqlens_cpu (flash-linear-attention >= 0.6.0 "
                "does)")
    return None


def fla_layout(path: str, layout: str) -> str:
    """FLA's name for ringmaster's static ``layout``; raises naming the fix for any other."""
    if layout not in FLA_LAYOUTS:
        raise NotImplementedError(f"{path}: recurrent='fla_cp' runs on the contiguous or head_tail layout "
                                  f"(FLA's 'contiguous' / 'zigzag' parts), got {layout!r}; use recurrent='scan'")
    return FLA_LAYOUTS[layout]


def fla_cp_rule(kernel: Callable, path: str, group, layout: str, runs, query, key, value, g, beta, kwargs: dict):
    """The layer's chunk kernel under FLA's own CP, one batch row at a time; returns the outputs ``[b, l, hv, dv]``."""
    fla = fla_layout(path, layout)
    build_cp_context = importlib.import_module("fla.ops.cp").build_cp_context
    b, l = query.shape[:2]
    seq_len = l * torch.distributed.get_world_size(group)
    outs = []
    for r in range(b):
        host = row_cu_seqlens(runs, r, seq_len)
        cp_context = build_cp_context(host.to(query.device, non_blocking=True), group=group, cu_seqlens_cpu=host,
                                      layout=fla)
        o, _ = kernel(query[r:r + 1], key[r:r + 1], value[r:r + 1], g=g[r:r + 1], beta=beta[r:r + 1],
                      cp_context=cp_context, **kwargs)
        outs.append(o)
    return outs[0] if b == 1 else torch.cat(outs, dim=0)
