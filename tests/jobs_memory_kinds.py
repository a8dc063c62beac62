"""What each decoder-layer part saves for backward, measured (memory_probe.saved_per_module), beside
the memory planner's per-kind formula (ringmaster_tools.memory_kinds): tests/test_memory_kinds.py and
benchmarks/memory_plan.py. Runs in one process (P=1) or on every rank of the pool (P>1)."""

from __future__ import annotations

import torch

import ringmaster as rm


def measure_saved(model_type: str, overrides: dict, seqs, P: int = 1, backend: str = "ulysses", mesh=None,
                  dtype: torch.dtype = torch.float32, cfg_kwargs: dict | None = None) -> list[dict]:
    """Per S: ``{"S", "parts": [(path, kind, measured bytes, predicted bytes, source)]}`` for every
    mixer, MLP and norm of every decoder layer, predicted by ``kind_model(kind).saved`` (torch kernel)."""
    from ringmaster_tools.memory_kinds import kind_model
    from ringmaster_tools.memory_kinds.attention import rope_width
    from ringmaster_tools.memory_kinds.layers import describe
    from ringmaster_tools.memory_probe import saved_per_module
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model(model_type, dtype=dtype, **overrides)
    layers = describe(model)
    parts = {p.path: p for layer in layers for p in layer.parts}
    if P > 1:
        rm.wire(model, rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {})), device_mesh=mesh)
    b = torch.empty((), dtype=dtype).element_size()
    vocab = model.config.get_text_config().vocab_size
    rope = rope_width(model)   # cos/sin: saved once, by the first attention layer
    rows = []
    try:
        for S in seqs:
            batch = tiny_batch(vocab, S)

            def forward():
                if P == 1:
                    return model(**batch).loss
                from ringmaster.adapters.raw import context_parallel_region

                with context_parallel_region(batch) as shard:
                    return model(**shard).loss

            measured, loss = saved_per_module({p: parts[p].module for p in parts}, forward)
            loss.backward()
            model.zero_grad(set_to_none=True)
            out = []
            first_attention = next((p for p in parts if parts[p].kind == "attention"), None)
            for path, part in parts.items():
                if part.kind == "norm":
                    per_token, fixed = part.dims[b]
                    pred, source = per_token * (S // P) + fixed, "traced on one or two tokens"
                else:
                    est = kind_model(part.kind).saved(part.dims, b, "torch", P, backend)
                    pred, source = est.at(S // P), est.source
                    if path == first_attention:
                        pred += rope * b * (S // P)
                out.append((path, part.kind, measured[path], pred, source))
            rows.append({"S": S, "parts": out, "other": measured[""]})
    finally:
        if P > 1:
            rm.unwire(model)
            rm.teardown()
    return rows


def measure_saved_job(ctx, model_type, overrides, seqs, P, backend="ulysses", dtype=torch.float32, cfg_kwargs=None):
    return measure_saved(model_type, overrides, seqs, P, backend, ctx.mesh(P) if P > 1 else None, dtype, cfg_kwargs)


def hybrid_families() -> list[str]:
    """Every registered family with a recurrent layer kind (the zoo's hybrid and recurrent families)."""
    from ringmaster.architectures.spec import _REGISTRY

    return sorted(mt for mt, spec in _REGISTRY.items() if spec.recurrent_classes)


def wired_and_planned_kinds(ctx, families: list[str]) -> dict[str, dict]:
    """This rank's share of ``families``: per decoder layer, the mixer kinds ``rm.wire`` wires on the
    tiny model (its report: attention paths and recurrent (path, kind)) and the kinds ``ringmaster plan
    --config`` reads from the same config on the meta device (``ModelShape.from_config``)."""
    from ringmaster_tools.memory_kinds.layers import decoder_layers
    from ringmaster_tools.memory_plan import ModelShape
    from ringmaster_tools.zoo import build_tiny, tiny_config

    out = {}
    for family in families[ctx.rank::ctx.world]:
        config = tiny_config(family)
        model = build_tiny(family, config=config, dtype=torch.float32)
        rt = rm.wire(model, rm.RingmasterConfig(size=1), device_mesh=ctx.mesh(1))
        try:
            wired = [(p, "attention") for p in rt.report.attention] + list(rt.report.recurrent)
            layers = [path for path, _ in decoder_layers(model)]
            per_layer = [sorted(k for p, k in wired if p.startswith(layer + ".")) for layer in layers]
        finally:
            rm.unwire(model)
            rm.teardown()
        shape = ModelShape.from_config(config)
        planned = [sorted(k for k, _ in parts if k not in ("norm", "mlp", "moe")) for parts in shape.layers]
        out[family] = {"wired": per_layer, "planned": planned, "labels": shape.layer_kinds,
                       "source": shape.layers_source}
    return out
