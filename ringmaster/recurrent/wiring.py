"""Wire a model's recurrent layers: validate every one (kind known, kernels interceptable), then
route each instance through exact cross-rank state passing, and prove it with a probe forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import compat
from ..architectures import classify_layers, get_architecture, text_config
from ..errors import UnsupportedLayerError
from ..runtime import active
from ..sharding.carrier import attach
from ..sharding.documents import PIECE_GROUPS
from .context import LayerContext, Probe
from .cost import CostRecorded, LayerCost
from .fla_mamba import check_fla_mixer, fla_view, wire_fla_mixer
from ..intercept import interceptable
from .registry import get_kind, known_kinds
from .heads import STRATEGY as HEADS
from .scan import KERNEL_STRATEGIES


def _spec_of(model):
    try:
        return get_architecture(model)
    except (ValueError, UnsupportedLayerError):
        return None


def kernel_names(spec, kind: str) -> dict:
    """Role -> kernel name for the layers of ``kind`` in this family: the kind's defaults, renamed
    where the spec declares (``ArchitectureSpec.recurrent_kernels[kind]``)."""
    k = get_kind(kind)
    names = {**k.kernels, **k.optional}
    declared = dict(spec.recurrent_kernels.get(kind, {})) if spec is not None else {}
    unknown = sorted(set(declared) - set(names))
    if unknown:
        raise ValueError(f"family {spec.name!r} renames kernel roles {unknown} of kind {kind!r}, which has roles "
                         f"{sorted(names)}")
    return {**names, **declared}


def _required(spec, kind: str) -> dict:
    names = kernel_names(spec, kind)
    return {role: names[role] for role in get_kind(kind).kernels}


def check_recurrent_layers(model, layers: Sequence[tuple[str, Any, str]] | None = None, spec=None) -> list:
    """Validate without changing anything: every stateful layer is declared, of a known kind, and
    calls the kernels its kind intercepts. Returns ``[(path, module, kind)]``."""
    if spec is None:
        spec = _spec_of(model)
    if layers is None:
        layers = classify_layers(model, spec).recurrent
    for path, module, kind in layers:
        if fla_view(module) is not None:   # axolotl's mamba_backend: fla (recurrent/fla_mamba.py)
            check_fla_mixer(module, path, kind)
        else:
            interceptable(module, path, list(_required(spec, kind).values()))
    return list(layers)


# the kinds whose kernels (transformers' torch chunked scans, FLA's and mamba-ssm's kernels, convolutions) take the
# pieces' length as a size, not a Python loop count: their compiled blocks run the pieces in groups by length
GROUPED_KINDS = ("gated_deltanet", "kda", "mamba2", "short_conv", "dynamic_short_conv", "rwkv_channel_mix")


@dataclass
class RecurrentWiring:
    layers: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    # recurrent="auto": path -> what it picks for that layer (LayerContext.choice)
    choices: dict[str, str] = field(default_factory=dict)
    # the row lengths up to which some layer runs heads (LayerContext.heads_up_to): the shard step compares each
    # batch's row length with them once, on the host (CPBatch.heads_rows)
    heads_upto: tuple = ()
    # path -> whether the layer's segment pads its pieces neutrally (LayerContext.neutral_padding), for the probed
    # layers that run a segment (a conv-only layer runs none: it reads the pieces' count, not their length)
    neutral: dict[str, bool] = field(default_factory=dict)
    _restores: list[Callable[[], None]] = field(default_factory=list)

    @property
    def pow2_pieces(self) -> bool:
        """Every layer segment wire's probe saw pads its pieces neutrally: a documents shard's split part may run as
        pieces a power of two long (``CPBatch(pow2_pieces=True)``), not one length per packing. (A segment handed
        such pieces checks its own padding: ``recurrent.documents.PiecesSegment``.)"""
        return bool(self.neutral) and all(self.neutral.values())

    @property
    def piece_groups(self) -> int:
        """How many groups by length a compiled block's padded pieces come in (``CPBatch(piece_groups=...)``):
        :data:`~ringmaster.sharding.documents.PIECE_GROUPS` where every wired kind's kernel takes the piece length as
        a size (:data:`GROUPED_KINDS`), so realistic packings stay within the pieces' budget; one where some kernel
        loops over the tokens in Python, which would specialise on every group's length (a graph per combination)."""
        return PIECE_GROUPS if self.kinds and all(k in GROUPED_KINDS for k in self.kinds) else 1

    def restore(self) -> None:
        for undo in reversed(self._restores):
            undo()
        self._restores.clear()
        self.layers.clear()
        self.kinds.clear()


