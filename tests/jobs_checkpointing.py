"""Jobs for tests/test_checkpointing.py (run on every rank of the pool): every CP backend under every
activation-checkpointing mode, against the same model without CP and without checkpointing.

A *cell* is (backend, mode). Backends: Ulysses, Ring with p2p (``alltoall``) and ``allgather`` KV
rotation, USP (P=4: 2 x 2), and a gated-DeltaNet hybrid (qwen3_5_text: conv halo + state passing)
with the ``scan`` and ``sequential`` strategies. Modes:

- ``hf_reentrant``: ``model.gradient_checkpointing_enable({"use_reentrant": True})`` before ``rm.wire``
  (the forward runs under ``no_grad``, the recompute with grad: any path that depends on
  ``torch.is_grad_enabled()`` must issue the same collectives);
- ``hf``: the same with ``use_reentrant=False``, enabled *after* ``rm.wire`` (the Trainer's order);
- ``hf_offload``: ``activation_checkpointing_enable(offload=True)`` (transformers 5.24's name for it; the
  saved layer inputs go through ``torch.autograd.graph.save_on_cpu``);
- ``torch``: torch's non-reentrant ``checkpoint_wrapper`` around every decoder layer after ``rm.wire``
  (what accelerate's FSDP ``activation_checkpointing`` applies; it runs the layer's ``__call__``, hooks
  included, inside ``torch.utils.checkpoint``);
- ``fsdp2``: ``fully_shard`` on every decoder layer and the root over the flattened (dp, cp) mesh, with
  HF non-reentrant checkpointing (FSDP2's hooks stay outside the checkpoint).

Every step runs **two micro-batches** (different packed document structures) forward, then one
backward of the summed losses: a recompute that reads per-step state from "the last forward" instead
of its own (a step carrier not replayed by the checkpoint) uses the second batch's documents for the
first and is wrong.

Checks per cell (fp64, keep_fp64): the CP-group mean loss, the gathered logits of both micro-batches and
every parameter gradient (each against its own norm) against the reference; and the collectives: the
forward-phase collectives ringmaster issued during backward (the recompute) are exactly those of the
forward (kind, bytes and tag, as multisets). A mode ``<mode>+tiled`` also runs the MLPs through
``rm.tiled_mlp`` (sequence tiles, each recomputed in backward, nested in the layer's checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections import Counter

import torch
import torch.distributed as dist

import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from ringmaster.checkpointing import CHECKPOINT_ATTRS, Replaying
from ringmaster.sharding.carrier import StepCarrier
from ringmaster_tools.parity import keep_fp64, packed_batch, per_document_forward, rel_err, tiny_model

# cells of both CP sizes in one job, FSDP2 over dp x cp: every rank of the pool
# (ringmaster_tools.pool.RankContext: this module's jobs are never solo)
ALL_GROUPS = True

# backend -> (model type, RingmasterConfig kwargs, P)
BACKENDS = {
    "ulysses": ("llama", dict(backend="ulysses"), 2),
    "ring_p2p": ("llama", dict(backend="ring", rotate_method="alltoall"), 2),
    "ring_allgather": ("llama", dict(backend="ring", rotate_method="allgather"), 2),
    "usp": ("llama", dict(backend="usp", ulysses_size=2, ring_size=2), 4),
    "scan": ("qwen3_5_text", dict(backend="ulysses", recurrent="scan"), 2),
    "sequential": ("qwen3_5_text", dict(backend="ring", recurrent="sequential"), 2),
    # pure Mamba2: its blocks never get the batch kwarg, the mixers read it from the step carrier
    "mamba2": ("mamba2", dict(recurrent="scan"), 2),
    # falcon computes attention itself (torch's SDPA, a declared site): the site reads the step carrier
    "falcon": ("falcon", dict(backend="ulysses"), 2),
    # a hybrid whose Mamba decoder layers drop **kwargs: its mixers read the step carrier (attention gets the kwarg)
    "jamba": ("jamba", dict(backend="ulysses", recurrent="scan"), 2),
}
MODES = ("hf_reentrant", "hf", "hf_offload", "torch", "fsdp2")
TOL = 1e-8   # fp64: measured <= 1e-15, but 3e-10 on the A_log of the gated-DeltaNet layers (cancellation)

# two micro-batches of one step: packed rows with different document boundaries (S=32)
DOCS = ([20, 12], [7, 17, 8])

_FLAT: dict = {}


@contextlib.contextmanager
def _unpinned_offload(counter: list):
    """transformers 5.24's ``offload=True`` asks ``save_on_cpu`` for *pinned* host memory, which torch refuses
    on a machine with no accelerator (``pin_memory=True requires a CUDA or other accelerator backend``):
    on CPU the job swaps the name its checkpoint function looks up for the same hooks unpinned (and counts
    the layer calls that went through it). On a GPU the stock path runs unchanged."""
    import transformers.modeling_utils as mu

    stock = mu.save_on_cpu

    def unpinned(pin_memory=False, device_type="cuda"):
        counter.append(device_type)
        return stock(pin_memory=False, device_type=device_type)

    mu.save_on_cpu = unpinned
    try:
        yield
    finally:
        mu.save_on_cpu = stock


def _layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _hf(model, reentrant: bool):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _checkpoint_wrap(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    layers = {id(m) for m in _layers(model)}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in layers)


def _fsdp(ctx, model, P):
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh(P)
    if P not in _FLAT:
        _FLAT[P] = mesh[("dp", "cp")]._flatten(f"dp_cp{P}") if mesh["dp"].size() > 1 else mesh["cp"]
    flat = _FLAT[P]
    _hf(model, reentrant=False)
    for layer in _layers(model):
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)


def _grads(model, group, P, fsdp: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        name = name.replace("._checkpoint_wrapped_module", "")   # checkpoint_wrapper's extra level
        if fsdp:   # FSDP2 already averaged over dp x cp (every dp replica ran the same batch)
            out[name] = p.grad.full_tensor()
        else:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            out[name] = g / P
    return out


def _sig(profile, phase="forward") -> Counter:
    return Counter((r.kind, r.bytes_sent, r.tag) for r in profile.records if r.phase == phase)


# smaller than parity.TINY where it costs: one gated-DeltaNet layer and one attention layer
SHRINK = {"qwen3_5_text": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
          "falcon": dict(num_attention_heads=4, num_kv_heads=4, new_decoder_architecture=True, alibi=False)}


def reference(model_type: str):
    """The seeded fp64 model and its reference step (no CP, no checkpointing): both micro-batches, each
    document alone, one backward of the summed losses."""
    base = tiny_model(model_type, dtype=torch.float64, **SHRINK.get(model_type, {}))
    ref_model = copy.deepcopy(base)
    batches = [packed_batch(base.config.vocab_size, docs, seed=3 + i) for i, docs in enumerate(DOCS)]
    ref = [per_document_forward(ref_model, b) for b in batches]
    sum(o.loss for o in ref).backward()
    grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    return base, batches, ref, grads


def cell(ctx, backend: str, mode: str, base, batches, ref, ref_grads) -> dict:
    """One (backend, mode) cell on this rank: errors against the reference and the collective check."""
    _, kwargs, P = BACKENDS[backend]
    mode, _, extra = mode.partition("+")
    model = copy.deepcopy(base)
    if extra == "tiled":   # ringmaster.tiled_mlp: the MLPs over tiles of 4 tokens of the 16-token shard
        rm.tiled_mlp(model, tile_size=4)
    if mode == "hf_reentrant":
        _hf(model, reentrant=True)
    elif mode == "hf_offload":
        model.activation_checkpointing_enable({"use_reentrant": False}, offload=True)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, **kwargs), device_mesh=ctx.mesh(P))
    group = runtime.cp_group
    offloaded: list = []

    def offload():
        return _unpinned_offload(offloaded) if mode == "hf_offload" else contextlib.nullcontext()
    try:
        if mode == "hf":
            _hf(model, reentrant=False)
        elif mode == "torch":
            _checkpoint_wrap(model)
        elif mode == "fsdp2":
            _fsdp(ctx, model, P)
        outs = []
        with offload(), rm.profile_comms() as fwd:
            for b in batches:
                with context_parallel_region(b, runtime=runtime) as shard:
                    outs.append(model(**shard))
        with offload(), rm.profile_comms() as bwd:
            sum(o.loss for o in outs).backward()
        losses = []
        for o in outs:
            piece = o.loss.detach().clone()
            dist.all_reduce(piece, group=group)
            losses.append(piece / P)
        logits = [rm.gather_sequence(o.logits.detach(), dim=1, runtime=runtime) for o in outs]
        grads = _grads(model, group, P, fsdp=(mode == "fsdp2"))
    finally:
        rm.unwire(model)
        rm.teardown()
    leftover = [n for n, m in model.named_modules() for a in CHECKPOINT_ATTRS
                if isinstance(m.__dict__.get(a), Replaying)]
    grad_errs = {n: rel_err(grads[n], g) for n, g in ref_grads.items() if n in grads}
    worst = max(grad_errs, key=grad_errs.get)
    return {
        "loss_err": max(abs(a.item() - r.loss.item()) / abs(r.loss.item()) for a, r in zip(losses, ref)),
        "logits_err": max(rel_err(a, r.logits) for a, r in zip(logits, ref)),
        "grad_err": grad_errs[worst], "worst_param": worst,
        "missing": sorted(set(ref_grads) - set(grads)),
        "n_grads": len(grad_errs),
        "offloaded_calls": len(offloaded),
        "fwd_collectives": sum(_sig(fwd).values()),
        "recompute_matches": _sig(fwd) == _sig(bwd),
        "recompute_collectives": sum(_sig(bwd).values()),
        "leftover_wrappers": leftover,   # rm.unwire must put every checkpoint function back
    }


@contextlib.contextmanager
def _mutation(name: str | None):
    """``stale_slot`` / ``stale_site_slot`` / ``stale_carrier`` (Mamba2's mixers, falcon's sites, the hybrid's
    gated-DeltaNet mixers): the step carrier is neither replayed by the checkpoint functions nor cleared
    after the step, so a recomputation reads the last forward's batch; ``unreplayed_carrier``: not replayed
    but cleared, so a recomputation finds no batch; ``grad_path``: Ulysses sends q, k, v in three
    all-to-alls when grad is off (a reentrant checkpoint's forward) and in one fused all-to-all with grad
    (its recomputation); exact, but not the same collectives."""
    if name is None:
        yield
        return
    if name in ("stale_slot", "stale_site_slot", "stale_carrier", "unreplayed_carrier"):
        from ringmaster.sharding import carrier as target

        patches = [(target.checkpointing, "arm", lambda model, holder: None)]
        if name != "unreplayed_carrier":
            patches.append((StepCarrier, "clear", lambda self, previous=None: None))
        stocks = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
        for obj, attr, mutant in patches:
            setattr(obj, attr, mutant)
        try:
            yield
        finally:
            for obj, attr, stock in stocks:
                setattr(obj, attr, stock)
        return
    elif name == "grad_path":
        from ringmaster.attention import ulysses as target

        attr, stock = "seq_to_head", target.seq_to_head

        def mutant(tensors, group):
            if torch.is_grad_enabled():
                return stock(tensors, group)
            return [stock([t], group)[0] for t in tensors]
    else:
        raise ValueError(name)
    setattr(target, attr, mutant)
    try:
        yield
    finally:
        setattr(target, attr, stock)


def _world_cell(ctx, backend: str, mode: str) -> bool:
    """A cell that needs every rank of the pool: P equals the world (USP) or FSDP2 over the flattened dp x cp."""
    return BACKENDS[backend][2] == ctx.world or mode.partition("+")[0] == "fsdp2"


def matrix(ctx, cells, mutation: str | None = None, share: bool = False) -> dict:
    """Many cells in one pool job, one reference per model type (P=4 cells run on the (1, 4) mesh;
    P=2 on (2, 2)). ``share``: the cells that need every rank (:func:`_world_cell`) run first on all of them, then
    the dp groups of each smaller CP size take alternate cells of that size (each cell runs on one CP group, not
    the same cell on every group side by side); the caller merges the ranks' results."""
    if share:
        mine = [c for c in cells if _world_cell(ctx, *c)]
        for P in sorted({BACKENDS[b][2] for b, m in cells if not _world_cell(ctx, b, m)}):
            mesh = ctx.mesh(P)
            of_size = [c for c in cells if not _world_cell(ctx, *c) and BACKENDS[c[0]][2] == P]
            mine += of_size[mesh.get_local_rank("dp")::mesh["dp"].size()]
        cells = mine
    out, refs = {}, {}
    with keep_fp64(recompute=True), _mutation(mutation):
        for backend, mode in cells:
            model_type = BACKENDS[backend][0]
            if model_type not in refs:
                refs[model_type] = reference(model_type)
            start = time.process_time()
            out[f"{backend}/{mode}"] = cell(ctx, backend, mode, *refs[model_type])
            out[f"{backend}/{mode}"]["cpu_s"] = time.process_time() - start
    return out



def raised(ctx, cells, mutation: str | None = None):
    """:func:`matrix`, returning ``(exception type, message)`` if it raised on this rank, else None."""
    try:
        matrix(ctx, cells, mutation)
    except Exception as exc:  # the test asserts on the type and message
        return type(exc).__name__, str(exc)
    return None
