"""Layouts and batch sharding: labels shifted before the cut, global positions, round trips."""

import pytest
import torch

from ringmaster.sharding import balancers
from ringmaster.shard import CP_SHARD_KEY, shard_collated_batch, shard_tensor, shift_labels


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("P", [2, 4])
def test_layouts_partition_the_sequence(layout, P):
    S = 16 * P
    held = torch.cat([balancers.shard_positions(S, P, r, layout) for r in range(P)])
    assert sorted(held.tolist()) == list(range(S))
    assert torch.equal(held, balancers.gathered_positions(S, P, layout))


def test_head_tail_balances_causal_work():
    assert balancers.work_figure(4096, 4, "head_tail") == pytest.approx(1.0, abs=1e-3)
    assert balancers.work_figure(4096, 4, "contiguous") > 1.7


def test_head_tail_chunks():
    x = torch.arange(16)[None]
    assert shard_tensor(x, 1, 0, 4, "head_tail").tolist() == [[0, 1, 14, 15]]
    assert shard_tensor(x, 1, 3, 4, "head_tail").tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_shard_collated_batch_shifts_before_cutting(layout):
    S, P = 16, 2
    ids = torch.arange(S)[None] + 100
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(1, S, dtype=torch.long),
             "pixel_values": torch.zeros(3, 5)}
    shards = [shard_collated_batch(batch, r, P, layout) for r in range(P)]
    targets = torch.cat([s["shift_labels"] for s in shards], dim=1)
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    order = balancers.gathered_positions(S, P, layout)
    assert torch.equal(positions[0], order)  # global positions travel with the tokens
    assert torch.equal(targets[0], shift_labels(ids)[0, order])  # the target of the last token of a shard is kept
    assert sum(int(s["shift_labels"].ne(-100).sum()) for s in shards) == S - 1
    for s in shards:
        assert "attention_mask" not in s  # all ones: the CP attention builds the mask globally
        assert s["pixel_values"] is batch["pixel_values"]  # non-sequence tensors pass through
        assert s[CP_SHARD_KEY]["layout"] == layout


def test_already_sharded_batch_is_refused():
    shard = shard_collated_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 0, 2)
    with pytest.raises(ValueError, match="already a CP shard"):
        shard_collated_batch(shard, 0, 2)
