"""Mamba1 selective scans under CP (Mamba, FalconMamba, Jamba) and pure Mamba2 models.

Function level (single process): one sequence cut into shards (equal, uneven, tiny, the 2P chunks of
head_tail) runs through the same segment math the ranks run (local maps -> prefix in sequence order
-> outputs, or the sequential hand-over), against the float64 token-by-token reference and in fp32
with transformers' own torch kernel; packed rows against every document alone. Pool: the real
collectives (all-gather / p2p, forward and backward), then whole tiny models against the same model
without CP: per parameter in float64 (HF's torch kernels kept in fp64, bound 1e-5) at P=2 and P=4
under both strategies, loss / logits / whole gradient in fp32, packed and padded rows, Jamba's
attention under Ulysses and Ring, and mutations (carried state dropped, conv halo dropped) that the
fp64 check must catch.
"""

import jobs_mamba1 as jm1
import pytest
import torch

from ringmaster.recurrent.documents import DocumentSegment
from ringmaster.recurrent.scan import simulate_scan, simulate_sequential
from ringmaster.sharding.documents import Runs

SPLITS = {
    "whole": [0, 24],
    "equal4": [0, 6, 12, 18, 24],
    "uneven": [0, 1, 2, 9, 24],
    "head_tail4": [0, 3, 6, 9, 12, 15, 18, 21, 24],
    "single_tokens": list(range(0, 8)) + [24],
}
SHAPES = [dict(d=6, n=4), dict(d=3, n=7, gate=False)]


def run(kernel, inputs, bounds, strategy):
    segs = [jm1.segment(kernel, inputs, slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=-1)


def check_against_full(kernel, inputs, bounds, strategy, tol):
    ref_in, cp_in = jm1.leaves(inputs), jm1.leaves(inputs)
    y_ref = jm1.full_output(kernel, ref_in)
    y = run(kernel, cp_in, bounds, strategy)
    W = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(9), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()
    (y * W).sum().backward()
    assert jm1.rel(y, y_ref) <= tol, ("out", jm1.rel(y, y_ref))
    for name in inputs:
        err = jm1.rel(cp_in[name].grad, ref_in[name].grad)
        assert err <= tol, (name, err)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_mamba1_state_passing_exact_float64(shape, split, strategy):
    check_against_full("ref", jm1.mamba1_inputs(**shape), SPLITS[split], strategy, 1e-11)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["equal4", "uneven", "head_tail4"])
def test_mamba1_state_passing_with_transformers_kernel(split, strategy):
    """transformers' torch fallback (fp32 inside) on every chunk, the correction in fp32."""
    check_against_full("hf", jm1.mamba1_inputs(dtype=torch.float32), SPLITS[split], strategy, 2e-5)


def test_transformers_kernel_agrees_with_naive_reference():
    inputs = jm1.mamba1_inputs(dtype=torch.float32)
    ref = jm1.full_output("ref", {k: v.double() for k, v in inputs.items()})
    assert jm1.rel(jm1.full_output("hf", inputs), ref) < 1e-5


