"""The real optional kernel packages (flash-linear-attention; mamba-ssm's and causal-conv1d's Python and
Triton parts) on CPU, for tests only: never shipped, never imported by ``ringmaster``.

Triton's interpreter (``TRITON_INTERPRET=1``) runs Triton kernels on CPU tensors. Three gaps keep FLA's
kernels and its context parallelism (``fla.ops.cp``) from running there; :func:`bridge` closes them:

1. the autotuner times every config through a GPU driver (``RuntimeError: 0 active drivers``): under the
   interpreter every config scores the same, so the first one runs;
2. a dynamic loop's induction variable (``for i in range(n)`` / ``tl.range``) is a plain Python int under the
   interpreter, and FLA's kernels call ``.to(tl.int64)`` on it: the interpreter's AST rewrite is extended so
   those loops yield interpreter tensors, as compiled Triton does (``tl.static_range`` keeps its ints);
3. FLA's CP refuses any device but CUDA / Ascend (``_check_cp_device``) and allocates its all-gathers as
   ``[world, *shape]``, which gloo rejects (NCCL accepts it): the device check lets CPU through and the
   gather goes into the same memory viewed as the concatenation along dim 0.

A process picks one of two worlds before transformers imports a modeling module (transformers resolves
``fla`` / ``mamba_ssm`` / ``causal_conv1d`` once, at that import): :func:`enable` (the real kernels, under the
interpreter; :func:`enable_in_worker` in a pool) or :func:`hide` (no kernel package importable: transformers' torch fallbacks, what the rest of the
suite measures; FLA installed on a machine without a GPU would otherwise crash every hybrid model at its first
kernel call).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

PACKAGES = ("fla", "mamba_ssm", "causal_conv1d")


HIDDEN = str(Path(__file__).resolve().parent / "hidden")   # shadow packages whose import raises ImportError


def hide() -> None:
    """Make the optional kernel packages unimportable here and in every process started from here: the shadow
    packages of :data:`HIDDEN` go first on ``sys.path`` and on ``PYTHONPATH`` (subprocesses; spawned pool
    workers inherit ``sys.path``). A pool's ``sys_path`` (the stand-ins) still goes before them."""
    for name in PACKAGES:
        module = sys.modules.get(name)
        if module is not None and not (getattr(module, "__file__", "") or "").startswith(HIDDEN):
            raise RuntimeError(f"{name} is already imported in this process: hide() must run before it")
    if HIDDEN not in sys.path:
        sys.path.insert(0, HIDDEN)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != HIDDEN]
    os.environ["PYTHONPATH"] = os.pathsep.join([HIDDEN, *paths])


def unhide() -> None:
    """Undo :func:`hide` in this process (a pool worker that inherited it)."""
    while HIDDEN in sys.path:
        sys.path.remove(HIDDEN)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != HIDDEN]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)


def installed(package: str = "fla") -> bool:
    """Whether ``package`` is installed (looked up past the shadow packages)."""
    from importlib.machinery import PathFinder

    return PathFinder.find_spec(package, [p for p in sys.path if p != HIDDEN]) is not None


def enable_in_worker() -> None:
    """A pool worker's ``init`` (``LocalPool(init=...)``): the real kernels under the interpreter."""
    unhide()
    enable()


_BRIDGED = False


def bridge() -> None:
    """Close the interpreter's three gaps (module docstring). Idempotent."""
    global _BRIDGED
    if _BRIDGED:
        return
    _bridge_autotuner()
    _bridge_loop_variables()
    _bridge_fla_cp()
    _BRIDGED = True


def _bridge_autotuner() -> None:
    from triton.runtime import autotuner

    def do_bench(self):   # every config ties; Autotuner keeps the first of equal timings
        return lambda kernel_call, quantiles: [0.0, 0.0, 0.0]

    autotuner.Autotuner.do_bench = property(do_bench)


def _bridge_loop_variables() -> None:
    from triton.runtime import interpreter

    def loop(iterable):
        for i in iterable:
            yield interpreter.interpreter_semantic.to_tensor(i, False)

    def is_dynamic_range(call) -> bool:
        if not isinstance(call, ast.Call):
            return False
        f = call.func
        return (isinstance(f, ast.Name) and f.id == "range") or (isinstance(f, ast.Attribute) and f.attr == "range")

    class Transformer(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            if is_dynamic_range(node.iter):
                node.iter = ast.copy_location(
                    ast.Call(func=ast.Name(id="_ringmaster_loop", ctx=ast.Load()), args=[node.iter], keywords=[]),
                    node.iter)
            return node

    interpreter._ringmaster_loop = loop   # the rewriter copies the interpreter's globals into the kernel's
    interpreter.FunctionRewriter.ast_transformer = Transformer()


def _bridge_fla_cp() -> None:
    try:
        comm = importlib.import_module("fla.ops.cp.comm")
    except ImportError:
        return
    import torch
    import torch.distributed as dist

    def all_gather_into_tensor(inp, out=None, group=None, async_op=False):
        world = dist.get_world_size(group=group)
        if out is None:
            out = torch.empty(world, *inp.shape, device=inp.device, dtype=inp.dtype)
        flat = out.view(world * inp.shape[0], *inp.shape[1:]) if inp.dim() else out.view(world)
        handle = dist.all_gather_into_tensor(flat, inp.contiguous(), group=group, async_op=async_op)
        return out, handle

    def check_cp_device(device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"fla.ops.cp on {device.type}: the CPU bridge runs CPU tensors only")

    for name in ("comm", "chunk_delta_h", "chunk_merge", "chunk_bwd", "chunk_fwd", "context"):
        module = importlib.import_module(f"fla.ops.cp.{name}")
        if hasattr(module, "all_gather_into_tensor"):
            module.all_gather_into_tensor = all_gather_into_tensor
        if hasattr(module, "_check_cp_device"):
            module._check_cp_device = check_cp_device
    sys.modules["fla.ops.cp"].all_gather_into_tensor = all_gather_into_tensor
