"""Wiring shared by the Mamba mixers (Mamba1 and Mamba2): a causal conv1d followed by a scan, with
an optional fused conv+scan kernel and cached-decoding kernels. Each kind supplies only its CP scan;
the conv halo, the route around the fused kernel and the decode refusal are the same for both."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .context import LayerContext, call_guard, decode_only_without_cp, drop_local_segments, wired_kernel
from .conv import cp_conv_kernel
from ..intercept import interceptable, rebind_forward, takes_local_segments


def route_around_fused(ctx: LayerContext, namespace: dict, name: str):
    """The fused conv+scan kernel (``mamba_inner_fn`` / ``mamba_split_conv1d_scan_combined``, mamba-ssm only)
    takes no incoming state: under CP, in the wire probe, or for a packed row return None (what the torch
    fallback returns), so the mixer takes its unfused path, which ringmaster intercepts."""
    def call(*args, **kwargs):
        batch = ctx.take_batch(kwargs)
        if ctx.size > 1 or ctx.probe is not None or getattr(batch, "doc_ids", None) is not None:
            return None
        return namespace[name](*args, **kwargs)
    return call


def wire_conv_scan_mixer(module, ctx: LayerContext, names: dict, required: list[str],
                         cp_scan: Callable[..., Any], wired_kwargs: Callable[[Callable], dict] | None = None
                         ) -> Callable[[], None]:
    """Route one mixer instance through exact CP: ``names`` maps the roles ``conv``, ``scan``, ``fused``,
    ``conv_update`` and ``state_update`` to the kernel names its forward calls; ``cp_scan(kernel, ctx,
    *args, **kwargs)`` is the kind's CP scan. Kernels are looked up per call (one swapped in later is
    used). ``wired_kwargs(kernel)``: keywords for ``cp_scan`` decided here, once, from the scan kernel the name
    resolves to now (what the kernel supports), passed only while that kernel is the one called. Returns the undo."""
    forward = interceptable(module, ctx.path, required)   # the class forward, or axolotl's composed one
    namespace = inspect.unwrap(forward).__globals__
    current = wired_kernel(namespace, names["scan"], wired_kwargs or (lambda kernel: {}))

    def scan(*args, **kwargs):
        kernel, facts = current()
        return cp_scan(kernel, ctx, *args, **facts, **kwargs)

    replacements: dict[str, Any] = {
        names["conv"]: cp_conv_kernel(ctx, namespace, names["conv"]),
        names["scan"]: scan,
        names["fused"]: route_around_fused(ctx, namespace, names["fused"]),
        names["conv_update"]: decode_only_without_cp(ctx, namespace, names["conv_update"]),
        names["state_update"]: decode_only_without_cp(ctx, namespace, names["state_update"]),
    }
    guard = call_guard(ctx)
    if takes_local_segments(forward):   # axolotl's default-backend mixer or sample-packing patch: segments
        checks = guard

        def guard(args: tuple, kwargs: dict) -> None:
            checks(args, kwargs)
            drop_local_segments(ctx, kwargs)
    return rebind_forward(module, ctx.path, replacements, required, guard=guard)
