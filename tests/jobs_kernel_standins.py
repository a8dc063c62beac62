"""Jobs for tests/test_kernel_standins.py. They run only in the stand-in pool: a separate LocalPool whose
workers put ``standins.kernels.SITE`` first on ``sys.path`` before anything imports
transformers, so its ``use_kernel_func_from_hub_with_fallback`` resolves ``mamba_ssm`` and ``causal_conv1d`` to
the CPU stand-ins, exactly as it resolves the real packages on a GPU machine."""

from __future__ import annotations

import importlib
from typing import Callable

import jobs_mamba1 as jm1

from ringmaster.recurrent.fla_cp import kernel_implementation   # what transformers' kernel wrapper calls

# model_type -> (modeling module, {module-level kernel name: (package, function it must resolve to)})
RESOLVED = {
    "mamba": ("transformers.models.mamba.modeling_mamba", {
        "mamba_selective_scan": ("mamba_ssm", "selective_scan_fn"),
        "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn")}),
}


def resolution(ctx) -> dict:
    """For every kernel name of :data:`RESOLVED`: the module of the function transformers resolved, whether
    it is a stand-in, and whether it is the very object the stand-in package exports."""
    from standins.kernels import is_standin

    out = {}
    for model_type, (module_name, names) in RESOLVED.items():
        module = importlib.import_module(module_name)
        for name, (package, func) in names.items():
            impl = kernel_implementation(getattr(module, name))
            pkg = importlib.import_module(package)
            sub = {"selective_scan_fn": "mamba_ssm.ops.selective_scan_interface"}.get(func, package)
            exported = getattr(importlib.import_module(sub), func)
            out[f"{model_type}.{name}"] = {"module": impl.__module__, "standin": is_standin(impl),
                                           "exported": impl is exported,
                                           "package_file": getattr(pkg, "__file__", "")}
    return out


def parity(ctx, model_type, strategy="scan", packed=False, mutation=None):
    """fp64 parity of ``model_type`` at P=2 with the stand-in kernels (dense, or a packed row vs every
    document alone); ``mutation``: one of :data:`MUTATIONS` applied for the run (undone after)."""
    _require_standins(model_type)
    undo = MUTATIONS[mutation]() if mutation else (lambda: None)
    try:
        if packed:
            return jm1.packed_parity(ctx, model_type, 2, strategy, fp64=True)
        return jm1.family_parity(ctx, model_type, 2, strategy, fp64=True)
    except Exception as exc:  # noqa: BLE001 - a mutation refused before any CP step is detected too
        if mutation is None:
            raise
        return {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        undo()


def _require_standins(model_type) -> None:
    from standins.kernels import is_standin

    module_name, names = RESOLVED[model_type]
    module = importlib.import_module(module_name)
    scan_name = [n for n in names if n != "causal_conv1d_fn"][0]
    if not (is_standin(kernel_implementation(getattr(module, scan_name))) and
            is_standin(kernel_implementation(getattr(module, "causal_conv1d_fn")))):
        raise RuntimeError(f"{model_type}: the kernels did not resolve to the stand-ins; not the stand-in pool?")


# --------------------------------------------------------------------------- mutations


def mamba1_map_from_last_state() -> Callable[[], None]:
    """ringmaster's Mamba1 map built from the kernel's ``return_last_state`` again (what it did before it
    computed the end state itself): mamba-ssm (and the stand-in) drop that output's gradient."""
    import torch

    from ringmaster.recurrent import mamba1
    from ringmaster.recurrent.scan import hi

    cls = mamba1.Mamba1Segment
    local_map = cls.local_map

    def mutated(self):
        packed, aux = local_map(self)
        _, final = self.kernel(self.u, self.delta, self.A, self.B, self.C, D=self.D, z=None,
                               delta_bias=self.delta_bias, delta_softplus=self.delta_softplus,
                               return_last_state=True, **self.kwargs)
        n = self.A.shape[-1]
        return torch.cat([hi(final).to(packed.dtype), packed[..., n:]], dim=-1), aux

    cls.local_map = mutated
    return lambda: setattr(cls, "local_map", local_map)


MUTATIONS = {"mamba1_map_from_last_state": mamba1_map_from_last_state}