def _default_group(group):
    if group is not None:
        return group
    rt = active(required=False)
    if rt is not None:
        return rt.cp_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _default_strategy(strategy: str | None) -> str:
    if strategy is not None:
        return strategy
    rt = active(required=False)
    return getattr(rt.config, "recurrent", "auto") if rt is not None else "auto"


def _hidden_size(model) -> int | None:
    return getattr(text_config(model.config), "hidden_size", None) if hasattr(model, "config") else None


def _probe_width(module, kind: str, hidden: int | None) -> int | None:
    """The input width of a probe forward of ``module``: its kind's ``probe_width``, else the hidden size."""
    width = get_kind(kind).probe_width
    return hidden if width is None else width(module, hidden)


def _routed(module, kind: str, ctx: LayerContext, spec) -> Callable[[], None]:
    """Route one layer instance through its kind's CP wiring (an FLA mixer through :func:`wire_fla_mixer`); returns
    the undo."""
    wire = wire_fla_mixer if fla_view(module) is not None else get_kind(kind).wire
    return wire(module, ctx, kernel_names(spec, kind))


def wire_recurrent_layers(model, group=None, layers=None, strategy: str | None = None,
                          probe: bool = True, auto: bool = False) -> RecurrentWiring:
    """Route every declared recurrent layer of ``model`` through exact cross-rank state passing.

    ``group`` and ``strategy`` are bound now (default: the current runtime's, else the default
    process group and ``"auto"``), and so is the model's step carrier (:mod:`ringmaster.sharding.carrier`:
    created here unless ``rm.wire`` made it, and registered with the current runtime when the group is its
    own), which layers called without the ``ringmaster_batch`` kwarg read. Fails closed, before touching anything, on a stateful layer the
    family does not declare. Then every wired layer is probed (:func:`probe_layer`): it must reach
    its replacement kernels and its output must depend on the state they pass in, or the wiring
    is undone and the layer named. ``restore()`` on the handle puts every original forward back."""
    spec = _spec_of(model)
    layers = check_recurrent_layers(model, None if layers is None else [(p, m, k) for p, m, k in layers], spec)
    rt = active(required=False)
    auto = auto or (strategy is None and rt is not None and rt.recurrent_auto)   # the runtime's config asked "auto"
    group, strategy = _default_group(group), _default_strategy(strategy)
    wiring = RecurrentWiring()
    hidden = _hidden_size(model)
    carrier, undo_carrier = attach(model, rt if rt is not None and rt.cp_group is group else None)
    wiring._restores.append(undo_carrier)
    try:
        for path, module, kind in layers:
            if strategy in KERNEL_STRATEGIES and strategy not in get_kind(kind).strategies:
                raise UnsupportedLayerError(
                    f"layer {path!r} (kind {kind!r}) does not offer recurrent={strategy!r}; only kinds "
                    f"{[k for k in known_kinds() if strategy in get_kind(k).strategies]} do. Use recurrent='scan' "
                    "or 'sequential'")
            ctx = LayerContext(path, group, strategy, carrier, auto=auto or strategy == "auto")
            wiring._restores.append(_routed(module, kind, ctx, spec))
            wiring.layers.append(path)
            wiring.kinds.append(kind)
            if probe:
                probe_layer(module, ctx, _required(spec, kind), _probe_width(module, kind, hidden),
                            kwargs=get_kind(kind).probe_kwargs)
            if ctx.neutral_padding is not None:
                wiring.neutral[path] = ctx.neutral_padding
            if ctx.auto and ctx.size > 1 and ctx.cost is not None:   # a layer that passes state, probed
                wiring.choices[path] = ctx.choice()
                if ctx.heads_up_to and ctx.heads_up_to not in wiring.heads_upto:
                    wiring.heads_upto = (*wiring.heads_upto, ctx.heads_up_to)
    except BaseException:
        wiring.restore()
        raise
    return wiring


def probe_layer(module, ctx: LayerContext, kernels: dict, hidden: int | None, length: int = 8,
                kwargs: Callable | None = None) -> None:
    """Prove the interception on one wired layer with a tiny forward (no grad, its own RNG): every
    intercepted kernel must be reached, and a random non-zero incoming state (conv halo, scan state)
    given to each must change the layer's output. If a transformers release changes the layer
    (another kernel name, a path that bypasses the kernels, a state that no longer reaches the
    output) this fails closed, naming the layer. ``kwargs(x)``: the extra arguments the layer's forward
    needs besides the hidden states (:attr:`RecurrentKind.probe_kwargs`)."""
    if compat.zero3_engine_holds(module):
        # DeepSpeed ZeRO-3 after deepspeed.initialize: its hooks own the parameters (a layer reading a child's weight
        # directly would read a placeholder); the static check of the kernel names stands, as for FSDP2. Wire before
        # deepspeed.initialize to get the probe
        return
    with compat.zero3_gathered(module):   # a model partitioned by zero.Init: the layer's parameters whole for the probe
        _probe(module, ctx, kernels, hidden, length, kwargs)


