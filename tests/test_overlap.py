"""Communication hidden behind compute: the p2p ring under injected link latency
(``ringmaster_tools.latency``), and the step-time model behind ``ringmaster plan`` / ``auto_select``.

The overlap assertions read the order of events (each hop issued, a block computed, the hop waited
for), which a loaded machine cannot disturb; one wall-time check uses a kernel that sleeps in place
of computing, with a generous margin. benchmarks/overlap.py measures the real thing."""

import jobs_overlap
import pytest

import ringmaster as rm
from ringmaster.config import auto_select
from ringmaster_tools.step_model import Hardware, Link, Shape, auto_select_modelled, predict, step_cost


def test_latency_is_hidden_and_results_unchanged(pool):
    X = 60.0  # ms per hop; the stand-in kernel "computes" 40 ms per block call
    results = pool.run(jobs_overlap.ring_under_latency, 2, X, compute_ms=40.0, reps=2)
    for res in results:
        assert res["probe_ok"] and res["sync_hop"] >= X / 1e3, res["sync_hop"]  # the injector delays
        assert res["same"], "the injected latency changed the output or a gradient"
        assert res["err"] < 1e-10, res["err"]   # async dK/dV: still exact against dense attention
        assert res["calls"] == 3                 # P=2: one K/V hop forward, one K/V + one dK/dV backward
        assert res["bare"] == [], res["events"]  # every hop in flight while a block computes
        # the latency windows covered by work: all but the first backward hop's 60 - 40 ms (89%)
        assert res["hidden"] >= 0.7, res["hidden"]
    # wall time: the slowest rank's step grows by far less than calls * X (no overlap: 180 ms)
    grown = max(res["t"] for res in results) - max(res["t0"] for res in results)
    assert grown < 0.5 * 3 * X / 1e3, (grown, [(res["t0"], res["t"]) for res in results])


def test_p2p_ring_at_four_ranks_overlaps_every_hop(pool):
    results = pool.run(jobs_overlap.ring_under_latency, 4, 2.0)
    for res in results:
        assert res["calls"] == 9 and res["bare"] == [], res["events"]
        assert res["same"] and res["err"] < 1e-10


def test_mutation_prefetch_disabled_is_caught(pool):
    """Waiting for every hop as soon as it is issued leaves no compute in flight: the check must fail."""
    results = pool.run(jobs_overlap.ring_without_prefetch, 2, 20.0)
    for res in results:
        assert res["err"] < 1e-10       # still exact: only the overlap is gone
        assert len(res["bare"]) == res["calls"] == 3, res["events"]
        assert res["hidden"] < 0.3, res["hidden"]  # nothing covers the latency any more


# ---- the step-time model (no ranks) ----

SHAPE = Shape(heads=8, kv_heads=4, head_dim=64, seq=2048, batch=1, dtype_bytes=4)


def _hw(latency_s, flops=20e9, bw=2e9):
    return Hardware(flops=flops, intra=Link(bw, latency_s))


def test_model_ring_hides_latency_below_block_compute():
    block = 2 * 4.0 * 8 * 512 ** 2 * 64 / 20e9            # forward compute of one ring step at P=2
    fast, slow = predict(SHAPE, _hw(0.0), 1, 2), predict(SHAPE, _hw(0.5 * block), 1, 2)
    assert fast.calls == slow.calls == 3
    assert slow.total == pytest.approx(slow.compute) and slow.hidden == pytest.approx(1.0)
    huge = predict(SHAPE, _hw(10 * block), 1, 2)            # latency far above compute: mostly exposed
    assert huge.total > huge.compute + 2 * 10 * block and huge.hidden < 0.5
    for u, r, rotate in ((2, 1, "alltoall"), (1, 2, "allgather")):  # collectives hide nothing
        p = predict(SHAPE, _hw(0.5 * block), u, r, rotate)
        assert p.total == pytest.approx(p.no_overlap) and p.hidden == pytest.approx(0.0, abs=1e-9)


def test_model_compute_matches_flops():
    p = predict(SHAPE, _hw(0.0, bw=1e30), 2, 1)   # Ulysses: H/2 heads over the whole causal sequence
    fwd = 4.0 * 4 * 64 * 2048 * 2049 / 2 / 20e9
    assert p.compute == pytest.approx(fwd * 3.5) and p.total == pytest.approx(p.compute)
    ring = predict(SHAPE, _hw(0.0, bw=1e30), 1, 2)  # head_tail: the causal work split evenly
    assert ring.compute == pytest.approx(4.0 * 8 * 64 * 2048 ** 2 / 2 / 2 / 20e9 * 3.5)


@pytest.mark.parametrize("heads, kv, world, per_node", [
    (32, 8, 8, 8), (32, 8, 16, 8), (32, 2, 8, 8), (32, 1, 8, 8), (12, 4, 8, 8)])
def test_without_link_figures_the_choice_is_todays(heads, kv, world, per_node):
    shape = Shape(heads, kv, 128, 65536)
    assert auto_select_modelled(shape, world, None, per_node) == auto_select(heads, kv, world, per_node)
    cfg = rm.RingmasterConfig(size=world).normalize(num_kv_heads=kv, intra_node_size=per_node, num_heads=heads)
    assert (cfg.ulysses_size, cfg.ring_size) == auto_select(heads, kv, world, per_node)


def test_with_link_figures_the_model_chooses():
    shape = Shape(32, 8, 128, 8192, dtype_bytes=2)
    # high latency per call, little compute: Ulysses' 4 collectives beat the ring's 3(P-1) hops
    slow = Hardware(flops=400e12, intra=Link(300e9, 2e-3))
    assert auto_select_modelled(shape, 8, slow, 8) == (8, 1)
    # a long sequence on a slow inter-node link: compute hides the ring hops, Ulysses' all-to-alls
    # across nodes are exposed, so the ring (p2p) takes the nodes
    long = Shape(32, 8, 128, 262144, dtype_bytes=2)
    two_nodes = Hardware(flops=400e12, intra=Link(300e9, 5e-6), inter=Link(5e9, 20e-6), ranks_per_node=8)
    u, r = auto_select_modelled(long, 16, two_nodes, 8)
    assert r > 1
    cost = step_cost(long, two_nodes)
    assert cost(u, r) == min(c for c in (cost(d, 16 // d) for d in (1, 2, 4, 8)) if c is not None)
    cfg = rm.RingmasterConfig(size=16).normalize(num_kv_heads=8, intra_node_size=8, num_heads=32, step_cost=cost)
    assert (cfg.ulysses_size, cfg.ring_size) == (u, r)


def test_plan_cli_with_link_figures(capsys):
    from ringmaster.cli import main

    assert main(["plan", "--heads", "32", "--kv-heads", "8", "--world", "16", "--seq", "131072",
                 "--hidden", "4096", "--tflops", "400", "--intra-gbps", "300", "--inter-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "by the step-time model" in out and "step ms/layer" in out
