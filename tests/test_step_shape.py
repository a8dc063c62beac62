"""Host syncs per CP training step equal (at most) the non-CP model's: every per-batch fact (documents,
masks, cuts, boundaries) is read on the host once, in the shard step (issue 26). Counted with
ringmaster_tools.profiling.count_host_syncs over one warm forward + backward, on every rank.

The models have two decoder blocks (step_shape.TWO_BLOCKS: one attention and, in the hybrids, one recurrent
block): the counts are per step, not per layer (measured: every row's plain and CP counts are the same with four
blocks), and a sync added per layer shows as one more than the model without CP on the dense and packed rows
either way. The model without CP is built and counted once per (model, batch), shared by the backends."""

import itertools

import jobs_step_shape
import pytest

from ringmaster_tools.step_shape import TWO_BLOCKS

MODELS = ["llama", "gdn-hybrid", "mamba2-hybrid"]
P2 = list(itertools.product(MODELS, ["ulysses", "ring-alltoall", "ring-allgather", "distflash"],
                            ["dense", "packed", "padded"]))
P4 = [(m, b, k) for m in MODELS for b, k in (("usp", "packed"), ("usp", "padded"), ("ring-alltoall", "packed"))]
# recurrent="heads": the hybrids' recurrent layers head-parallel, whole rows cut by the shard step's row pieces
P2 += [(m, b, k) for m in MODELS[1:] for b in ("ulysses-heads", "ring-heads") for k in ("dense", "packed", "padded")]


def _check(rows):
    bad = [r for r in rows if r["cp_all"] > r["plain_all"] or r["cp"] > r["plain"]]
    assert not bad, "\n".join(f"{r['case']}: CP {r['cp_all']} host syncs {r['cp_ops']} vs non-CP {r['plain_all']}"
                              for r in bad)


@pytest.mark.parametrize("size,cases", [(2, P2), (4, P4)], ids=["P2", "P4"])
def test_host_syncs_equal_non_cp(pool, size, cases):
    for rank_rows in pool.run(jobs_step_shape.grid, cases, size, overrides=TWO_BLOCKS):
        _check(rank_rows)


@pytest.mark.parametrize("mutation,case", [
    ("item_in_ring_loop", ("llama", "ring-alltoall", "packed")),
    ("runs_dropped", ("gdn-hybrid", "ring-allgather", "padded")),
])
def test_the_count_can_fail(pool, mutation, case):
    rows = pool.run(jobs_step_shape.grid, [case], 2, mutation=mutation, overrides=TWO_BLOCKS)[0]
    with pytest.raises(AssertionError, match="host syncs"):
        _check(rows)
