"""Mamba / Mamba2 mixers that axolotl 0.21 runs through flash-linear-attention (``mamba_backend: fla``), exact under CP.

What axolotl installs (``axolotl.model_support.mamba``), and what ringmaster identifies them by: the
transformers mixer keeps its parameters; a *view* of FLA's layer hangs on it as ``mixer.fla_mixer`` (an
instance of a subclass of ``fla.layers.mamba.Mamba`` / ``fla.layers.mamba2.Mamba2`` whose ``_owner``
is the mixer); the mixer's forward calls the view, whose instance ``forward`` (axolotl's packed-row
splitter) calls ``_forward``, which runs FLA's ``cuda_kernels_forward`` on CUDA tensors and the
pure-torch ``slow_forward`` / ``torch_forward`` otherwise. On a CUDA machine axolotl re-binds, per view,
a clone of ``cuda_kernels_forward`` (``view._axolotl_cuda_forward``) whose globals are the hub kernels
(``kernels-community/mamba-ssm``: ``selective_scan_fn``, ``mamba_inner_fn``, ``mamba_chunk_scan_combined``,
``mamba_split_conv1d_scan_combined``, ``selective_state_update``), sets the conv kernels
(``kernels-community/causal-conv1d``) as the view's instance attributes, and wraps the clone in an
adapter guard (``view.cuda_kernels_forward``: a LoRA'd ``out_proj`` avoids the fused kernel).

:func:`wire_fla_mixer` composes with that, on this view instance only (nothing shared is patched):

* the kernel path: a copy of axolotl's clone (or, where axolotl bound nothing, of FLA's class
  ``cuda_kernels_forward``) in which the scan resolves to ringmaster's CP scan around the bound kernel
  (:func:`ringmaster.recurrent.mamba1.cp_selective_scan`, :func:`ringmaster.recurrent.mamba2.cp_mamba2_chunk_scan`),
  and the fused block (which takes no incoming state) to the same block built from the CP conv, the
  CP scan and the view's own ``x_proj`` / ``norm`` / ``out_proj`` modules (adapters on them stay
  live: PEFT LoRA on in_proj / out_proj, the targets axolotl allows, and on Mamba1's x_proj, which
  axolotl's target check refuses and FLA's fused kernel outside CP would drop); a cache-less call
  returns no final state (``None``) under CP;
* ``view.causal_conv1d_fn``: the conv with the previous shard's halo (:func:`ringmaster.recurrent.conv.cp_conv_kernel`)
  around the bound kernel; the decode kernels refuse under CP;
* ``view.slow_forward`` / ``view.torch_forward``: the same kernel path (their token loops cannot take
  an incoming state), so CPU tensors run exactly what CUDA tensors run;
* ``view.forward``: axolotl's splitter, called after the per-call checks; under a ``ringmaster_batch``
  its per-shard document split is dropped (the CP kernels reset at the *global* document starts).

Where axolotl bound no hub kernels (no CUDA) the kernels are transformers' torch fallbacks. Refused,
naming the layer: a view that is not axolotl's layout, a kernel path that no longer calls those names,
an unbound view on a CUDA machine (axolotl would bind at its first CUDA forward, over ringmaster's),
FLA's triton conv backend, a Mamba2 activation that bypasses the conv kernel, and an adapter on a
module whose weight FLA's kernel path reads directly (``conv1d``, Mamba1's ``dt_proj``, Mamba2's ``norm``).
Verified on CPU with stand-ins of fla and the hub kernels (tests/standins/fla_mamba); not
yet run on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import math
import types
from typing import Any, Callable

import torch

from ..errors import UnsupportedLayerError
from .context import LayerContext, call_guard, decode_only_without_cp, drop_local_segments
from .conv import cp_conv_kernel
from ..intercept import compose_attributes, rebind_function
from .mamba1 import cp_selective_scan
from .mamba2 import cp_mamba2_chunk_scan

# recurrent kind -> (module, class) of the flash-linear-attention layer axolotl's view subclasses
FLA_LAYERS = {"mamba1": ("fla.layers.mamba", "Mamba"), "mamba2": ("fla.layers.mamba2", "Mamba2")}
# recurrent kind -> role -> the module-global name FLA's cuda_kernels_forward calls
FLA_KERNELS = {
    "mamba1": {"scan": "selective_scan_fn", "fused": "mamba_inner_fn", "state_update": "selective_state_update"},
    "mamba2": {"scan": "mamba_chunk_scan_combined", "fused": "mamba_split_conv1d_scan_combined",
               "state_update": "selective_state_update"},
}
CONV, CONV_UPDATE = "causal_conv1d_fn", "causal_conv1d_update"   # instance attributes of the view
# the view's method for non-CUDA tensors: a token loop with no kernel to intercept
TORCH_PATH = {"mamba1": "slow_forward", "mamba2": "torch_forward"}
# submodules whose weight FLA's kernel path reads directly: an adapter on them would be dropped
RAW_WEIGHTS = {"mamba1": ("conv1d", "dt_proj"), "mamba2": ("conv1d", "norm")}
# transformers' torch kernels with the same interfaces, for names FLA holds as None (no mamba-ssm)
_TORCH_FALLBACKS = {
    "mamba1": ("transformers.models.mamba.modeling_mamba",
               {"selective_scan_fn": "mamba_selective_scan", CONV: "causal_conv1d_fn"}),
    "mamba2": ("transformers.models.mamba2.modeling_mamba2",
               {"mamba_chunk_scan_combined": "mamba2_chunk_scan", CONV: "causal_conv1d_fn"}),
}


def fla_view(module):
    """The FLA view axolotl hung on ``module`` (its ``fla_mixer`` child, owned by ``module``), or None."""
    children = module.__dict__.get("_modules") or {}
    view = children.get("fla_mixer")
    if view is None or view.__dict__.get("_owner") is not module:
        return None
    return view


def fla_layer_kind(view) -> str | None:
    """``"mamba1"`` / ``"mamba2"``: which flash-linear-attention layer the view's class derives from."""
    for cls in type(view).__mro__:
        for kind, (mod, name) in FLA_LAYERS.items():
            if cls.__module__ == mod and cls.__name__ == name:
                return kind
    return None


