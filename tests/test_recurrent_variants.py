"""Short convolutions and the other gated-DeltaNet hybrids under CP, against the same model without CP.

Short convolutions (``short_conv`` kind: LFM2, LFM2-MoE, LFM3): the conv halo of the previous shard,
no tap across a document start; the attention layers run under Ulysses and Ring. Gated-DeltaNet
variants (``gated_deltanet`` kind with the family's kernel names): Lara-mini and OLMo-hybrid (Qwen3.5's
rule), Bailing-hybrid (Kimi delta attention: a per-channel decay), under ``scan`` and ``sequential``.

Every case checks the loss, the gathered logits and every parameter's gradient against its own norm
(float64 end to end under keep_fp64, bound 1e-5; see tests/test_hybrid_parity.py for why fp64), dense
rows, packed rows (each document run alone is the reference) and padded rows; fp32 runs check the loss
and the whole gradient. Mutations (the halo dropped, the carried state dropped, the document ids kept
from the short conv) must make the model-level check fail.
"""

import jobs_recurrent_variants as jv
import pytest
from test_hybrid_parity import FP64_PARAM_TOL, FP64_TOL, PARAM_TOL, TOL, TOTAL_TOL

SHORT_CONV = ["lfm2", "lfm2_moe", "lfm3"]
GDN = ["lara_mini", "olmo_hybrid", "bailing_hybrid"]
NEEDED = {"lfm2": ("conv.conv.weight", "conv.in_proj.weight"), "lfm2_moe": ("conv.conv.weight",),
          "lfm3": ("conv.conv.weight",), "lara_mini": ("A_log", "dt_bias", "conv1d.weight"),
          "olmo_hybrid": ("A_log", "dt_bias", "conv1d.weight"),
          "bailing_hybrid": ("forget_gate.A_log", "forget_gate.dt_bias", "conv1d.weight")}
MARGIN = 100


def check(results, model_type, P, fp64=True):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1 and r["attention_layers"] >= 1, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], r["missing_grads"]
        for needed in NEEDED[model_type]:
            assert any(needed in k for k in r["grad_errs"]), (needed, sorted(r["grad_errs"]))
        if fp64:
            assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
            worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
        else:
            assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
            assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])
            worst = {k: v for k, v in r["grad_errs"].items() if v > PARAM_TOL}
        assert not worst, (rank, worst)


def test_wired_kinds(pool):
    """Every conv / linear-attention layer of each family is wired, as the kind its spec names."""
    want = {"lfm2": ("short_conv", ["model.layers.0.conv", "model.layers.2.conv"]),
            "lfm3": ("short_conv", ["model.layers.0.conv"]),
            "lara_mini": ("gated_deltanet", ["model.layers.0.linear_attn"]),
            "bailing_hybrid": ("gated_deltanet", ["model.layers.0.self_attn", "model.layers.2.self_attn"]),
            # the decoder layer (OlmoHybridLinearAttentionDecoderLayer) matches the stateful-name pattern too:
            # only the innermost stateful module is judged, the container is not refused
            "olmo_hybrid": ("gated_deltanet", ["model.layers.0.linear_attn", "model.layers.2.linear_attn"])}
    for model_type, (kind, paths) in want.items():
        layers = pool.run(jv.wired_kinds, model_type)[0]
        assert layers == [(p, kind) for p in paths], (model_type, layers)


# lfm2 on the full backend x P grid; the other short-conv families (the same halo) Ulysses P=2 and Ring P=4
SHORT_CONV_CASES = [(m, P, b) for m in SHORT_CONV for b in ("ulysses", "ring") for P in (2, 4)
                    if m == "lfm2" or (b, P) in (("ulysses", 2), ("ring", 4))]


@pytest.mark.parametrize("model_type, P, backend", SHORT_CONV_CASES, ids=[f"{m}-{P}-{b}" for m, P, b in SHORT_CONV_CASES])
def test_short_conv_fp64(pool, model_type, P, backend):
    check(pool.run(jv.parity, model_type, P, "scan", backend), model_type, P)


