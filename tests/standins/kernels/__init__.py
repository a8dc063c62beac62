"""CPU stand-ins for the optional recurrent-kernel packages ``mamba_ssm`` and ``causal_conv1d``, loaded through
transformers' *own* mechanism, for what has no CPU code of its own: Mamba1's ``selective_scan_fn`` and
``causal_conv1d_fn`` (CUDA C++). flash-linear-attention and mamba-ssm's Triton SSD scan (``mamba_chunk_scan_combined``)
have none: their real kernels run on CPU under Triton's interpreter (tests/realkernels, tests/test_real_kernels.py,
tests/test_real_mamba.py).

transformers 5.x decorates the module-level kernels of its recurrent layers with
``use_kernel_func_from_hub_with_fallback(func_name, package)``: when the modeling module is imported it
runs ``importlib.import_module(package)`` and, if the package has the function (at its root or at the
path in ``_KERNELS_INTERNAL_PATH_MAPPINGS``), calls it instead of the torch fallback, with the keyword
arguments filtered by the package function's signature. The packages under ``site/`` are named exactly
like the real ones and provide only the functions that lookup resolves for the training path:

* ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (Mamba1's selective scan),
* ``causal_conv1d.causal_conv1d_fn``,

with the real packages' signatures, return values and the behaviours a CP wrapper can trip over:
mamba-ssm's ``selective_scan_fn`` drops the gradient of its last state, ``causal_conv1d_fn`` takes widths
2..4 and ``activation`` None/silu/swish only, ``seq_idx`` keeps packed documents apart. The fused and
cached-decoding kernels (``mamba_split_conv1d_scan_combined``, ``mamba_inner_fn``, ``*_update``) are not
stood in: they keep transformers' torch fallbacks (the fused ones return None, so the mixers take
their unfused path, which is the one ringmaster intercepts under CP anyway).

The math (:mod:`.reference`) is written here, token by token in pure torch, in fp32 or fp64 (float64
inputs stay float64): a test double for exactness checks on CPU, not a fast kernel. Every stand-in module
carries ``__ringmaster_standin__ = True`` (for the tests' :func:`is_standin`; ringmaster itself never looks:
to it the stand-in must look like the real package). So each exported kernel is a thin function whose
``__module__`` is the package module it stands in (``mamba_ssm.ops.selective_scan_interface``, ...), as the real one's is,
with the reference's signature (:func:`as_package_function`).

To use them, put :data:`SITE` first on ``sys.path`` *before* transformers imports the modeling module:
in a fresh process only (a separate worker pool, :class:`ringmaster_tools.pool.LocalPool`'s
``sys_path``), never in a process that already imported the model, nor in the default test pool.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

SITE = str(Path(__file__).resolve().parent / "site")
PACKAGES = ("mamba_ssm", "causal_conv1d")


def is_standin(fn) -> bool:
    """Whether ``fn`` (a kernel function) comes from one of these stand-in packages."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return bool(getattr(module, "__ringmaster_standin__", False))


def as_package_function(fn: Callable, module: str) -> Callable:
    """``fn`` (a :mod:`.reference` function) as the package module ``module`` exports it: same signature
    (``__wrapped__``, which ``inspect.signature`` and transformers' keyword filter follow), ``__module__``
    the stand-in package's module. Calls go through ``fn`` itself."""
    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        return fn(*args, **kwargs)

    kernel.__module__ = module
    return kernel