def fla_mixers(model) -> list[tuple[str, Any, str | None]]:
    """``(path, mixer, kind)`` of every mixer of ``model`` that axolotl backs with FLA (kind None: the view
    derives from no FLA layer ringmaster knows)."""
    return [(path, m, fla_layer_kind(fla_view(m))) for path, m in model.named_modules() if fla_view(m) is not None]


def _kernel_path(view) -> tuple[Callable, bool]:
    """FLA's kernel path for this view (axolotl's per-view clone with the hub kernels, else the class
    function) and whether axolotl bound it."""
    bound = view.__dict__.get("_axolotl_cuda_forward")
    if bound is not None:
        return getattr(bound, "__func__", bound), True
    return type(view).cuda_kernels_forward, False


def check_fla_mixer(module, path: str, kind: str | None = None) -> str:
    """Raise, naming the layer and the fix, for anything of this FLA-backed mixer ringmaster cannot make
    exact under CP; return its kind. Changes nothing."""
    view = fla_view(module)
    where = f"layer {path!r} ({type(module).__name__}, axolotl mamba_backend: fla)"
    if view is None:
        raise UnsupportedLayerError(f"{where}: no FLA view (fla_mixer) owned by the mixer")
    found = fla_layer_kind(view)
    if found is None or (kind is not None and found != kind):
        raise UnsupportedLayerError(
            f"{where}: its FLA view {type(view).__name__} derives from {[c.__qualname__ for c in type(view).__mro__]}, "
            f"not the flash-linear-attention layer of recurrent kind {kind!r} ({FLA_LAYERS.get(kind)}); ringmaster "
            "passes state for fla.layers.mamba.Mamba and fla.layers.mamba2.Mamba2 views only. Use "
            "mamba_backend: transformers, or leave CP off")
    if "forward" not in view.__dict__ or "_axolotl_fla_forward" not in view.__dict__:
        raise UnsupportedLayerError(
            f"{where}: the FLA view has no instance forward / _axolotl_fla_forward (not axolotl 0.21's view); "
            "ringmaster cannot place its per-call checks. Use the axolotl release ringmaster supports, or "
            "mamba_backend: transformers")
    fn, bound = _kernel_path(view)
    names = set(inspect.unwrap(fn).__code__.co_names)
    need = [FLA_KERNELS[found]["scan"], FLA_KERNELS[found]["fused"], CONV]
    missing = [n for n in need if n not in names]
    if missing:
        raise UnsupportedLayerError(
            f"{where}: FLA's kernel path {fn.__qualname__} does not call {missing} (another flash-linear-attention "
            "release?); ringmaster cannot route its sequence kernels through the state passing, so CP would be "
            "silently wrong. Use mamba_backend: transformers, or leave CP off")
    if not bound and torch.cuda.is_available():
        raise UnsupportedLayerError(
            f"{where}: axolotl has not bound the hub kernels to this FLA view, and would bind them at its first "
            "CUDA forward, over ringmaster's state passing. Build the model with CUDA visible (axolotl binds at "
            "construction), then wire")
    if bound and "cuda_kernels_forward" not in view.__dict__:
        raise UnsupportedLayerError(f"{where}: axolotl bound _axolotl_cuda_forward but no cuda_kernels_forward "
                                    "wrapper (not axolotl 0.21's view)")
    if getattr(view, "backend", "cuda") != "cuda":
        raise UnsupportedLayerError(
            f"{where}: FLA conv backend {view.backend!r}; ringmaster wires the causal-conv1d (cuda) backend only. "
            "Set FLA_CONV_BACKEND=cuda (axolotl requires it too)")
    if found == "mamba2" and getattr(view, "activation", None) not in ("silu", "swish"):
        raise UnsupportedLayerError(
            f"{where}: activation {view.activation!r} makes FLA's Mamba2 run nn.Conv1d itself, past the conv "
            "kernel ringmaster gives the previous shard's halo; use hidden_act silu, or leave CP off")
    _check_raw_weights(view, where, found)
    return found