# P=2 both strategies: the shared scan engine at P=4 is tests/test_hybrid_parity.py's fp64 cases (and the real
# kernels' tests/test_real_kernels.py); a family variant differs in its kernel names, not in the engine
@pytest.mark.parametrize("P, strategy", [(2, "sequential"), (2, "scan")])
@pytest.mark.parametrize("model_type", GDN)
def test_gated_delta_variants_fp64(pool, model_type, P, strategy):
    check(pool.run(jv.parity, model_type, P, strategy, "ulysses"), model_type, P)


@pytest.mark.parametrize("model_type", GDN)
def test_gated_delta_variants_ring_fp64(pool, model_type):
    check(pool.run(jv.parity, model_type, 4, "scan", "ring"), model_type, 4)


@pytest.mark.parametrize("case", [(2, "scan", False), (4, "sequential", True)], ids=["P2-scan", "P4-sequential-packed"])
@pytest.mark.parametrize("model_type", ["lfm3", "bailing_hybrid", "lara_mini"])
def test_ring_head_tail_fp64(pool, model_type, case):
    """Ring with the balanced ``head_tail`` layout (2P chunks, rank r holds r and 2P-1-r): the halo and
    the state of every chunk come from the chunk before it in sequence order, on another rank."""
    P, strategy, packed = case
    job = jv.packed_parity if packed else jv.parity
    results = pool.run(job, model_type, P, strategy, "ring", load_balance="head_tail")
    assert all(r["layout"] == "head_tail" for r in results), [r["layout"] for r in results]
    check(results, model_type, P)


@pytest.mark.parametrize("model_type", ["lfm3", "lara_mini"])
def test_usp_fp64(pool, model_type):
    check(pool.run(jv.parity, model_type, 4, "scan", "usp"), model_type, 4)


@pytest.mark.parametrize("model_type", SHORT_CONV + GDN)
def test_fp32_loss_and_whole_gradient(pool, model_type):
    check(pool.run(jv.parity, model_type, 4, "sequential", "ulysses", 96, False), model_type, 4, fp64=False)


@pytest.mark.parametrize("case", [(2, "ulysses", "sequential"), (2, "ring", "scan")], ids=["P2-ulysses", "P2-ring"])
@pytest.mark.parametrize("model_type", SHORT_CONV + GDN)
def test_packed_rows_fp64(pool, model_type, case):
    """Documents start mid-shard and on the P=2 / P=4 shard edges (32, 16, 48 of 64 tokens)."""
    P, backend, strategy = case
    check(pool.run(jv.packed_parity, model_type, P, strategy, backend), model_type, P)


@pytest.mark.parametrize("model_type,P", [("lfm2", 4), ("lara_mini", 2)])
def test_padded_rows_fp64(pool, model_type, P):
    for rank, r in enumerate(pool.run(jv.padded_parity, model_type, P)):
        print(model_type, P, rank, r)
        assert not r["nan"] and r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r)
        assert r["grad_err"] <= FP64_PARAM_TOL, (rank, r)   # the worst parameter, each against its own norm


MUTATIONS = [
    # mutation, job, args, parameter that must show the error
    ("conv_halo_dropped", "parity", ("lfm3", 4, "scan", "ulysses"), "conv.conv.weight"),
    ("conv_halo_dropped", "parity", ("lfm2", 2, "scan", "ring"), "conv.conv.weight"),
    ("short_conv_documents_dropped", "packed_parity", ("lfm2", 4, "scan", "ulysses"), "conv.conv.weight"),
    ("gated_delta_scan_state_dropped", "parity", ("bailing_hybrid", 2, "scan", "ulysses"), "forget_gate.A_log"),
    ("gated_delta_scan_state_dropped", "parity", ("lara_mini", 2, "scan", "ring"), "linear_attn.A_log"),
    ("received_state_dropped", "parity", ("bailing_hybrid", 2, "sequential", "ulysses"), "forget_gate.A_log"),
    ("received_state_dropped", "parity", ("olmo_hybrid", 2, "sequential", "ulysses"), "linear_attn.A_log"),
]


@pytest.mark.parametrize("case", MUTATIONS, ids=[f"{c[0]}-{c[2][0]}-P{c[2][1]}" for c in MUTATIONS])
def test_mutation_fails_fp64_parity(pool, case):
    mutation, job, args, param = case
    results = pool.run(jv.mutated, mutation, job, *args)
    for rank, out in enumerate(results):
        assert "raised" not in out, out["raised"]   # the model-level check must see it, not wire's probe
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if param in k}
        assert errs, (param, sorted(r["grad_errs"]))
        print(f"{mutation} {args} rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, {param} "
              f"{max(errs.values()):.2e}, logits {r['logits_err']:.2e}")
        assert max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
    check([out["clean"] for out in results], args[0], args[1])