def test_slow_decay_state_really_crosses_shards():
    """Dropping the incoming state changes the outputs a lot, also on the last of many tiny shards."""
    inputs = jm1.mamba1_inputs()
    bounds = SPLITS["uneven"]
    segs = [jm1.segment("ref", inputs, slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    right = simulate_scan(segs)[-1]
    assert jm1.rel(segs[-1].run(None)[0], right) > 1e-2
    segs2 = [jm1.segment("ref", inputs, slice(a, b)) for a, b in ((0, 2), (2, 24))]
    assert jm1.rel(segs2[1].run(None)[0][..., -1], simulate_scan(segs2)[1][..., -1]) > 1e-4


def test_scan_never_divides_by_a_decay():
    """A decay that underflows to exactly 0 (fast channels over a long chunk) stays exact."""
    inputs = jm1.mamba1_inputs()
    inputs["A"] = inputs["A"].clone()
    inputs["A"][-1] = -1e4
    for strategy in ("scan", "sequential"):
        check_against_full("ref", inputs, SPLITS["uneven"], strategy, 1e-11)


def test_tiled_state_correction_matches_one_tile():
    """The correction runs in tiles recomputed in backward (no [b, d, l, n] decays held): values and every
    gradient equal the one-tile computation."""
    from ringmaster.recurrent.mamba1 import decayed_readout

    g = torch.Generator().manual_seed(3)
    b, d, n, l = 2, 5, 4, 23
    base = dict(cum_dt=torch.rand(b, d, l, generator=g, dtype=torch.float64).cumsum(-1),
                A=-torch.rand(d, n, generator=g, dtype=torch.float64), state=torch.randn(b, d, n, generator=g,
                                                                                         dtype=torch.float64),
                C=torch.randn(b, n, l, generator=g, dtype=torch.float64))
    outs, grads = [], []
    for tile in (5, 10**6):
        x = jm1.leaves(base)
        y = decayed_readout(x["cum_dt"], x["A"], x["state"], x["C"], tile=tile)
        (y * torch.linspace(-1, 1, l, dtype=torch.float64)).sum().backward()
        outs.append(y.detach())
        grads.append({k: v.grad for k, v in x.items()})
    assert jm1.rel(outs[0], outs[1]) < 1e-13
    for k in base:
        assert jm1.rel(grads[0][k], grads[1][k]) < 1e-13, k


DOCS = {
    "mid-shard": [[4, 9, 11]],
    "on-edges": [[6, 6, 12]],
    "spans-three": [[2, 15, 7]],
    "tiny-docs": [[1, 1, 3, 1, 2, 16]],
    "rows-differ": [[5, 19], [12, 1, 1, 1, 9]],
}


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["equal4", "head_tail4"])
@pytest.mark.parametrize("layout", sorted(DOCS))
def test_mamba1_resets_at_document_starts_float64(layout, split, strategy):
    """DocumentSegment over Mamba1 chunks (token dim last) vs every document alone; every input gradient."""
    docs = jm1.doc_ids(DOCS[layout])
    inputs = jm1.mamba1_inputs(b=docs.shape[0])
    ref_in, cp_in = jm1.leaves(inputs), jm1.leaves(inputs)
    y_ref = jm1.per_document_reference("ref", ref_in, docs)
    bounds = SPLITS[split]
    runs = Runs.from_doc_ids(docs)
    segs = [DocumentSegment(jm1.segment("ref", cp_in, slice(a, b)), runs.pattern(a, b), b - a)
            for a, b in zip(bounds, bounds[1:])]
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    y = torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=-1)
    W = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(9), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()
    (y * W).sum().backward()
    errs = {"out": jm1.rel(y, y_ref), **{k: jm1.rel(cp_in[k].grad, ref_in[k].grad) for k in inputs}}
    assert max(errs.values()) <= 1e-11, errs


# --------------------------------------------------------------------------- real collectives

POOL_CASES = [(2, "contiguous", "scan"), (2, "contiguous", "sequential"), (4, "contiguous", "scan"),
              (4, "contiguous", "sequential"), (2, "head_tail", "scan"), (4, "head_tail", "sequential")]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"P{c[0]}-{c[1]}-{c[2]}")
def test_mamba1_state_passing_collectives(pool, case):
    P, layout, strategy = case
    for rank, errs in enumerate(pool.run(jm1.state_passing, P, layout, strategy)):
        assert max(errs.values()) <= 1e-11, (rank, errs)


@pytest.mark.parametrize("case", [(4, "head_tail", "scan"), (2, "contiguous", "sequential")],
                         ids=lambda c: f"P{c[0]}-{c[1]}-{c[2]}")
def test_mamba1_resets_through_collectives(pool, case):
    P, layout, strategy = case
    for rows in (([2, 16, 6], [12, 1, 1, 10]), ([12, 6, 6],)):
        for rank, errs in enumerate(pool.run(jm1.state_passing, P, layout, strategy, rows=rows)):
            assert max(errs.values()) <= 1e-11, (rank, rows, errs)


def test_mamba1_collectives_with_transformers_kernel(pool):
    for strategy in ("scan", "sequential"):
        for rank, errs in enumerate(pool.run(jm1.state_passing, 4, "head_tail", strategy, kernel_name="hf", l=32)):
            assert max(errs.values()) <= 3e-5, (rank, strategy, errs)


# --------------------------------------------------------------------------- whole models

FAMILIES = ["mamba", "falcon_mamba", "jamba"]
FP64_PARAM_TOL = 1e-5
FP64_TOL = 1e-10
TOL = 1e-4            # fp32 loss and gathered logits
TOTAL_TOL = 2e-4      # fp32 whole gradient