def _check_raw_weights(view, where: str, kind: str) -> None:
    """No adapter (PEFT's layers hold the wrapped one as ``base_layer``) on a module whose weight FLA's
    kernel path reads directly: it would be dropped, silently, on the path ringmaster runs."""
    for name in RAW_WEIGHTS[kind]:
        if getattr(getattr(view, name, None), "base_layer", None) is not None:
            raise UnsupportedLayerError(
                f"{where}: an adapter wraps {name}, whose weight FLA's kernel path reads directly "
                f"({name}.weight), so the adapter would be dropped on the GPU path ringmaster runs; target "
                "in_proj / out_proj" + (" / x_proj" if kind == "mamba1" else "") + " instead")


def _torch_fallback(kind: str, name: str):
    module, names = _TORCH_FALLBACKS[kind]
    return getattr(importlib.import_module(module), names[name])


def _cp_call(ctx: LayerContext) -> bool:
    """Whether this call needs ringmaster's path: under CP, in wire's probe, or a packed/padded row."""
    return ctx.probe is not None or ctx.size > 1 or getattr(ctx.carrier.current, "doc_ids", None) is not None


def _same(path: str, what: str, given, own) -> None:
    if given is not None and (given.data_ptr() != own.data_ptr() or given.numel() != own.numel()):
        raise NotImplementedError(f"{path}: the fused kernel got a {what} that is not the layer's own; ringmaster "
                                  "rebuilds the block from the layer's modules and cannot honour it")


def _mamba1_scan(ctx: LayerContext, kernel: Callable[[], Callable]):
    def scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
             **kwargs):
        if not _cp_call(ctx):
            return kernel()(u, delta, A, B, C, D, z, delta_bias, delta_softplus=delta_softplus,
                            return_last_state=return_last_state, **kwargs)
        y = cp_selective_scan(kernel(), ctx, u, delta, A, B, C, D, z, delta_bias, delta_softplus, False, **kwargs)
        return (y, None) if return_last_state else y   # no final state under CP: a cache is refused there
    return scan


