"""The real optional kernel packages (flash-linear-attention; mamba-ssm's and causal-conv1d's Python and
Triton parts) on CPU, for tests only: never shipped, never imported by ``ringmaster``.

Triton's interpreter (``TRITON_INTERPRET=1``) runs Triton kernels on CPU tensors. Three gaps keep FLA's
kernels and its context parallelism (``fla.ops.cp``) from running there, and two more Liger-Kernel's;
:func:`bridge` closes them:

1. the autotuner times every config through a GPU driver (``RuntimeError: 0 active drivers``): under the
   interpreter no config is timed, the one with the largest blocks runs (the fewest program instances);
2. a dynamic loop's induction variable (``for i in range(n)`` / ``tl.range``) is a plain Python int under the
   interpreter, and FLA's kernels call ``.to(tl.int64)`` on it: the interpreter's AST rewrite is extended so
   those loops yield interpreter tensors, as compiled Triton does (``tl.static_range`` keeps its ints);
3. FLA's CP refuses any device but CUDA / Ascend (``_check_cp_device``) and allocates its all-gathers as
   ``[world, *shape]``, which gloo rejects (NCCL accepts it): the device check lets CPU through and the
   gather goes into the same memory viewed as the concatenation along dim 0;
4. a Python float kernel argument reaches the kernel as a Python float, where compiled Triton passes an fp32
   scalar (Liger's ``eps.to(tl.float32)``: ``'float' object has no attribute 'to'``): it arrives as the
   interpreter's fp32 scalar tensor, the type Triton's own specialisation gives it;
5. a libdevice function imported by its bare name (Liger's ``from triton.language.extra.libdevice import
   rsqrt``, ``tanh``) is an empty stub the compiler resolves and the interpreter never patches (it returns
   None): such a name in a kernel's module resolves at call time to ``triton.language.math``'s function as the
   interpreter patched it (``tanh``, which ``tl.math`` lacks, to numpy's).

A further change is for speed only: the interpreter's re-patching of ``triton.language`` at every helper call
is skipped where the launch already patched it (a third of its time on FLA's kernels).

A process picks one of two worlds before transformers imports a modeling module (transformers resolves
``fla`` / ``mamba_ssm`` / ``causal_conv1d`` once, at that import): :func:`enable` (the real kernels, under the
interpreter; :func:`enable_in_worker` in a pool) or :func:`hide` (no kernel package importable: transformers' torch fallbacks, what the rest of the
suite measures; FLA installed on a machine without a GPU would otherwise crash every hybrid model at its first
kernel call).

mamba-ssm's Triton SSD scan runs here too, from its sdist: :mod:`realkernels.mamba` (what of mamba-ssm and
causal-conv1d cannot run, and why, is listed there). No Triton flash attention from PyPI does (checked with
Triton 3.9): flash-attn's Triton backend ships only in the flash-attn sdist, whose build compiles CUDA;
``flash-attn-triton`` 0.1.1 (a ``flash_attn`` look-alike) fails at import (``triton.tools.experimental_descriptor``
is gone) and its ``flash_attn_varlen_func`` raises NotImplementedError; ``flash-attention-triton`` 0.1.1 asserts
CUDA tensors and has no varlen / LSE API; ``jvp-flash-attention`` 0.14.0 fails inside the interpreter
(``AssertionError`` in a kernel) and has no varlen / LSE API either. ringmaster's flash paths call
``flash_attn_varlen_func`` with the LSE (and ``_flash_attn_forward`` / ``_backward`` for Ring): the CPU flash
stand-in (tests/standins/flash_repos) stays what they run on here.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

from ringmaster_tools.pool import GPU_KERNEL_PACKAGES as PACKAGES   # the packages hidden here


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


def enable() -> None:
    """Run the real kernel packages under Triton's interpreter in this process: sets ``TRITON_INTERPRET=1``
    (before triton is imported) and applies :func:`bridge`."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; enable() must run first")
    os.environ["TRITON_INTERPRET"] = "1"
    bridge()