def check_fp64(results, P, needed=jm1.NEEDED, tol=FP64_PARAM_TOL, every_param=True):
    """``every_param=False``: parameters the reference gives no gradient either may be absent (Zamba2: each
    shared block holds the LoRA adapters of every hybrid layer and uses the one of the layer calling it)."""
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert not r["missing_grads"], r["missing_grads"]
        assert r["n_grads"] == r["n_params"] or not every_param, (r["n_grads"], r["n_params"])
        for name in needed:
            assert any(name in k for k in r["grad_errs"]), (name, sorted(r["grad_errs"]))
        assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > tol}
        assert not worst, (rank, worst)


def check_fp32(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1 and not r["missing_grads"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
        assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])


def test_families_are_wired_as_mamba1(pool):
    expect = {"mamba": ("mamba1", 0), "falcon_mamba": ("mamba1", 0), "jamba": ("mamba1", 1), "mamba2": ("mamba2", 0)}
    for model_type, (kind, n_attention) in expect.items():
        r = pool.run(jm1.wire_report, model_type)[0]
        assert r["recurrent"] and {k for _, k in r["recurrent"]} == {kind}, (model_type, r)
        assert len(r["attention"]) == n_attention, (model_type, r)


# every family at P=2 under both strategies; the Mamba1 scan over four ranks once (mamba), the other families'
# mixers differing only in their norms and names
FAMILY_CASES = [(m, 2, s) for m in FAMILIES for s in ("scan", "sequential")] + [("mamba", 4, "scan"),
                                                                                ("mamba", 4, "sequential")]


@pytest.mark.parametrize("model_type, P, strategy", FAMILY_CASES)
def test_mamba1_family_exact_fp64(pool, model_type, P, strategy):
    """Per parameter in float64 (A_log, dt_proj.bias, conv1d.weight among them), Ulysses for Jamba's attention."""
    check_fp64(pool.run(jm1.family_parity, model_type, P, strategy, fp64=True), P)


@pytest.mark.parametrize("P", [2, 4])
def test_jamba_attention_under_ring_fp64(pool, P):
    """Jamba's attention layers under Ring (head_tail at P=4: the scan composes 2P chunk maps)."""
    cfg = dict(load_balance="head_tail") if P == 4 else None
    check_fp64(pool.run(jm1.family_parity, "jamba", P, "scan", "ring", fp64=True, cfg_kwargs=cfg), P)


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_gradient_checkpointing_replays_with_the_batch(pool, model_type):
    """Checkpointed blocks are replayed in backward without kwargs (MambaForCausalLM never passes any): the
    batch recorded by the wired model's pre-hook still reaches the mixers, and the result stays exact. fp32:
    keep_fp64's torch-function mode does not reach the recompute inside backward."""
    check_fp32(pool.run(jm1.family_parity, model_type, 2, "sequential", checkpointing=True), 2)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_mamba1_family_fp32_loss_and_whole_gradient(pool, model_type):
    for P, strategy in ((2, "sequential"), (4, "scan")):
        check_fp32(pool.run(jm1.family_parity, model_type, P, strategy), P)


@pytest.mark.parametrize("case", [("mamba", 4, "scan", "ulysses", None), ("falcon_mamba", 2, "sequential", "ulysses", None),
                                  ("jamba", 4, "sequential", "ring", dict(load_balance="head_tail")),
                                  ("jamba", 2, "scan", "ulysses", None)],
                         ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}-{c[3]}")
def test_mamba1_packed_rows_match_documents_alone(pool, case):
    """A packed row (a document over three shards, one starting on a shard edge) vs every document alone,
    in float64 per parameter."""
    model_type, P, strategy, backend, cfg = case
    check_fp64(pool.run(jm1.packed_parity, model_type, P, strategy, backend, cfg, fp64=True), P)


