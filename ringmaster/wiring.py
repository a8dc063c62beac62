"""``rm.wire``: classify once, validate, bind, swap, report; atomic.

One walk over ``named_modules()`` classifies every layer against the family spec (a registered
one, or the generic path's for an unregistered model; fail closed on anything stateful or
attention-like the spec does not declare, on a refusing spec, and on position/MoE hazards). Everything is validated
before anything changes; then the runtime is set up (its attention function bound to this
model's groups and kernels), attention is switched, the VLM pre-hook installed, the recurrent
layers wired and probed, and the first-forward accounting armed (:mod:`.attention.accounting`). Every change pushes its undo; if any step fails, the undos run in
reverse and the model is exactly as it was. ``rm.unwire`` runs the same undos.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import runtime as _runtime
from .architectures import (classify_layers, get_architecture, position_convention, position_tables, refuse_if_unsafe,
                            stateful_layers, text_config, unforked_dropout, unsupported_message)
from .architectures.heads import common_split, head_splits
from .architectures import mixing
from .attention import bridge, flash_kernels, layer_rules, local, relbias
from .attention.accounting import arm
from .attention.ring import distflash
from .attention.ring.kernels import check_dtype
from .attention.ring.select import resolve_ring_impl
from .attention.selfattn import check_sites, site_paths, split_cross, wire_sites
from .attention.setup import setup
from .attention.ulysses import kv_replication
from .config import LoadBalance, RingImpl, RingmasterConfig, RingmasterPlan
from .errors import UnsupportedLayerError
from .mesh import intra_node_size
from .multimodal import wire_multimodal
from .recurrent.wiring import check_recurrent_layers, wire_recurrent_layers
from .runtime import Runtime
from .sharding import handle, rng, router
from .sharding.assignment import Cost
from .sharding.carrier import attach

__all__ = ["UnsupportedLayerError", "WireReport", "check_setup_path", "wire", "unwire"]


@dataclass
class WireReport:
    family: str
    attn_implementation: str | None
    inner_attn: str | None
    attention: list[str] = field(default_factory=list)
    recurrent: list[tuple[str, str]] = field(default_factory=list)
    # recurrent="auto": what it picks per recurrent layer (heads on rows up to a length, else the state passing)
    recurrent_choice: dict[str, str] = field(default_factory=dict)
    use_cache_switched_off: bool = False
    positions: str | None = None     # how absolute position tables are numbered (PositionConvention.describe)
    bridged: list[str] = field(default_factory=list)  # attention layers whose decoder layer drops **kwargs
    # wire(..., compile=True): the paths that do not compile with torch.compile(block, fullgraph=True), or that
    # have not been shown to, each with the reason and the fix (everything else compiles)
    compile_notes: list[str] = field(default_factory=list)
    # the token-mixing probe of the first CP forward (architectures.mixing): what it showed, in how long
    token_probe: str | None = None

    def __str__(self) -> str:
        lines = [f"ringmaster wired family={self.family} attention={self.attn_implementation} (inner {self.inner_attn})",
                 f"  {len(self.attention)} attention layers" + (f": {self.attention[0]} ..." if self.attention else "")]
        lines += [f"  recurrent {path}: {kind}" + (f", auto: {self.recurrent_choice[path]}"
                                                   if path in self.recurrent_choice else "")
                  for path, kind in self.recurrent]
        if self.positions:
            lines.append(f"  absolute positions numbered from the full row: {self.positions}")
        if self.bridged:
            lines.append(f"  ringmaster_batch carried past {len(self.bridged)} decoder layers that drop **kwargs")
        if self.use_cache_switched_off:
            lines.append("  use_cache switched off while wired")
        lines += [f"  compile: {note}" for note in self.compile_notes]
        if self.token_probe:
            lines.append(f"  token-mixing probe: {self.token_probe}")
        return "\n".join(lines)


# recurrent kinds whose scan path is shown to compile with fullgraph=True (tests/test_compile_recurrent.py,
# benchmarks/step_shape.py); the others run, exactly, but have not been traced
# recurrent kinds whose compiled blocks run packed rows as padded pieces (recurrent.documents.PiecesSegment)
PIECES_KINDS = ("gated_deltanet", "kda", "mamba2", "mamba1", "lightning", "rglru", "mlstm", "rwkv")
# recurrent kinds whose kernels loop over the tokens (lightning's over blocks of them) in Python: under
# load_balance="documents" they specialise on the split part's piece length, a graph per new length unless every
# layer pads its pieces neutrally (RecurrentWiring.pow2_pieces: then a power of two), measured over 30-50 packings
SPLIT_LENGTH_KINDS = ("lightning", "rglru", "rwkv", "mlstm")
# recurrent kinds that are convolutions only: their document gaps are the pieces' dynamic count
CONV_KINDS = ("short_conv", "dynamic_short_conv", "rwkv_channel_mix")
COMPILE_VERIFIED_KINDS = ("gated_deltanet", "mamba2", "mamba1", "kda", "lightning", "rglru", "rwkv", "rwkv_channel_mix",
                          "mlstm", "short_conv", "dynamic_short_conv")
# ring block kernels and inner attention kernels dynamo traces (torch ops with meta kernels)
COMPILE_VERIFIED_INNER = ("sdpa", "eager", "flex_attention")


def compile_notes(cfg: RingmasterPlan, inner: str, recurrent_kinds, strategy: str,
                  pow2_pieces: bool = False) -> list[str]:
    """What would not compile, or is not shown to, under ``torch.compile(block, fullgraph=True)``. ``pow2_pieces``:
    every recurrent layer pads its pieces neutrally (``RecurrentWiring.pow2_pieces``, from wire's probe), so a
    documents shard's split part runs as pieces a power of two long."""
    notes = []
    if cfg.ring_size > 1 and resolve_ring_impl(cfg.ring_impl, inner) is RingImpl.HF_KERNELS:
        notes.append("ring_impl='hf_kernels': a compiled ring runs the hub flash kernel inside ringmaster's custom "
                     "ops (torch.ops.ringmaster.ring_block / distflash_task), shown on the CPU stand-in only, not yet "
                     "run on a GPU; ring_impl='aten' is the path measured compiled there")
    if cfg.ulysses_size > 1 and cfg.ring_size == 1 and flash_kernels.is_flash(inner):
        notes.append(f"inner attention {inner!r} under Ulysses: a compiled block runs the kernel's low-level varlen "
                     "functions inside ringmaster's op (torch.ops.ringmaster.flash_varlen, its boundaries read on the "
                     "host from the step's handle), shown on the CPU stand-in only, not yet run on a GPU; with "
                     "attention sinks or attention dropout the kernel's flash_attn_varlen_func is traced instead, "
                     "which is not shown to compile (on the CPU stand-in fullgraph fails, and max_seqlen is a "
                     "per-packing int): compile a model with sinks on sdpa or flex_attention, and set "
                     "attention_dropout=0")
    elif inner not in COMPILE_VERIFIED_INNER:
        notes.append(f"inner attention {inner!r} is not shown to compile with fullgraph=True (checked: "
                     f"{', '.join(COMPILE_VERIFIED_INNER)})")
    kinds = sorted(set(recurrent_kinds))
    if kinds and strategy == "sequential":
        notes.append("recurrent='sequential' passes the state with blocking send/recv, which torch.compile cannot "
                     "trace: use recurrent='scan'")
    elif kinds and strategy == "fla_cp":
        notes.append("recurrent='fla_cp' (flash-linear-attention's own CP) is not shown to compile here")
    padded = [k for k in kinds if k in PIECES_KINDS]
    cut = [k for k in kinds if k not in PIECES_KINDS + CONV_KINDS]
    if padded:
        notes.append(f"recurrent layers ({', '.join(padded)}) on packed or padded rows run each chunk's documents "
                     "as padded pieces whose count and length are dynamic sizes, a chunk of one document too, and a "
                     "row of one document keeps its document ids: a block compiles once for all packings (measured "
                     "over 50 packings on every backend: 2 graphs for a two-block hybrid, packed and padded, none "
                     "after the first step), plus one per shape a kernel branches on: a kernel that pads to its "
                     "chunk size when every piece fits one chunk (Mamba2's torch scan, once in 50 packings on Ring), "
                     "a kernel that loops over the tokens in Python (mlstm, rwkv, rglru) one per power-of-two piece "
                     "length. Pieces that would pad past 4x the chunk in one batch (many short documents beside a "
                     "long one: 182-200 of 200 realistic rows, benchmarks/pieces_budget.py) run in 4 groups by length "
                     "where every kernel takes the length as a size (gated_deltanet, kda, mamba2, convolutions: one "
                     "more case, none past the budget there); for the kernels that loop in Python such a packing is "
                     "cut in Python and recompiles, and the shard step warns")
    if cfg.load_balance is LoadBalance.DOCUMENTS:
        notes.append("load_balance='documents': a compiled runtime's batches keep the same cases (every rank runs a "
                     "whole part, with 2 spare tokens of their own; something is split where anything can be, at "
                     "least 2 tokens a rank; the split part's heads choice made by the row's length), and the shard "
                     "lengths are sizes new per packing: compile the blocks with torch.compile(block, fullgraph=True, "
                     "dynamic=True) (measured, two-block models, 50 packings, every rank, every step exact: llama 1 "
                     "graph on Ulysses and both rings, 2 under USP 2x2; a gated-DeltaNet hybrid 2, one per block; a "
                     "Mamba2 hybrid 3-4, its torch scan's chunk count of 1 a case of its own); without dynamic=True "
                     "every size that changes for the first time is one graph more")
    if padded and cfg.load_balance is LoadBalance.DOCUMENTS:
        notes.append(f"recurrent layers ({', '.join(padded)}) under load_balance='documents': each part (the split "
                     "documents, the whole ones) runs as padded pieces; the power-of-two piece lengths a kernel that "
                     "loops over the tokens in Python runs over, and the model's kernels' branches on them, are "
                     "cases of their own (measured, 30 packings, Ulysses, dynamic=True: RG-LRU 5-6 graphs, "
                     "mLSTM 4-5, Mamba1 4-5, KDA 2, lightning 5-6); past dynamo's default limit of 8, raise "
                     "torch._dynamo.config.recompile_limit, or use a static load_balance for compiled hybrids")
    looped = [k for k in padded if k in SPLIT_LENGTH_KINDS]
    if padded and not pow2_pieces and cfg.load_balance is LoadBalance.DOCUMENTS:
        notes.append(f"recurrent layers ({', '.join(looped or padded)}) under load_balance='documents' keep compiling "
                     "graphs as new lengths of the split documents' part come: not every recurrent layer of this model "
                     "pads its pieces neutrally (a Mamba step size clamped above 0, or gates computed in the kernel, "
                     "move a state through any padding), so the split part's "
                     "lone piece fills its row, and a kernel that loops over the tokens in Python or branches on the "
                     "length compiles a graph per new length (measured, Ulysses, two-block models, 30 packings, when "
                     "lightning and RWKV did not pad neutrally: 18-20 graphs for lightning, 28-30 for RWKV). Raising recompile_limit only postpones the failure: "
                     "compile this model with a static load_balance ('none' or 'head_tail')")
    if cut:
        notes.append(f"recurrent layers ({', '.join(cut)}) on packed or padded rows: not run as padded pieces, the "
                     "chunks are cut at their document starts in Python, and a new packing recompiles the block "
                     "(unpacked rows compile once)")
    if not handle.AVAILABLE:
        notes.append(f"torch {torch.__version__} has no opaque objects for custom ops: Ulysses' sdpa tiles on "
                     "packed rows plan in the graph, and each new packing recompiles the blocks")
    unverified = [k for k in kinds if k not in COMPILE_VERIFIED_KINDS]
    if unverified:
        notes.append(f"recurrent kinds {unverified} run exactly but are not shown to compile with fullgraph=True "
                     f"(shown: {', '.join(COMPILE_VERIFIED_KINDS)} on recurrent='scan')")
    return notes


def _spec(model):
    try:
        return get_architecture(model)
    except ValueError:
        found = stateful_layers(model)
        if found:  # name the layer that makes this model unsafe, not just the unknown family
            path, cls = found[0]
            raise UnsupportedLayerError(unsupported_message(path, cls, getattr(model.config, "model_type", None))
                                        ) from None
        raise


def _configs(model) -> list:
    """Every distinct config object of the model and its submodules (a VLM has several)."""
    seen, out = set(), []
    for module in (model, *model.modules()):
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            out.append(config)
    return out


def _switch_off_cache(model, undo: list) -> bool:
    """transformers' convention (as with gradient checkpointing): warn and switch the cache off.
    Under CP a KV cache would hold only this rank's shard."""
    switched = False
    for config in _configs(model):
        if getattr(config, "use_cache", False):
            undo.append(lambda c=config, value=config.use_cache: setattr(c, "use_cache", value))
            config.use_cache = False
            switched = True
    if switched:
        warnings.warn(f"ringmaster: {type(model).__name__} had use_cache=True; switched off while wired for CP "
                      "(a KV cache would hold only this rank's shard). rm.unwire restores it", stacklevel=3)
    return switched


def _refuse_generate(model, undo: list) -> None:
    """transformers' ``generate`` decodes unsharded (one token at a time, a growing KV cache), which CP attention
    cannot run: on the wired instance it raises at once, naming ``rm.unwire``; the undo puts it back."""
    if not callable(getattr(model, "generate", None)):
        return
    saved = model.__dict__.get("generate")

    def generate(*args, **kwargs):
        raise RuntimeError(
            f"{type(model).__name__}.generate on a model wired by ringmaster: generation decodes unsharded (one token "
            "at a time, with a KV cache), which CP attention cannot run. Call rm.unwire(model) before generating and "
            "rm.wire(model, ...) again to train, or generate with an unwired copy of the model (or vLLM)")

    def undo_generate():
        if saved is None:
            model.__dict__.pop("generate", None)
        else:
            model.generate = saved
    model.generate = generate
    undo.append(undo_generate)


def _switch_attention(model, spec, name: str, undo: list) -> None:
    """Point the text model's attention at the runtime's registered name (a VLM's vision tower keeps
    its own kernel); the undo puts every config's original value back."""
    originals = [(config, config._attn_implementation) for config in _configs(model)]

    def restore():
        for config, value in originals:
            config._attn_implementation = value

    undo.append(restore)
    if spec.multimodal:
        undo.append(wire_multimodal(model, spec, name).remove)
    else:
        model.set_attn_implementation(name)


def _rescaled_loss(spec) -> bool:
    """A family whose loss ringmaster rescales itself (a self-attention site's ``mean_loss``: a collective in
    its hook), which the token-mixing check's loss test must not re-run."""
    return any(site.mean_loss for site in (spec.self_attention or {}).values())


def _batch_rule(spec) -> bool:
    """A family whose per-row statistic (xlm's padding count) a declared batch rule makes exact under CP."""
    return any(site.batch_rule is not None for site in (spec.self_attention or {}).values())


def _check_documents(spec, model) -> None:
    """``load_balance="documents"`` runs each attention and recurrent kernel in two parts (the split documents
    over the group, the whole ones locally); what cuts per-token state of its own is refused here, before any
    collective."""
    found = ("its modules compute attention themselves (self-attention sites)" if spec.self_attention else
             "a relative position bias travels with its queries" if spec.relative_bias else
             "it is a vision-language model (its fused sequence is cut by the language model)" if spec.multimodal
             else "")
    if found:
        raise UnsupportedLayerError(
            f"{type(model).__name__} ({spec.name}): load_balance='documents' is not supported for this family: "
            f"{found}; use load_balance='auto'")


def wire(model, cfg: RingmasterConfig | RingmasterPlan | None = None, device_mesh=None,
         cp_dim: str = "cp", compile: bool = False) -> Runtime:
    """Make ``model`` context parallel: look up its family, validate, set up a runtime bound to this
    model, switch attention in place, wire the recurrent layers. Returns the runtime;
    ``runtime.report`` says what changed and ``unwire(model)`` undoes it. On any failure the model
    (and the current runtime) is left exactly as it was. ``cfg`` is resolved into a frozen plan
    (``runtime.config``); the object passed in is never changed.

    ``compile=True`` prepares the model for ``torch.compile(block, fullgraph=True)`` (torchtitan's order:
    wire, checkpoint, compile, then FSDP): ``recurrent="auto"`` picks the all-gather scan at every CP size
    (the sequential pass's send/recv does not trace), and ``runtime.report.compile_notes`` names, with a
    warning, every path that does not compile or is not shown to; everything else compiles."""
    if getattr(model, "_ringmaster_runtime", None) is not None:
        raise RuntimeError(
            f"{type(model).__name__} is already wired by ringmaster; call rm.unwire(model) before wiring again"
        )
    if cfg is None:
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        cfg = RingmasterConfig(size=size)
    # ---- validate: nothing changes until every check has passed
    spec = _spec(model)
    if spec.refuse:
        refuse_if_unsafe(model, spec)
    tcfg = text_config(model.config)
    num_heads = getattr(tcfg, spec.num_heads_attr, None)
    num_kv = getattr(tcfg, spec.num_kv_heads_attr, None) or num_heads
    inner = tcfg._attn_implementation or model.config._attn_implementation or "sdpa"
    if spec.supported_inner is not None and inner not in spec.supported_inner:
        raise ValueError(f"family {spec.name!r} supports attn_implementation in {spec.supported_inner} under CP, "
                         f"the model uses {inner!r}")
    layers = classify_layers(model, spec)
    layers.attention, cross = split_cross(spec, layers.attention)
    check_sites(model, spec, layers.attention)
    # each attention layer's own split (per-layer head counts, MQA, tiled KV): architectures/heads.py
    splits = head_splits(model, layers.attention, tcfg, spec.num_heads_attr, spec.num_kv_heads_attr)
    if splits:
        num_heads, num_kv = common_split(splits)
    recurrent = check_recurrent_layers(model, layers.recurrent, spec) if layers.recurrent else []
    refuse_if_unsafe(model, spec, [p for p, _, _ in layers.recurrent])
    # absolute position tables: probe (tiny forwards of the still unwired model) how the model numbers them
    positions = position_convention(model, spec, [p for p, _, _ in layers.recurrent])
    # the frozen plan this model runs by (runtime.config); the caller's config object is never changed
    asked_recurrent = cfg.recurrent
    cfg = cfg.resolve(num_kv_heads=num_kv, intra_node_size=intra_node_size(), num_heads=num_heads)
    if compile and asked_recurrent == "auto" and cfg.recurrent != "scan":
        cfg = cfg.replace(recurrent="scan")   # the sequential pass's send/recv does not trace
    if cfg.ulysses_size > 1:
        for path, (hq, hk) in (splits or {"": (num_heads, num_kv)}).items():
            if hq is None:
                continue
            try:
                kv_replication(hq, hk, cfg.ulysses_size)  # raises with the splits that work
            except ValueError as e:
                raise ValueError(f"{e} (layer {path!r})" if path else str(e)) from None
    if cfg.ring_size > 1:
        param = next(model.parameters())
        check_dtype(resolve_ring_impl(cfg.ring_impl, inner), param.device, param.dtype, inner)
        if cfg.load_balance is LoadBalance.DISTFLASH and cfg.ulysses_size == 1:
            distflash.check_model(model, tcfg, layers.attention)

    if cfg.load_balance is LoadBalance.DOCUMENTS:
        _check_documents(spec, model)

    strategy = cfg.recurrent

    # ---- change, recording every undo
    previous = _runtime.active(required=False)
    undo: list = []
    try:
        rt = setup(cfg, num_kv_heads=num_kv, device_mesh=device_mesh, cp_dim=cp_dim, inner_attn=inner,
                   num_heads=num_heads)
        rt.multimodal = spec if spec.multimodal else None
        rt.compiled = compile
        # load_balance="documents": the work model its assignment balances by (sharding.assignment.Cost)
        layers_total = getattr(tcfg, "num_hidden_layers", None) or max(len(layers.attention) + len(recurrent), 1)
        rt.cost = Cost.for_model(getattr(tcfg, "hidden_size", None), len(layers.attention) / layers_total)
        rt.positions = positions   # the shard step numbers absolute positions by it (sharding.positions)
        undo.append(lambda: setattr(rt, "positions", None))
        # the model's step carrier, for the layers transformers calls without the ringmaster_batch kwarg
        carrier, detach = attach(model, rt)
        undo.append(detach)
        # dropout: each rank's CP forward draws from its own forked random state (sharding/rng.py); a VLM's
        # vision tower runs replicated on every rank before its language model, so it keeps the shared stream
        # (only a model that applies dropout: nothing else draws, and the random stream is left alone)
        forked = model.get_submodule(spec.language_model) if spec.multimodal else model
        if unforked_dropout(forked):
            undo.extend(handle.remove for handle in rng.install(forked, carrier))
        switched = _switch_off_cache(model, undo)
        _refuse_generate(model, undo)
        # the MoE router loss: its statistics summed over the group (sharding/router.py), or refused per call
        undo.extend(router.wire_router_loss(model, text_config(model.config), rt.cp_group, rt.cp_size,
                                            lambda: carrier.current, multimodal=spec.multimodal))
        bridged = []
        if rt.attn_implementation is not None and spec.self_attention:
            # attention computed by the modules themselves: each gets its CP site; attn_implementation
            # stays (falcon's forward takes its SDPA branch only while it says "sdpa")
            modules = dict(model.named_modules())
            undo.append(wire_sites(model, spec, rt.binding, {p: modules[p] for p in layers.attention},
                                   cross={p: modules[p] for p in cross}, carrier=carrier))
        elif rt.attn_implementation is not None:
            _switch_attention(model, spec, rt.attn_implementation, undo)
            if spec.relative_bias:  # Inkling: the bias modules return per-token states (attention.relbias)
                modules = dict(model.named_modules())
                undo.append(relbias.wire(spec, {p: modules[p] for p in layers.attention}))
            if spec.local_attention:  # Inkling2: attention over layer depth runs the wrapped kernel locally
                undo.append(local.wire(spec, model))
            bridged, handles = bridge.install(model, layers.attention)
            undo.extend(handle.remove for handle in handles)
        if recurrent:
            wiring = wire_recurrent_layers(model, group=rt.cp_group, layers=recurrent, strategy=strategy,
                                           auto=asked_recurrent == "auto")
            undo.append(wiring.restore)
            rt.recurrent_wiring = wiring
        notes: list[str] = []
        if compile:   # after the recurrent wiring: its probe tells whether every layer pads its pieces neutrally
            notes = compile_notes(cfg, inner, [k for _, _, k in recurrent], strategy,
                                  pow2_pieces=bool(recurrent) and wiring.pow2_pieces)
            if notes:
                warnings.warn("rm.wire(compile=True): " + "; ".join(notes), stacklevel=2)
        rt.report = WireReport(family=spec.name, attn_implementation=rt.attn_implementation, inner_attn=inner,
                               attention=layers.attention, recurrent=[(p, k) for p, _, k in recurrent],
                               use_cache_switched_off=switched, bridged=bridged,
                               positions=positions.describe() if positions else None, compile_notes=notes,
                               recurrent_choice=dict(wiring.choices) if recurrent else {})
        if rt.binding is not None and rt.binding.ledger is not None and rt.attn_implementation is not None:
            modules = dict(model.named_modules())
            arm(rt.binding.ledger, model, {p: modules[p] for p in layers.attention},
                positions=positions, tables={p: modules[p] for p, _ in positions.modules} if positions else None)
            undo.append(rt.binding.ledger.disarm)
        # everything it does not route must be per-token: checked on the first CP forward of each mode, on the
        # decoder as it runs with the routed modules standing in (architectures.mixing)
        # attention modules that call the attention interface run in its runs, CP attention answering per token;
        # what computes attention itself (sites), cross-attention, recurrent layers and towers stand in whole
        # (those whose local-index arithmetic CP attention corrects, layer_rules.local_index_rules, stand in whole too)
        modules = dict(model.named_modules())
        sites = spec.self_attention or rt.attn_implementation is None
        routed = [p for p in layers.attention if sites or layer_rules.local_index_rules(modules[p])] + list(
            cross) + [p for p, _, _ in layers.recurrent] + list(spec.vision_modules)
        replayed = [p for p, _ in positions.modules] if positions else []
        replayed += site_paths(model, spec) if spec.self_attention else []
        check = mixing.MixingCheck(model, mixing.decoder_path(model, spec),
                                   {p: modules[p] for p in routed + replayed if p in modules}, set(replayed),
                                   rt.cp_group, carrier, rt.report, loss=not (spec.multimodal or _rescaled_loss(spec)),
                                   surround=not (spec.multimodal or _batch_rule(spec)))
        mixing.arm(check, model)
        rt.mixing = check
        undo.append(check.disarm)
        model._ringmaster_runtime = rt
        undo.append(lambda: model.__dict__.pop("_ringmaster_runtime", None))
    except BaseException:
        for step in reversed(undo):
            step()
        _runtime.make_current(previous)
        raise
    rt.undo = undo
    return rt


def unwire(model) -> None:
    """Restore everything ``wire`` changed (attention, recurrent layers, VLM hook, use_cache)."""
    rt = getattr(model, "_ringmaster_runtime", None)
    if rt is None:
        return
    for step in reversed(rt.undo):
        step()
    rt.undo = []
    model.__dict__.pop("_ringmaster_runtime", None)


_USE_WIRE = ("wire the model with rm.wire(model, cfg) (axolotl: the ringmaster plugin) instead of rm.setup + "
             "model.set_attn_implementation, which only swaps the attention kernel")


def check_setup_path(model) -> None:
    """Validate a model that reaches CP attention through ``rm.setup`` + ``set_attn_implementation``
    (not ``rm.wire``): ``wire``'s own checks, and a refusal for anything only ``wire`` installs.
    Runs once per model at its first sharded forward (``runtime.check_setup_path``), before any
    collective; raises :class:`UnsupportedLayerError` naming the layer and the fix."""
    spec = _spec(model)
    refuse_if_unsafe(model, spec)
    layers = classify_layers(model, spec)
    recurrent_paths = [p for p, _, _ in layers.recurrent]
    refuse_if_unsafe(model, spec, recurrent_paths)
    for path, module, kind in layers.recurrent:
        if getattr(module, "_ringmaster_recurrent", None) is None:
            raise UnsupportedLayerError(
                f"layer {path!r} ({type(module).__name__}, recurrent kind {kind!r}) carries state along the sequence "
                "and is not wired for CP: call rm.wire_recurrent_layers(model, group=runtime.cp_group) after "
                f"set_attn_implementation, or {_USE_WIRE}")
    tables = position_tables(model, tuple(spec.vision_modules) + tuple(recurrent_paths))
    if tables:
        path, module = tables[0]
        raise UnsupportedLayerError(
            f"layer {path!r} ({type(module).__name__}) is an absolute position table: only rm.wire learns how the "
            f"model numbers it and numbers each shard from the full row; {_USE_WIRE}")
    sites = [path for path, m in model.named_modules() if type(m).__name__ in spec.self_attention]
    if sites:
        raise UnsupportedLayerError(
            f"layer {sites[0]!r} ({type(dict(model.named_modules())[sites[0]]).__name__}) computes attention itself; "
            f"only rm.wire routes it through CP attention (a self-attention site); {_USE_WIRE}")
    dropout = unforked_dropout(model)
    if dropout:
        raise UnsupportedLayerError(
            f"{dropout[0]}{f' (and {len(dropout) - 1} more)' if len(dropout) > 1 else ''}: dropout under CP needs each "
            "rank's forward to draw from its own forked random state, which only rm.wire installs (without it "
            "every rank reuses one mask pattern); set the model's dropout to 0.0 or "
            + _USE_WIRE)
    bridged = bridge.bridge_paths(model, layers.attention)
    if bridged:
        raise UnsupportedLayerError(
            f"attention layer {bridged[0]!r} is called without **kwargs by its decoder layer, so the batch's global "
            f"structure reaches it only through the bridge rm.wire installs; {_USE_WIRE}")


_runtime.register_setup_path_check(check_setup_path)
