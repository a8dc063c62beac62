"""Packed rows and padding across CP ranks: exact against each document run alone."""

import jobs
import pytest
from test_ulysses_parity import TOL

# S=96: at P=4 the shard edges are 24/48/72, at P=2 48
LAYOUTS = {
    "spans-three-shards": [5, 67, 10, 14],     # doc 1 covers shards 0-2 at P=4; doc 2 starts on the edge 72
    "edge-aligned": [10, 38, 30, 18],          # boundary at 48: a shard edge at P=2 and P=4
}
BACKENDS = [
    ("ulysses", "ulysses", {}),
    ("ring-p2p-head_tail", "ring", dict(rotate_method="alltoall", load_balance="head_tail")),
    ("ring-allgather", "ring", dict(rotate_method="allgather", load_balance="none")),
]
FAMILIES = [
    ("llama-gqa", "llama", "sdpa", dict(num_attention_heads=8, num_key_value_heads=2)),
    ("mistral-window", "mistral", "sdpa", dict(sliding_window=16)),
    ("gpt-oss-eager", "gpt_oss", "eager", {}),
]


def _check(results):
    for r in results:
        assert r["loss_err"] <= TOL, r
        assert r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, (r["worst_param"], r["grad_err"])
        assert not r["missing_grads"]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_row_matches_documents_alone(pool, layout, backend, P):
    _, name, cfg_kwargs = backend
    _check(pool.run(jobs.packed_parity, P, LAYOUTS[layout], name, cfg_kwargs,
                    overrides=dict(num_attention_heads=8, num_key_value_heads=2)))


@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("backend", BACKENDS[:2], ids=[b[0] for b in BACKENDS[:2]])
def test_packed_families(pool, family, backend):
    _, model_type, attn, overrides = family
    _, name, cfg_kwargs = backend
    _check(pool.run(jobs.packed_parity, 4, LAYOUTS["spans-three-shards"], name, cfg_kwargs, model_type, attn,
                    overrides))


def test_packed_usp(pool):
    _check(pool.run(jobs.packed_parity, 4, LAYOUTS["edge-aligned"], "usp", dict(ulysses_size=2, ring_size=2),
                    overrides=dict(num_attention_heads=8, num_key_value_heads=2)))


@pytest.mark.parametrize("backend", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_document_a_never_changes_document_b(pool, backend):
    _, name, cfg_kwargs = backend
    for r in pool.run(jobs.document_isolation, 4, LAYOUTS["spans-three-shards"], name, cfg_kwargs):
        assert r["doc0_changed"], "the perturbation did not reach document 0"
        assert r["others_identical"], "document 0 leaked into later documents"


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_padding_is_never_attended_nor_counted(pool, backend, P):
    _, name, cfg_kwargs = backend
    for r in pool.run(jobs.padded_parity, P, name, cfg_kwargs):
        assert not r["nan"]
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= TOL, r