def test_mamba1_padding_never_leaks(pool):
    for r in pool.run(jm1.padded_parity, "mamba", 4, "scan"):
        assert not r["nan"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err_total"] <= TOTAL_TOL, r


# --------------------------------------------------------------------------- pure Mamba2

MAMBA2_NEEDED = ("A_log", "dt_bias", "conv1d.weight")


@pytest.mark.parametrize("case", [(2, "sequential"), (4, "scan")], ids=lambda c: f"P{c[0]}-{c[1]}")
def test_pure_mamba2_exact_fp64(pool, case):
    P, strategy = case
    check_fp64(pool.run(jm1.family_parity, "mamba2", P, strategy, fp64=True), P, MAMBA2_NEEDED)


def test_pure_mamba2_packed_rows(pool):
    check_fp64(pool.run(jm1.packed_parity, "mamba2", 4, "scan", fp64=True), 4, MAMBA2_NEEDED)


# --------------------------------------------------------------------------- mutations

MARGIN = 100
MUTATION_CASES = [
    # mutation, model_type, P, strategy, parameter that must show the error
    ("mamba1_state_not_passed", "mamba", 4, "scan", "mixer.A_log"),
    ("mamba1_state_not_passed", "jamba", 2, "sequential", "mamba.A_log"),
    ("conv_halo_dropped", "falcon_mamba", 4, "scan", "conv1d.weight"),
]


@pytest.mark.parametrize("case", MUTATION_CASES, ids=[f"{c[0]}-{c[1]}-P{c[2]}-{c[3]}" for c in MUTATION_CASES])
def test_mutation_fails_fp64_parity(pool, case):
    mutation, model_type, P, strategy, param = case
    results = pool.run(jm1.mutated_parity, mutation, model_type, P, strategy)
    for rank, out in enumerate(results):
        assert "raised" not in out, out["raised"]
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if param in k}
        assert errs, (param, sorted(r["grad_errs"]))
        print(f"{mutation} {model_type} P={P} {strategy} rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, "
              f"{param} {max(errs.values()):.2e}, logits {r['logits_err']:.2e}")
        assert max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
    check_fp64([out["clean"] for out in results], P)


def test_zeroed_incoming_state_is_caught_by_the_wire_probe(pool):
    """The segment itself ignoring its incoming state (scan and sequential) is refused by ``wire``'s probe
    before any CP step, naming the layer and the kernel."""
    results = pool.run(jm1.mutated_parity, "mamba1_state_zeroed", "mamba", 2, "scan")
    for out in results:
        assert "raised" in out and "mamba_selective_scan" in out["raised"], out.get("raised", out.get("mutated"))
        assert "backbone.layers.0.mixer" in out["raised"], out["raised"]
    check_fp64([out["clean"] for out in results], 2)


# --------------------------------------------------------------------------- Zamba / Zamba2: shared attention blocks

ZAMBA_NEEDED = {"zamba": ("A_log", "dt_proj_bias", "conv1d.weight", "shared_transf.self_attn.q_proj"),
                "zamba2": ("A_log", "dt_bias", "conv1d.weight", "linear_q_adapter_list")}
ZAMBA_CASES = [(model, P, strategy, backend, cfg) for model in ("zamba", "zamba2")
               for P, strategy, backend, cfg in ((2, "sequential", "ulysses", None), (2, "scan", "ulysses", None),
                                                 (4, "sequential", "ring", dict(load_balance="head_tail")))]


@pytest.mark.parametrize("case", ZAMBA_CASES, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}-{c[3]}")
def test_zamba_exact_fp64(pool, case):
    """A shared attention block (tied weights) called from two hybrid layers, Zamba2 with per-layer LoRA
    adapters on q/k/v and the MLP: the first-forward accounting accepts it, every parameter exact in fp64."""
    model_type, P, strategy, backend, cfg = case
    results = pool.run(jm1.family_parity, model_type, P, strategy, backend, fp64=True, cfg_kwargs=cfg)
    assert all(r["attention_layers"] == 2 for r in results), [r["attention_layers"] for r in results]
    check_fp64(results, P, ZAMBA_NEEDED[model_type], every_param=model_type != "zamba2")


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
def test_zamba_packed_rows(pool, model_type):
    check_fp64(pool.run(jm1.packed_parity, model_type, 4, "scan", fp64=True), 4, ZAMBA_NEEDED[model_type],
               every_param=model_type != "zamba2")


def test_zamba_mutation_fails_fp64_parity(pool):
    """Zamba runs one selective scan per mamba head: without state passing the fp64 check fails."""
    for out in pool.run(jm1.mutated_parity, "mamba1_state_not_passed", "zamba", 2, "scan"):
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if "A_log" in k}
        assert max(errs.values()) >= MARGIN * FP64_PARAM_TOL, errs
        check_fp64([out["clean"]], 2, ZAMBA_NEEDED["zamba"])
