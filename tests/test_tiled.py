"""Ulysses over sdpa without an S x S mask (attention/tiled.py): the tiled calls equal one call with
the dense mask, never use SDPA's top-left ``is_causal`` on a non-square call, keep every mask small,
and the whole model stays exact at sequence lengths that span several tiles."""

import itertools

import jobs
import pytest
import torch
from test_ulysses_parity import TOL

from ringmaster.attention import tiled
from ringmaster.sharding.documents import CPBatch, batch_documents, doc_ids_from_positions


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _docs(kind: str, S: int):
    if kind == "plain":
        return None
    if kind == "packed":  # long and short documents, single tokens, a boundary mid-tile
        lens = [S // 3, 7, 3, 1, 2, S - S // 3 - 7 - 5 - 6, 5]
        return doc_ids_from_positions(torch.cat([torch.arange(n) for n in lens])[None])
    if kind == "padded":  # B=2: row 0 left-padded, row 1 right-padded (each pad token its own document)
        mask = torch.ones(2, S, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, S - S // 3:] = 0
        return batch_documents({"attention_mask": mask}, S)
    raise ValueError(kind)


GRID = [(kind, causal, window, tile) for kind, causal, window, tile in
        itertools.product(["plain", "packed", "padded"], [True, False], [None, 1, 16, 130], [16, 64])
        if not (kind == "plain" and window is None)]


@pytest.mark.parametrize("kind,causal,window,tile", GRID)
def test_tiled_sdpa_equals_dense_mask(kind, causal, window, tile):
    """Forward and every input gradient against HF's sdpa with the dense mask, GQA on (2 KV heads)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    S, B = 300, 2
    cpb = CPBatch(0, 1, "contiguous", S, _docs(kind, S))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    module = _Module()
    module.is_causal = causal
    ref = sdpa(module, q, k, v, cpb.dense_mask(causal, window, "cpu", materialize=True), is_causal=causal)[0]
    weight = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    out = tiled.tiled_attention(sdpa, module, q, k, v, cpb, causal, window, {"is_causal": causal}, tile=tile)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind,causal,window,tile", GRID)
def test_tile_plan_covers_queries_once_and_bounds_masks(kind, causal, window, tile):
    """Every query of every row is in exactly one call, calls without a mask are square (SDPA's
    top-left is_causal is then the right alignment), and masks are at most tile x (tile + 2w)."""
    S, B = 300, 2
    cpb = CPBatch(0, 1, "contiguous", S, _docs(kind, S))
    calls = tiled.plan(cpb, causal, window, B, tile)
    seen = torch.zeros(B, S, dtype=torch.int64)
    for c in calls:
        seen[c.r0:c.r1, c.q0:c.q1] += 1
        if not c.masked:
            assert (c.q0, c.q1) == (c.k0, c.k1), c
        else:
            assert c.q1 - c.q0 <= tile and c.k1 - c.k0 <= tile + 2 * (window or 0), c
    assert bool((seen == 1).all())
    for mask in tiled.masks(cpb, causal, window, B, "cpu", tile):
        assert mask is None or mask.shape[-2] * mask.shape[-1] <= tile * (tile + 2 * (window or 0))


# S=640 at P=2 and 4: every row spans several 256-token tiles, so the model-level checks run the
# tiled path as it runs in training (the shorter sequences of the other parity tests fit one tile)
LONG = 640


@pytest.mark.parametrize("P", [2, 4])
def test_ulysses_sdpa_window_across_tiles(pool, P):
    results = pool.run(jobs.parity, "mistral", P, "sdpa", dict(sliding_window=48), seq_len=LONG)
    for r in results:
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err"] <= TOL, (r["worst_param"], r)


@pytest.mark.parametrize("model_type,overrides", [("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
                                                  ("mistral", dict(sliding_window=48))], ids=["llama", "mistral"])
def test_ulysses_sdpa_packed_across_tiles(pool, model_type, overrides):
    """Long documents (one unmasked call each, or window tiles), runs of short ones batched in one call."""
    lens = [300, 5, 7, 1, 3, 9, 250, 40, 25]
    for r in pool.run(jobs.packed_parity, 2, lens, "ulysses", None, model_type, "sdpa", overrides):
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err"] <= TOL, (r["worst_param"], r)
        assert not r["missing_grads"]


def test_ulysses_sdpa_padded_across_tiles(pool):
    """B=2, rows with different structure (planned row by row); 200 padding tokens on row 1."""
    for r in pool.run(jobs.padded_parity, 2, S=LONG, left=37, real=403):
        assert not r["nan"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err"] <= TOL, r
