"""Ulysses over HF's flex_attention: the BlockMask built from the batch's global structure.

HF's flex path adds a tensor mask to the scores and applies no causal mask without one, so
before ringmaster passed a BlockMask the CP forward was silently non-causal (gathered logits
off by ~0.8 relative at P=2). flex_attention has no backward on CPU (torch 2.13), so the CP
runs here are forward-only (loss and gathered logits), against sdpa without CP.
"""

import itertools

import jobs_flex
import pytest
import torch

from ringmaster.sharding.documents import CPBatch, batch_documents, doc_ids_from_positions
from ringmaster.attention.flex import block_mask, build_block_mask

TOL = 1e-4


def materialize(bm, S: int) -> torch.Tensor:
    """Bool ``[B, H, S, S]``: what a flex kernel attends under ``bm``: every pair of a full tile,
    and the pairs of a partial tile where the mask_mod holds."""
    from torch.nn.attention.flex_attention import BlockMask

    Bq, Bk = bm.BLOCK_SIZE

    def expand(tiles):
        return tiles.repeat_interleave(Bq, -2).repeat_interleave(Bk, -1)[..., :S, :S].bool()

    tiles = expand(bm.to_dense())
    full = torch.zeros_like(tiles)
    if bm.full_kv_num_blocks is not None:
        full = expand(BlockMask.from_kv_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, BLOCK_SIZE=bm.BLOCK_SIZE,
                                               seq_lengths=(S, S)).to_dense())
    q = torch.arange(S)
    elem = torch.stack([torch.stack([bm.mask_mod(torch.tensor(b), torch.tensor(h), q[:, None], q[None, :])
                                     for h in range(tiles.shape[1])]) for b in range(tiles.shape[0])])
    return full | (tiles & elem)


def _docs(kind: str, S: int):
    if kind == "plain":
        return None
    if kind == "packed":  # B=1, documents crossing tile edges
        lens = [S // 3, 7, S - S // 3 - 7 - 5, 5]
        return doc_ids_from_positions(torch.cat([torch.arange(n) for n in lens])[None])
    if kind == "padded":  # B=2: row 0 left-padded, row 1 right-padded
        mask = torch.ones(2, S, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, S - S // 3:] = 0
        return batch_documents({"attention_mask": mask}, S)
    if kind == "packed2":  # B=2 packed rows
        pos = torch.stack([torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)]),
                           torch.cat([torch.arange(9), torch.arange(S - 9)])])
        return doc_ids_from_positions(pos)
    raise ValueError(kind)


@pytest.mark.parametrize("S,block", [(64, None), (64, 16), (300, None), (300, 64)])
@pytest.mark.parametrize("kind", ["plain", "packed", "padded", "packed2"])
def test_block_mask_equals_dense_mask(kind, S, block):
    docs = _docs(kind, S)
    for causal, window in itertools.product((True, False), (None, 1, 16, 130)):
        ref = CPBatch(0, 1, "contiguous", S, docs).dense_mask(causal, window, "cpu", materialize=True)
        bm = build_block_mask(S, causal, window, docs, "cpu", block_size=block)
        assert bm.shape[0] == (1 if docs is None else docs.shape[0])
        got = materialize(bm, S)
        assert got.shape[0] == ref.shape[0]
        assert torch.equal(got, ref.expand_as(got)), (kind, causal, window, (got != ref).sum().item())


def test_block_mask_skips_and_fills_tiles():
    """Causal over 3 tiles: tiles above the diagonal are skipped, those below are full (no mask_mod)."""
    bm = build_block_mask(300, True, None, None, "cpu")
    assert bm.kv_num_blocks.flatten().tolist() == [1, 1, 1]  # the diagonal tiles
    assert bm.full_kv_num_blocks.flatten().tolist() == [0, 1, 2]


def test_block_mask_cached_per_forward():
    cpb = CPBatch(0, 2, "contiguous", 64, _docs("packed", 64))
    a = block_mask(cpb, True, None, "cpu")
    assert block_mask(cpb, True, None, "cpu") is a
    assert block_mask(cpb, True, 16, "cpu") is not a


def check(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P
        assert r["attention_layers"] == 2, r
        assert r["a2a_bytes"] > 0, "the Ulysses all-to-all never ran"
        assert r["loss_err"] <= TOL, (rank, r)
        assert r["logits_err"] <= TOL, (rank, r)


CASES = [
    # id, model_type, overrides, kind
    ("llama-causal", "llama", dict(num_attention_heads=4, num_key_value_heads=4), "plain"),
    ("mistral-sliding16", "mistral", dict(sliding_window=16), "plain"),
    ("llama-packed", "llama", dict(num_attention_heads=4, num_key_value_heads=2), "packed"),
    ("llama-padded-b2", "llama", dict(num_attention_heads=4, num_key_value_heads=2), "padded"),
]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ulysses_flex_matches_single_device(pool, case, P):
    _, model_type, overrides, kind = case
    check(pool.run(jobs_flex.flex_forward_parity, P, model_type, overrides, kind), P)


def test_flex_wired_model_is_causal(pool):
    """P=1: changing the last token must not change any earlier position's logits."""
    for r in pool.run(jobs_flex.flex_causality, 1):
        assert r["last_diff"] > 0, "the last token's change did not reach its own logits"
        assert r["pos0_diff"] == 0.0 and r["earlier_diff"] == 0.0, r
