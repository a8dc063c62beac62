"""Jobs for tests/test_carrier.py (run on every rank of the pool): the one per-model step carrier, looked at
from outside on wired models: where it is bound, who sets and clears it, what ``rm.unwire`` leaves."""

from __future__ import annotations

import torch

import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from ringmaster.checkpointing import CHECKPOINT_ATTRS, Replaying
from ringmaster.sharding.carrier import carrier_of
from ringmaster.sharding.documents import BATCH_KWARG
from ringmaster_tools import zoo
from ringmaster_tools.parity import packed_batch, tiny_model

# the checkpointing matrix's tiny models (tests/jobs_checkpointing.py); stablelm from the zoo
SHRINK = {"falcon": dict(num_attention_heads=4, num_kv_heads=4, new_decoder_architecture=True, alibi=False)}


def _build(family):
    if family == "stablelm":
        return zoo.build_tiny(family, zoo.tiny_config(family))
    return tiny_model(family, **SHRINK.get(family, {}))


def _hooked(model) -> list[str]:
    return sorted(p for p, m in model.named_modules() if p and (m._forward_pre_hooks or m._forward_hooks))


def _replaying(model, carrier) -> int:
    return sum(isinstance(m.__dict__.get(a), Replaying) and m.__dict__[a].holder is carrier
               for m in model.modules() for a in CHECKPOINT_ATTRS)


def carrier_life(ctx, family: str, P: int = 2) -> dict:
    """Wire ``family``; one region step and one manager step with HF checkpointing enabled after the wiring
    (the Trainer's order); what the carrier held when, and what was hooked and wrapped."""
    model = _build(family)
    out: dict = {"before": _hooked(model)}
    rt = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    carrier = carrier_of(model)
    hf_hooks: set = set()
    try:
        out["registered"] = [c is carrier for c in rt.carriers]
        out["bridged"] = list(rt.report.bridged)
        out["hooked"] = _hooked(model)            # submodules ringmaster put a hook on
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf_hooks = set(_hooked(model)) - set(out["hooked"])   # transformers' own (enable_input_require_grads)
        seen = []
        probe = next(m for m in model.modules() if m is not model and not list(m.children()))
        handle = probe.register_forward_pre_hook(lambda m, a: seen.append(carrier.current))
        batch = packed_batch(model.config.get_text_config().vocab_size, [20, 12])
        with context_parallel_region(batch, runtime=rt) as shard:
            loss = model(**shard).loss
            step = shard[BATCH_KWARG]
        # the step's batch (or, in the token-mixing check's runs after the first forward, its per-token copy)
        out["region"] = {"during": all(s is step or getattr(s, "stand_in", False) for s in seen) and bool(seen),
                         "after": carrier.current is None,
                         "wrapped": _replaying(model, carrier)}
        loss.backward()
        out["region"]["after_backward"] = carrier.current is None
        seen.clear()
        manager = rm.ContextParallelContextManager([model], rt.cp_group)
        handles = manager.install()
        try:
            model(**batch).loss.backward()
        finally:
            for h in handles:
                h.remove()
        out["manager"] = {"during": bool(seen) and all(s is not None for s in seen), "after": carrier.current is None}
        handle.remove()
        model.gradient_checkpointing_disable()
    finally:
        rm.unwire(model)
        rm.teardown()
    out["left"] = {"carrier": carrier_of(model) is not None, "wrapped": _replaying(model, carrier),
                   "hooked": sorted(set(_hooked(model)) - hf_hooks), "registered": len(rt.carriers)}
    return out


def two_models(ctx, P: int = 2) -> dict:
    """Two wired models in one process (a policy and a reference): a carrier each, and a region for one sets
    only its own."""
    a, b = tiny_model("mamba2"), tiny_model("mamba2")
    ra = rm.wire(a, rm.RingmasterConfig(size=P), device_mesh=ctx.mesh(P))
    rb = rm.wire(b, rm.RingmasterConfig(size=P), device_mesh=ctx.mesh(P))
    try:
        ca, cb = carrier_of(a), carrier_of(b)
        batch = packed_batch(a.config.vocab_size, [20, 12])
        with torch.no_grad(), context_parallel_region(batch, model=b, runtime=rb) as shard:
            held = (ca.current, cb.current is shard[BATCH_KWARG])
            b(**shard)
        return {"distinct": ca is not cb, "a_during_b": held[0], "b_during_b": held[1],
                "runtimes": (len(ra.carriers), len(rb.carriers))}
    finally:
        rm.unwire(a)
        rm.unwire(b)
        rm.teardown()