def enable_all_in_worker() -> None:
    """A pool worker's ``init`` for every real kernel at once: FLA (:func:`enable_in_worker`) and mamba-ssm's Triton
    kernels from its sdist where the cache holds it (:func:`realkernels.mamba.load_mamba_ssm`)."""
    enable_in_worker()
    from . import mamba

    try:
        mamba.load_mamba_ssm()
    except mamba.Unavailable:   # the session fixture says so (real_pool.mamba_unavailable)
        pass


def enable_in_worker() -> None:
    """A pool worker's ``init`` (``LocalPool(init=...)``): the real kernels under the interpreter."""
    unhide()
    enable()


_BRIDGED = False


def bridge() -> None:
    """Close the interpreter's gaps (module docstring). Idempotent."""
    global _BRIDGED
    if _BRIDGED:
        return
    _bridge_autotuner()
    _bridge_loop_variables()
    _bridge_fla_cp()
    _bridge_float_arguments()
    _bridge_libdevice()
    _bridge_repatching()
    _BRIDGED = True


def _bridge_autotuner() -> None:
    """No config is timed: the one with the largest blocks wins (its product of integer meta-parameters; ties
    keep the first). Every config computes the same thing; under the interpreter the largest blocks mean the
    fewest program instances, each a Python loop."""
    import math

    from triton.runtime import autotuner

    def _bench(self, *args, config, **meta):
        size = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0)
        return [1.0 / size] * 3

    autotuner.Autotuner._bench = _bench


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


def _bridge_float_arguments() -> None:
    import numpy as np
    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    original = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            ty = interpreter.tl.str_to_ty(mangle_type(arg), None)   # fp32, as compiled Triton specialises it
            return interpreter.tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), ty), ty)
        return original(arg)

    interpreter._implicit_cvt = implicit_cvt   # GridExecutor looks it up in the module at every launch


def _bridge_libdevice() -> None:
    """A kernel module's global that is a ``triton.language.extra`` libdevice stub becomes a forwarder to
    ``triton.language.math``'s function of that name, looked up at call time (inside a launch, where the
    interpreter has patched it). Applied to each kernel's module on its first launch."""
    from triton.runtime import interpreter

    tl = interpreter.tl

    def tanh(x):
        import numpy   # imported here: closed over from the bridge, numpy raised NameError inside a launch

        handle = interpreter.TensorHandle(numpy.tanh(x.handle.data), x.handle.dtype.scalar)
        return tl.core.tensor(handle, x.type)

    def forwarder(name):
        def call(*args, **kwargs):
            return getattr(tl.math, name)(*args, **kwargs)
        call.__name__ = name
        return call

    done: set[int] = set()
    original = interpreter._patch_lang

    def patch_lang(fn):
        scope = fn.__globals__
        if id(scope) not in done:
            done.add(id(scope))
            for key, value in list(scope.items()):
                if (callable(value) and (getattr(value, "__module__", "") or "").startswith("triton.language.extra")
                        and getattr(value, "__name__", None) == key):
                    if key == "tanh":
                        scope[key] = tanh
                    elif hasattr(tl.math, key):
                        scope[key] = forwarder(key)
        return original(fn)

    interpreter._patch_lang = patch_lang


def _bridge_repatching() -> None:
    """Speed only: the interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` walk of it) at every
    call of a ``@triton.jit`` helper, once per program instance, though the launch around it already patched the
    same modules: a third of the interpreter's time on FLA's kernels. A helper whose language modules are all
    patched already skips it."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    lang_modules = (interpreter.tl, interpreter.tl.core)
    patched: set[int] = set()
    langs: dict[int, frozenset] = {}

    def langs_of(fn) -> frozenset:
        if id(fn) not in langs:
            langs[id(fn)] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in lang_modules))
        return langs[id(fn)]

    def patch_lang(fn):
        mine = langs_of(fn)
        if mine and mine <= patched:
            return interpreter._LangPatchScope()   # nothing to patch, nothing to restore
        scope = original(fn)
        added = mine - patched
        patched.update(added)
        restore = scope.restore

        def restore_and_forget():
            restore()
            patched.difference_update(added)

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang


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