def _probe(module, ctx: LayerContext, kernels: dict, hidden: int | None, length: int, kwargs: Callable | None) -> None:
    param = next(module.parameters(), None)
    if hidden is None or param is None or param.device.type == "meta" or _is_dtensor(param):
        # nothing local to run on (deferred init, or FSDP2 already sharded the weights: wire before
        # fully_shard to get the probe): the static check of the kernel names stands
        return
    x = torch.randn(1, length, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(device=param.device, dtype=param.dtype)

    def run(inject: set) -> tuple[torch.Tensor, set]:
        ctx.probe = Probe(inject=inject, seed=17, path=ctx.path, heads=ctx.size if ctx.strategy == HEADS else 1,
                          auto=ctx.size if ctx.auto and ctx.cost is None else 1)
        try:
            with torch.no_grad():
                out = module(x, **(kwargs(x) if kwargs is not None else {}))
        finally:
            called, cost, neutral, ctx.probe = ctx.probe.called, ctx.probe.cost, ctx.probe.neutral, None
        ctx.cost = ctx.cost or cost   # recurrent="auto": what this layer sends under each strategy (the first run's)
        if ctx.neutral_padding is None:
            ctx.neutral_padding = neutral
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out, called

    base, called = run(set())
    missing = [name for role, name in kernels.items() if role not in called]
    if missing:
        raise UnsupportedLayerError(
            f"layer {ctx.path!r} ({type(module).__name__}) never called {missing} in a probe forward, so ringmaster's "
            "state passing would not run (a different transformers version, or a fused/hub kernel path); CP "
            "would be silently wrong. Load the model without that kernel path or leave CP off for it"
        )
    for role, name in kernels.items():
        out, _ = run({role})
        if torch.equal(out, base):
            raise UnsupportedLayerError(
                f"layer {ctx.path!r} ({type(module).__name__}): a non-zero incoming state given to {name} does not "
                "change the layer's output in a probe forward, so the state ringmaster passes across ranks would be "
                "ignored (a changed transformers layer?); CP would be silently wrong"
            )


def layer_costs(model, size: int, length: int = 8) -> dict[str, "LayerCost | str"]:
    """What ``recurrent="auto"`` weighs for each recurrent layer of ``model`` at CP size ``size``
    (:class:`~.cost.LayerCost`, recorded as ``rm.wire``'s probe records it), without wiring the model: each layer
    in turn is routed, run once on ``length`` tokens (no grad; the model may be on the meta device, as the memory
    planner builds it) and restored. A layer whose forward cannot run there maps to the reason."""
    spec = _spec_of(model)
    hidden = _hidden_size(model)
    out: dict = {}
    for path, module, kind in check_recurrent_layers(model, spec=spec):
        k = get_kind(kind)
        param = next(module.parameters(), None)
        width = _probe_width(module, kind, hidden)
        if param is None or width is None:
            out[path] = "no parameters or width to run it on"
            continue
        ctx = LayerContext(path, None, "auto", auto=True)
        undo = _routed(module, kind, ctx, spec)
        x = torch.zeros(1, length, width, device=param.device, dtype=param.dtype)
        ctx.probe = Probe(path=path, auto=size, record_only=True)
        cost = None
        try:
            with torch.no_grad():
                module(x, **(k.probe_kwargs(x) if k.probe_kwargs is not None else {}))
        except CostRecorded:
            cost = ctx.probe.cost
        except Exception as e:   # noqa: BLE001 - the layer's own code cannot run here: say what stopped it
            cost = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        finally:
            ctx.probe = None
            undo()
        if cost is not None:   # a kind without a scan (short convs: the halo under every strategy) records none
            out[path] = cost
    return out


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def recurrent_plan(models, size: int):
    """``(gated_deltanet_mixers, kda_mixers, mamba2_mixers)`` that need state passing at CP ``size``
    (lists of modules; all empty at size 1; every other kind is listed with the Mamba2 mixers: axolotl
    reads the first two as flash-linear-attention layers). Raises on a stateful layer ringmaster cannot pass."""
    gdn, kda, mamba = [], [], []
    if size <= 1:
        return gdn, kda, mamba
    for model in models:
        for path, module, kind in check_recurrent_layers(model):
            (gdn if kind == "gated_deltanet" else kda if kind == "kda" else mamba).append(module)
    return gdn, kda, mamba
