"""Jobs for tests/test_misc_families.py (run on every rank of the pool): the zoo families made exact by
the per-layer head split, repeated attention calls, the batch bridge and derived VLM towers, and the
mutations that show each mechanism is load-bearing."""

from __future__ import annotations

import dataclasses

import ringmaster as rm
from ringmaster_tools import zoo

# tiny configs on top of the zoo's shrink (zoo.tiny_config): fewer layers where the default is slow
OVERRIDES = {
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=2, L_cycles=2, num_hidden_layers=6),
    "deepseek_v4": dict(layer_types=["sliding_attention"] * 3),   # the CSA/HCA compressors are refused
}


def config_for(family: str, extra=None):
    return zoo.tiny_config(family, **{**OVERRIDES.get(family, {}), **(extra or {})})


def parity(ctx, family: str, cases, extra=None):
    """The zoo's verdicts for ``family`` (``{"ulysses2": {...}, ...}``) on this tiny config."""
    row = zoo.zoo_job(ctx, [family], tuple(cases), configs={family: config_for(family, extra)})[family]
    assert row["status"] == "scored", row
    return {k: v for k, v in row.items() if isinstance(v, dict) and "verdict" in v}


def _forward(ctx, model, P, backend="ulysses"):
    """One CP forward of a wired model: (error type, message, loss or None)."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import keep_fp64

    batch = zoo.zoo_batch(model.config.get_text_config().vocab_size, 32)
    try:
        with keep_fp64(), context_parallel_region(batch) as shard:
            out = model(**shard)
        return None, "forward returned", out.loss.item()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc), None


def wire_error(ctx, family: str, P=2, backend="ulysses", extra=None):
    model = zoo.build_tiny(family, config_for(family, extra))
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    finally:
        rm.unwire(model)
        rm.teardown()
    return None


def repeated_calls(ctx, family: str, P=2):
    """The ledger's per-module call counts after the first CP forward (modules called more than once)."""
    model = zoo.build_tiny(family, config_for(family))
    rt = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        kind, msg, loss = _forward(ctx, model, P)
        return kind, msg, dict(rt.binding.ledger.repeated)
    finally:
        rm.unwire(model)
        rm.teardown()


def without_bridge(ctx, family: str = "stablelm", P=2, backend="ulysses"):
    """Mutation: wire with the batch bridge switched off; the first CP forward must raise (before backward)."""
    from unittest import mock

    import ringmaster.wiring as wiring

    model = zoo.build_tiny(family, config_for(family))
    try:
        with mock.patch.object(wiring.bridge, "install", lambda model, paths: ([], [])):
            rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
        return _forward(ctx, model, P, backend)
    finally:
        rm.unwire(model)
        rm.teardown()


def bridged_report(ctx, family: str = "stablelm", P=2):
    model = zoo.build_tiny(family, config_for(family))
    try:
        rt = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
        bridged = list(rt.report.bridged)
    finally:
        rm.unwire(model)
        rm.teardown()
    left = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return bridged, left


def tower_after_text(ctx, P=2):
    """Mutation: declare a module that runs *after* the language model (lm_head) as a tower of
    moss_transcribe_diarize; the forward must raise naming it."""
    from ringmaster.architectures.spec import _REGISTRY

    family = "moss_transcribe_diarize"
    model = zoo.build_tiny(family, config_for(family))
    spec = rm.get_architecture(model)
    bad = dataclasses.replace(spec, vision_modules=spec.vision_modules + ("lm_head",))
    saved = _REGISTRY.get(family)
    rm.register_architecture(bad, override=True)
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
        return _forward(ctx, model, P)
    finally:
        _REGISTRY.pop(family, None)
        if saved is not None:
            _REGISTRY[family] = saved
        rm.unwire(model)
        rm.teardown()


# ---- batches that run the towers: an image (gemma3) / an audio clip (moss) whose 4 tokens straddle the
# P=4 shard edge at position 8 of 32
TOWER_CONFIGS = {
    "gemma3": dict(vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      image_size=32, patch_size=8), mm_tokens_per_image=4),
    "moss_transcribe_diarize": dict(audio_token_id=125, audio_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_mel_bins=80,
        max_source_positions=16)),   # Whisper-style: mel features of exactly 2 * 16 frames
}


def tower_batch(family: str, config, bidirectional: bool = False):
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 110, (1, 32), generator=g)
    if family == "gemma3":
        ids[0, 6:10] = config.image_token_index       # out of vocabulary: gemma3 embeds it as PAD
        extra = {"pixel_values": torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)}
        if bidirectional:
            extra["token_type_ids"] = (ids == config.image_token_index).long()
    else:
        ids[0, 6:10] = config.audio_token_id
        extra = {"input_features": torch.randn(1, 80, 32, generator=g, dtype=torch.float64),
                 "input_features_mask": torch.ones(1, 32, dtype=torch.long),
                 "padding_mask": torch.ones(1, 32, dtype=torch.long)}
    labels = ids.clone()
    labels[ids >= 120] = -100
    return {"input_ids": ids, "labels": labels, **extra}


def tower_parity(ctx, family: str, cases, bidirectional: bool = False):
    """The zoo's verdicts with the tower running on a real input (its gradients compared too)."""
    ctx.uses(P for _, P in cases)
    config = config_for(family, TOWER_CONFIGS[family])
    base = zoo.build_tiny(family, config)
    batch = tower_batch(family, config, bidirectional)
    return {f"{b}{P}": zoo.parity_case(ctx, family, base, batch, b, P) for b, P in cases if not ctx.repeats(P)}


def checkpointed_parity(ctx, family: str, cases):
    """The zoo's verdicts with gradient checkpointing on: the recomputed decoder layers run their hooks
    again (the bridge must carry the batch on recomputation too)."""
    ctx.uses(P for _, P in cases)
    config = config_for(family)
    base = zoo.build_tiny(family, config)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = zoo.zoo_batch(config.vocab_size, 32)
    return {f"{b}{P}": zoo.parity_case(ctx, family, base, batch, b, P) for b, P in cases if not ctx.repeats(P)}
