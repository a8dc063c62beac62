"""Packed rows through recurrent layers: state and conv halo reset at every document start.

Function level (single process): a sequence cut into shards (and head_tail chunks) whose
documents start mid-shard, exactly on a shard edge, or span three shards, run through the
same segment math the ranks run (DocumentSegment over the layer's Segment; local maps ->
fp32 prefix -> outputs, or the sequential hand-over), against every document run alone with
the token-by-token references (float64) and transformers' torch kernels (fp32); outputs and
every input gradient. Pool: the real collectives at function level, then whole tiny Qwen3.5
and Nemotron-H models on a packed row against each document alone (loss, logits, gradients),
a negative control (without resets the state leak is far above the tolerance) and a
perturbation test (document A's tokens never change document B's logits).
"""

import jobs_recurrent as jr
import pytest
import torch

from standins import naive
from ringmaster.recurrent.conv import conv_with_documents, halos_from_tails
from ringmaster.recurrent.documents import DocumentSegment
from ringmaster.recurrent.scan import simulate_scan, simulate_sequential
from ringmaster.sharding.documents import Runs

L = 24
# shard edges of L=24: P=4 -> 6/12/18; head_tail P=4 -> every 3 tokens
SPLITS = {
    "P4": [0, 6, 12, 18, 24],
    "head_tail4": [0, 3, 6, 9, 12, 15, 18, 21, 24],
    "uneven": [0, 1, 2, 9, 24],                          # tiny shards: a document over several of them
}
DOCS = {
    "mid-shard": [[4, 9, 11]],                          # starts at 4 and 13: inside shards
    "on-edges": [[6, 6, 12]],                           # starts exactly at the shard edges 6, 12
    "spans-three": [[2, 15, 7]],                        # doc 1 covers tokens 2..16: shards 0, 1 and 2
    "tiny-docs": [[1, 1, 3, 1, 2, 16]],                 # several starts inside one shard, 1-token docs
    "rows-differ": [[5, 19], [12, 1, 1, 1, 9]],         # B=2, the second row with 1-token "padding" docs
}


def doc_ids(layout, B=None):
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in layout]
    for r in rows:
        assert r.numel() == L
    docs = torch.stack(rows)
    return docs if B is None else docs.expand(B, -1)


def per_document_reference(kind, kernel, inputs, docs, chunk_size):
    """Every document of every row run alone from a zero state."""
    rows = []
    for r in range(docs.shape[0]):
        row = {k: (v[r:r + 1] if k in jr.SEQ_KEYS[kind] else v) for k, v in inputs.items()}
        outs = []
        for d in docs[r].unique().tolist():
            idx = (docs[r] == d).nonzero().flatten()
            seg = jr.segment(kind, kernel, row, slice(int(idx[0]), int(idx[-1]) + 1), chunk_size)
            outs.append(seg.run(None)[0])
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0)


def cp_documents(kind, kernel, inputs, docs, bounds, strategy, chunk_size):
    segs, runs = [], Runs.from_doc_ids(docs)
    for a, b in zip(bounds, bounds[1:]):
        base = jr.segment(kind, kernel, inputs, slice(a, b), chunk_size)
        segs.append(DocumentSegment(base, runs.pattern(a, b), b - a))
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)


def check(kind, kernel, layout, split, strategy, chunk_size, tol, dtype=torch.float64):
    make = jr.mamba_inputs if kind == "mamba2" else jr.gdn_inputs
    docs = doc_ids(DOCS[layout])
    inputs = make(b=docs.shape[0], dtype=dtype)
    ref_in, cp_in = jr.leaves(inputs), jr.leaves(inputs)
    y_ref = per_document_reference(kind, kernel, ref_in, docs, chunk_size)
    y = cp_documents(kind, kernel, cp_in, docs, SPLITS[split], strategy, chunk_size)
    W = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(9), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()
    (y * W).sum().backward()
    errs = {"out": jr.rel(y, y_ref)}
    errs.update({name: jr.rel(cp_in[name].grad, ref_in[name].grad) for name in inputs})
    assert max(errs.values()) <= tol, errs
    return errs


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["P4", "head_tail4"])
@pytest.mark.parametrize("layout", sorted(DOCS))
@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
def test_resets_exact_float64(kind, layout, split, strategy):
    check(kind, "ref", layout, split, strategy, 5, 1e-11)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("layout", ["spans-three", "rows-differ"])
