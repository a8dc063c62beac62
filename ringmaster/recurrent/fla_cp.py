"""``recurrent="fla_cp"``: hand gated DeltaNet / KDA state passing to flash-linear-attention's own
context parallelism instead of ringmaster's ``scan`` / ``sequential`` (opt-in, GPU-only).

FLA ships a context-parallel entry point for its delta-rule chunk kernels (``fla.ops.cp``, since FLA
0.4.2; read at 0.5.2): ``build_cp_context(cu_seqlens, group)`` describes how a varlen token stream of
batch 1, split into equal *contiguous* parts over the ranks of ``group``, maps onto this rank, and
``chunk_gated_delta_rule(..., cp_context=)`` / ``chunk_kda(..., cp_context=)`` exchange the states
themselves (no ``initial_state`` / ``output_final_state`` in that mode). ringmaster uses it per batch row:
the row's global document starts (from the ``ringmaster_batch``; one document for a dense row) become
the context's ``cu_seqlens``, and the layer's own kernel (transformers' wrapper around FLA's function) is
called with ``cp_context``. The short convolution keeps ringmaster's halo exchange.

Requirements, each refused at ``wire`` with the reason: the layer's kernel must be FLA's (transformers
resolved ``fla``, and the function takes ``cp_context``: through the torch fallback it would be filtered
out and the rows silently computed without the other ranks' state), ``fla.ops.cp`` must import, and the
layout must be ``contiguous`` (FLA's parts are contiguous; ``head_tail`` is not). The parity of this path
against ringmaster's ``scan`` is a GPU check (benchmarks/gpu_check.py): on CPU it runs only against the
stand-in ``fla`` (``tests/standins/kernels``, whose ``cp_context`` gathers the stream; it looks like the real
package to this module), not yet against the real FLA on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

STRATEGY = "fla_cp"


def kernel_implementation(fn: Callable):
    """The function transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper calls (the package's,
    or the torch fallback): its closure's ``implementation``; ``fn`` itself when it is not such a wrapper."""
    code = getattr(fn, "__code__", None)
    if code is not None and "implementation" in code.co_freevars and fn.__closure__:
        return fn.__closure__[code.co_freevars.index("implementation")].cell_contents
    return fn


def unavailable_reason(kernel: Callable) -> str | None:
    """Why ``recurrent="fla_cp"`` cannot run with this layer kernel (None: it can)."""
    impl = kernel_implementation(kernel)
    module = getattr(impl, "__module__", "") or ""
    if not (module == "fla" or module.startswith("fla.")):
        return (f"the layer's kernel is {module}.{getattr(impl, '__name__', impl)}, not flash-linear-attention's "
                "(install flash-linear-attention before transformers imports the model)")
    try:
        params = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        params = {}
    if "cp_context" not in params:
        return f"{module}.{getattr(impl, '__name__', impl)} takes no cp_context (flash-linear-attention >= 0.4.2 does)"
    try:
        importlib.import_module("fla.ops.cp")
    except ImportError as exc:
        return f"fla.ops.cp does not import ({exc}); flash-linear-attention >= 0.4.2 ships it"
    return None


def cu_seqlens_of_row(runs, row: int, seq_len: int, device) -> torch.Tensor:
    """The global ``cu_seqlens`` of one batch row: its document starts (``runs``: the batch's host copy of its
    documents, ``sharding.documents.Runs``), or one document spanning the row."""
    starts = [0] if runs is None else list(runs.row(row))
    return torch.tensor([*starts, seq_len], dtype=torch.long).to(device, non_blocking=True)


def fla_cp_rule(kernel: Callable, path: str, group, layout: str, runs, query, key, value, g, beta, kwargs: dict):
    """The layer's chunk kernel under FLA's own CP, one batch row at a time; returns the outputs ``[b, l, hv, dv]``."""
    if layout != "contiguous":
        raise NotImplementedError(f"{path}: recurrent='fla_cp' needs the contiguous layout (FLA's context "
                                  f"parallelism splits the stream into contiguous parts), got {layout!r}; set "
                                  "load_balance='contiguous' or use recurrent='scan'")
    build_cp_context = importlib.import_module("fla.ops.cp").build_cp_context
    b, l = query.shape[:2]
    seq_len = l * torch.distributed.get_world_size(group)
    outs = []
    for r in range(b):
        cp_context = build_cp_context(cu_seqlens_of_row(runs, r, seq_len, query.device), group=group)
        o, _ = kernel(query[r:r + 1], key[r:r + 1], value[r:r + 1], g=g[r:r + 1], beta=beta[r:r + 1],
                      cp_context=cp_context, **kwargs)
        outs.append(o)
    return outs[0] if b == 1 else torch.cat(outs, dim=0)