def _mamba2_scan(ctx: LayerContext, kernel: Callable[[], Callable]):
    def scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
             dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, **kwargs):
        if not _cp_call(ctx):
            return kernel()(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                            seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        if z is not None:
            raise NotImplementedError(f"{ctx.path}: a gated (z) chunk scan; ringmaster's Mamba2 state passing runs "
                                      "the scan ungated (FLA's Mamba2 gates in its norm)")
        y = cp_mamba2_chunk_scan(kernel(), ctx, x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                 initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                 return_final_states=False, seq_idx=seq_idx, **kwargs)
        return (y, None) if return_final_states else y
    return scan


def _mamba1_fused(ctx: LayerContext, view, conv: Callable, scan: Callable, original: Callable[[], Callable]):
    """``mamba_inner_fn`` (conv, x_proj, dt_proj, scan, gate, out_proj in one kernel, no incoming state):
    the real kernel outside CP; under CP the same block from the CP conv and scan, ``x_proj`` and
    ``out_proj`` called as the view's modules (an adapter on them stays live)."""
    def fused(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A,
              B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None, delta_softplus=True,
              **extra):
        kernel = original()
        if kernel is not None and not _cp_call(ctx):
            return kernel(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                          out_proj_bias, A, B, C, D, delta_bias=delta_bias, B_proj_bias=B_proj_bias,
                          C_proj_bias=C_proj_bias, delta_softplus=delta_softplus, **extra)
        given = {k: v for k, v in dict(B=B, C=C, B_proj_bias=B_proj_bias, C_proj_bias=C_proj_bias,
                                      **{k: v for k, v in extra.items() if k.endswith("_weight")}).items()
                 if v is not None}
        if given:
            raise NotImplementedError(f"{ctx.path}: mamba_inner_fn with {sorted(given)}; ringmaster rebuilds the "
                                      "block for input-dependent B/C from x_proj only")
        for what, t, own in (("conv1d weight", conv1d_weight, view.conv1d.weight),
                             ("x_proj weight", x_proj_weight, view.x_proj.weight),
                             ("dt_proj weight", delta_proj_weight, view.dt_proj.weight),
                             ("out_proj weight", out_proj_weight, view.out_proj.weight)):
            _same(ctx.path, what, t, own)
        x, z = xz.chunk(2, dim=1)
        x = conv(x, conv1d_weight.reshape(conv1d_weight.shape[0], -1), conv1d_bias, activation="silu")
        rank, n = delta_proj_weight.shape[1], A.shape[-1]
        time_step, B_, C_ = torch.split(view.x_proj(x.transpose(1, 2)), [rank, n, n], dim=-1)
        delta = delta_proj_weight @ time_step.transpose(1, 2)
        y = scan(x, delta, A, B_.transpose(1, 2), C_.transpose(1, 2), D, z, delta_bias, delta_softplus=delta_softplus)
        return view.out_proj(y.transpose(1, 2))
    return fused


def _mamba2_fused(ctx: LayerContext, view, conv: Callable, scan: Callable, original: Callable[[], Callable]):
    """``mamba_split_conv1d_scan_combined`` (conv, SSD scan, gated RMSNorm, out_proj, no incoming state):
    the real kernel outside CP; under CP the block FLA's unfused path computes, from the CP conv and
    scan and the view's ``norm`` / ``out_proj`` modules."""
    def fused(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
              dt_limit=(0.0, math.inf), return_final_states=False, activation="silu", rmsnorm_weight=None,
              rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
              norm_before_gate=True, **extra):
        kernel = original()
        if kernel is not None and not _cp_call(ctx):
            return kernel(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                          initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
                          return_final_states=return_final_states, activation=activation,
                          rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                          outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                          norm_before_gate=norm_before_gate, **extra)
        bad = sorted(k for k, v in dict(initial_states=initial_states, seq_idx=seq_idx, **extra).items()
                     if v is not None) + (["return_final_states"] if return_final_states else []) \
            + (["norm_before_gate"] if norm_before_gate else []) + (["no rmsnorm"] if rmsnorm_weight is None else [])
        if bad:
            raise NotImplementedError(f"{ctx.path}: mamba_split_conv1d_scan_combined with {bad}; ringmaster rebuilds "
                                      "the block FLA's Mamba2 calls (gated norm after the gate, no cache)")
        for what, t, own in (("conv1d weight", conv1d_weight, view.conv1d.weight),
                             ("norm weight", rmsnorm_weight, view.norm.weight),
                             ("out_proj weight", outproj_weight, view.out_proj.weight)):
            _same(ctx.path, what, t, own)
        h = A.shape[0]
        p = headdim if headdim is not None else view.head_dim
        d, g, n = h * p, ngroups, view.ssm_state_size
        if zxbcdt.shape[-1] != 2 * d + 2 * g * n + h:
            raise NotImplementedError(f"{ctx.path}: an in_proj of width {zxbcdt.shape[-1]} (an MLP branch beside "
                                      "the SSM?); ringmaster rebuilds z | xBC | dt only")
        z, xbc, dt = torch.split(zxbcdt, [d, d + 2 * g * n, h], dim=-1)
        xbc = conv(xbc.transpose(1, 2).contiguous(), conv1d_weight, conv1d_bias, activation=activation).transpose(1, 2)
        x, B, C = torch.split(xbc, [d, g * n, g * n], dim=-1)
        b, l = x.shape[:2]
        y = scan(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, g, n), C.reshape(b, l, g, n), chunk_size, D=D,
                 dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
        return view.out_proj(view.norm(y.reshape(b, l, d), z))
    return fused


def wire_fla_mixer(module, ctx: LayerContext, names: dict | None = None) -> Callable[[], None]:
    """Route one axolotl FLA-backed Mamba/Mamba2 mixer through exact CP (see the module docstring);
    returns the undo. ``names`` is unused (FLA's kernel names are fixed: :data:`FLA_KERNELS`)."""
    kind = check_fla_mixer(module, ctx.path)
    view = fla_view(module)
    if "_ringmaster_recurrent" in vars(module):
        raise UnsupportedLayerError(f"layer {ctx.path!r} ({type(module).__name__}) is already wired for CP "
                                    f"(as {module._ringmaster_recurrent!r}); unwire it first")
    roles = FLA_KERNELS[kind]
    fn, bound = _kernel_path(view)
    namespace = inspect.unwrap(fn).__globals__      # FLA's module globals, with axolotl's hub kernels when bound

    def kernel(name: str) -> Callable[[], Callable]:
        def look_up():
            value = namespace.get(name)
            return value if value is not None else _torch_fallback(kind, name)
        return look_up

    conv_kernel = view.__dict__.get(CONV) or _torch_fallback(kind, CONV)
    conv = cp_conv_kernel(ctx, {CONV: conv_kernel}, CONV)
    scan = (_mamba1_scan if kind == "mamba1" else _mamba2_scan)(ctx, kernel(roles["scan"]))
    fused = (_mamba1_fused if kind == "mamba1" else _mamba2_fused)(ctx, view, conv, scan,
                                                                   lambda: namespace.get(roles["fused"]))
    replacements = {roles["scan"]: scan, roles["fused"]: fused,
                    roles["state_update"]: decode_only_without_cp(ctx, namespace, roles["state_update"])}
    path_fn = types.MethodType(rebind_function(fn, replacements), view)
    attrs: dict[str, Any] = {
        CONV: conv,
        CONV_UPDATE: decode_only_without_cp(ctx, {CONV_UPDATE: view.__dict__.get(CONV_UPDATE)}, CONV_UPDATE),
    }
    if bound:   # axolotl's adapter guard (view.cuda_kernels_forward) calls self._axolotl_cuda_forward
        attrs["_axolotl_cuda_forward"] = path_fn
        kernels_forward = view.__dict__["cuda_kernels_forward"]
    else:
        attrs["cuda_kernels_forward"] = kernels_forward = path_fn
    attrs[TORCH_PATH[kind]] = kernels_forward
    installed = dict(attrs)
    previous_forward = view.__dict__["forward"]
    guard = call_guard(ctx)

    def forward(hidden_states, *args, **kwargs):
        replaced = sorted(k for k, v in installed.items() if view.__dict__.get(k) is not v)
        if replaced:
            raise RuntimeError(f"{ctx.path}: {replaced} of its FLA view were replaced after ringmaster wired it "
                               "(axolotl binding its hub kernels late?); the state passing would be bypassed. "
                               "Unwire, rebuild or re-bind, then wire again")
        _check_raw_weights(view, f"layer {ctx.path!r}", kind)   # an adapter added after wiring
        guard((hidden_states, *args), kwargs)
        if ctx.carrier.current is not None:   # axolotl's per-shard split: the CP kernels use the global documents
            drop_local_segments(ctx, kwargs, "_axolotl_segments")
        return previous_forward(hidden_states, *args, **kwargs)

    attrs["forward"] = forward
    undo = compose_attributes(view, ctx.path, attrs)
    module._ringmaster_recurrent = ctx.path

    def restore() -> None:
        undo()
        module.__dict__.pop("_ringmaster_recurrent", None)

    return restore