@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
def test_resets_with_transformers_kernels(kind, layout, strategy):
    check(kind, "hf", layout, "head_tail4", strategy, 4, 3e-5, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
def test_without_resets_the_state_leaks(kind):
    """Negative control: the plain segments (no DocumentSegment) on the same packed row are far off,
    on the documents that start on a shard edge and mid-shard alike."""
    make = jr.mamba_inputs if kind == "mamba2" else jr.gdn_inputs
    docs = doc_ids(DOCS["spans-three"])
    inputs = make(b=1)
    y_ref = per_document_reference(kind, "ref", inputs, docs, 5)
    bounds = SPLITS["P4"]
    segs = [jr.segment(kind, "ref", inputs, slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    leaky = torch.cat([o[0] if isinstance(o, tuple) else o for o in simulate_scan(segs)], dim=1)
    assert jr.rel(leaky[:, 17:], y_ref[:, 17:]) > 1e-2   # doc 2 starts mid-shard at 17
    assert jr.rel(leaky[:, 2:6], y_ref[:, 2:6]) > 1e-2    # doc 1 starts mid-shard at 2, inside shard 0


@pytest.mark.parametrize("kernel_size", [2, 4])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", sorted(DOCS))
def test_conv_taps_never_cross_a_document_start(layout, split, kernel_size):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    docs = doc_ids(DOCS[layout])
    inputs = jr.conv_inputs(b=docs.shape[0], k=kernel_size)
    x, w, bias = inputs["x"], inputs["weight"], inputs["bias"]
    ref = torch.zeros_like(x)
    for r in range(docs.shape[0]):
        for d in docs[r].unique().tolist():
            idx = (docs[r] == d).nonzero().flatten()
            ref[r:r + 1, :, idx] = naive.causal_conv1d(x[r:r + 1, :, idx], w, bias, "silu")
    bounds = SPLITS[split]
    chunks = [x[..., a:b] for a, b in zip(bounds, bounds[1:])]
    width = kernel_size - 1
    tails = [torch.nn.functional.pad(c[..., -width:], (max(0, width - c.shape[-1]), 0)) for c in chunks]
    halos = halos_from_tails(tails, [c.shape[-1] for c in chunks], width)
    runs = Runs.from_doc_ids(docs)
    for kernel in (naive.causal_conv1d_ref, causal_conv1d_fn):
        out = torch.cat([conv_with_documents(kernel, c, h, docs, a, w, bias, "silu", runs=runs)
                         for c, h, a in zip(chunks, halos, bounds)], dim=-1)
        assert jr.rel(out, ref) < 1e-12, (kernel, jr.rel(out, ref))


# --------------------------------------------------------------------------- real collectives

POOL_CASES = [(2, "contiguous", "scan"), (4, "contiguous", "sequential"), (4, "head_tail", "scan"),
              (2, "head_tail", "sequential")]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"P{c[0]}-{c[1]}-{c[2]}")
def test_resets_through_collectives(pool, case):
    """pass_state / cp_causal_conv1d with document ids on every rank vs each document alone (float64)."""
    P, layout, strategy = case
    for rank, errs in enumerate(pool.run(jr.packed_function_level, P, layout, strategy)):
        assert max(errs.values()) <= 1e-11, (rank, errs)


# --------------------------------------------------------------------------- whole models

TOTAL_TOL = 2e-4      # whole gradient, relative max-norm (as test_hybrid_parity)
PARAM_TOL = 1e-2      # every parameter
TOL = 1e-4            # loss and gathered logits

# S=96: shard edges 24/48/72 at P=4 and 48 at P=2 (head_tail P=4: every 12 tokens)
PACKINGS = {
    "spans-three-shards": [5, 67, 10, 14],     # doc 1 covers 5..71 (shards 0-2 at P=4); doc 2 starts on edge 72
    "edge-aligned": [10, 38, 30, 18],          # boundary at 48: a shard edge at P=2 and P=4
}
# the grid: both models x P=2/4 x Ulysses/Ring x scan/sequential; Ring runs head_tail (one case
# contiguous), and the packings alternate so every cell has a document over several shards and
# one boundary on a shard edge (spans-three-shards at P=4 also has a start on the edge 72)
MODEL_CASES = [
    (model, P, backend, dict(load_balance="head_tail") if backend == "ring" else {}, strategy,
     "spans-three-shards" if (P == 4) == (backend == "ulysses") else "edge-aligned")
    for model in ("qwen3_5_text", "nemotron_h") for P in (2, 4) for backend in ("ulysses", "ring")
    for strategy in ("scan", "sequential")
] + [("nemotron_h", 4, "ring", dict(load_balance="none"), "scan", "spans-three-shards")]


def _case_id(c):
    return f"{c[0]}-P{c[1]}-{c[2]}{'-' + c[3]['load_balance'] if c[3] else ''}-{c[4]}-{c[5]}"


@pytest.mark.parametrize("case", MODEL_CASES, ids=_case_id)
def test_packed_hybrid_matches_documents_alone(pool, case):
    model_type, P, backend, cfg_kwargs, strategy, packing = case
    results = pool.run(jr.packed_hybrid_parity, model_type, P, strategy, backend, cfg_kwargs, PACKINGS[packing])
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], r["missing_grads"]
        assert r["loss_err"] <= TOL, (rank, r["loss_err"])
        assert r["logits_err"] <= TOL, (rank, r["logits_err"])
        assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > PARAM_TOL}
        assert not worst, (rank, worst)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_document_ids_reach_mixers_called_without_kwargs(pool, model_type):
    """The mixer gets no ``ringmaster_batch`` kwarg: the decoder layer's pre-hook supplies the ids."""
    results = pool.run(jr.packed_hybrid_parity, model_type, 4, "sequential", "ring", dict(load_balance="head_tail"),
                       PACKINGS["spans-three-shards"], strip_kwarg=True)
    for rank, r in enumerate(results):
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
        assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_packed_hybrid_negative_control(pool, model_type):
    """Without the document resets in the recurrent layers (attention still packed-exact) the same
    comparison fails by far more than its tolerance: the grid above is not vacuous."""
    for r in pool.run(jr.packed_hybrid_without_resets, model_type, 4, PACKINGS["spans-three-shards"]):
        assert r["logits_err"] > 100 * TOL, r


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_document_a_never_changes_document_b_through_recurrent_layers(pool, model_type):
    for r in pool.run(jr.packed_hybrid_isolation, model_type, 4, PACKINGS["spans-three-shards"]):
        assert r["doc0_changed"], "the perturbation did not reach document 0"
        assert r["others_identical"], "document 0 leaked into later documents"


@pytest.mark.parametrize("case", [("qwen3_5_text", 4, "ulysses", "scan"), ("nemotron_h", 2, "ulysses", "sequential")],
                         ids=lambda c: f"{c[0]}-P{c[1]}-{c[3]}")
def test_padding_never_leaks_into_the_next_real_token(pool, case):
    """B=2, one row left- and right-padded: padding tokens are documents of their own."""
    model_type, P, backend, strategy = case
    for r in pool.run(jr.padded_hybrid_parity, model_type, P, strategy, backend):
        assert not r["nan"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, r
        assert r["grad_err_total"] <= TOTAL_TOL, r