INKLING = ["inkling_text", "inkling2_text", "inkling2_loop_text"]


# the dense P=4 row once (inkling2_text: the halo mutation's row below); every family's halo crosses a P=4 shard edge
# in its packed row too (edge 16 is mid-document), beside the edges at document starts (8, 24)
INKLING_CASES = [(m, c) for m in INKLING for c in ((2, "head_tail", None), (4, "contiguous", None),
                                                   (4, "contiguous", (5, 3, 16, 8)))
                 if c[1:] != ("contiguous", None) or m == "inkling2_text"]


@pytest.mark.parametrize("model_type, case", INKLING_CASES,
                         ids=[f"{m}-P{c[0]}{'-head_tail' if c[1] == 'head_tail' else ''}{'-packed' if c[2] else ''}"
                              for m, c in INKLING_CASES])
def test_inkling_short_convs_layer_by_layer(pool, model_type, case):
    """The Inkling families run whole in tests/test_relbias.py / tests/test_inkling2.py; here their short convs
    (k/v projections: narrower than the hidden size; the residual-stream ones) are exact on their own:
    every declared layer, output and every gradient, float64. Documents start mid-shard and on the P=4
    edge 8 (packed: no tap crosses a start)."""
    P, layout, docs = case
    for rank, layers in enumerate(pool.run(jv.short_conv_layers, model_type, P, layout, docs)):
        assert len(layers) >= 2, layers
        assert any(".sconv" in p or "k_sconv" in p for p in layers), sorted(layers)
        for path, errs in layers.items():
            assert max(errs.values()) <= 1e-12, (rank, path, errs)


@pytest.mark.parametrize("mutation,docs", [("conv_halo_dropped", None), ("short_conv_documents_dropped", (5, 3, 16, 8))])
def test_inkling_layer_check_catches_mutations(pool, mutation, docs):
    """Control of the layer-by-layer check: without the halo (or the document ids) every layer is wrong."""
    for rank, layers in enumerate(pool.run(jv.short_conv_layers_mutated, mutation, "inkling2_text", 4, "contiguous",
                                           docs)):
        worst = {p: max(e.values()) for p, e in layers.items()}
        print(mutation, rank, worst)
        assert min(worst.values()) >= 1e-3, (rank, worst)


def test_short_conv_guard_and_probe_width():
    """The per-call guard binds by the layer's own signature (Inkling2's short conv takes ``dynamic_input``
    second, where LFM's takes the cache): a cache under CP and a padding mask not cut like the shard raise;
    the probe's input width is the conv's for a layer without projections, else the hidden size."""
    from types import SimpleNamespace

    import torch
    from transformers.models.inkling2.modeling_inkling2 import Inkling2ShortConvolution
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    from ringmaster.recurrent.short_conv import _call_guard, probe_width
    from ringmaster_tools.parity import tiny_model

    ctx = SimpleNamespace(size=2, path="layer")
    lfm, ink = _call_guard(ctx, Lfm2ShortConv.forward), _call_guard(ctx, Inkling2ShortConvolution.forward)
    x = torch.zeros(1, 8, 16)
    ink((x, x), {"cache": None, "conv_mask": torch.ones(1, 8)})        # dynamic_input is not a cache
    lfm((x,), {"cache": None, "attention_mask": torch.ones(1, 8)})
    with pytest.raises(RuntimeError, match="cache under CP"):
        lfm((x, object()), {})
    with pytest.raises(RuntimeError, match="cache under CP"):
        ink((x, x), {"past_key_values": object()})
    with pytest.raises(ValueError, match="conv_mask"):
        ink((x,), {"conv_mask": torch.ones(1, 16)})
    with pytest.raises(ValueError, match="attention_mask"):
        lfm((x, None, torch.ones(1, 16)), {})
    assert probe_width(Inkling2ShortConvolution(24, 4, 0, 0), 64) == 24
    model = tiny_model("lfm2")
    assert probe_width(model.model.layers[0].conv, 64) == 64
