"""The peers of `ringmaster bench`: bytes counted at the c10d op level (whoever issues the
collective), and each peer measured when importable, skipped with the reason otherwise."""

from __future__ import annotations

import importlib.util

from jobs_peers import c10d_count_job, peers_tiny_job


def test_c10d_counter_counts_known_collectives_exactly(pool):
    P = 2
    for seen, x, me in pool.run(c10d_count_job, P):
        a2a = x * (P - 1) // P
        root = {("broadcast", "forward"): x * (P - 1)} if me == 0 else {}   # only the root sends
        assert seen == {
            **root,
            ("all_to_all", "forward"): a2a + a2a + x,       # by-name import, functional autograd, permute
            ("all_gather", "forward"): x * (P - 1),
            ("send", "forward"): x,                          # batch_isend_irecv's isend
            ("all_to_all", "backward"): a2a,                 # the functional all-to-all's backward
        }, seen


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:
        return False


PEERS = ("torch cp alltoall", "deepspeed ulysses", "yunchang ulysses", "ring-flash-attn zigzag")
PACKAGE = {"deepspeed ulysses": "deepspeed", "yunchang ulysses": "yunchang", "ring-flash-attn zigzag": "ring_flash_attn"}


def test_peers_measured_when_importable_skipped_with_reason_otherwise(pool):
    """torch's context_parallel always runs (its CPU rules are ours): exact, and the bytes of its
    all-to-all ring (KV forward, KV + fp32 dK/dV at every step backward). The bench-extra peers run
    where installed, else their row says which package is missing and which extra installs it."""
    P, S, Hkv, D = 2, 64, 2, 8
    kv = 2 * Hkv * (S // P) * D * 4
    for res in (r for r in pool.run(peers_tiny_job, P, ("ringmaster ring p2p",) + PEERS) if r):
        # the CPU rules, the patched SDPA and the flash_attn stand-in do not outlive the benchmark
        assert not any(res["_left"].values()), res["_left"]
        cp = res["torch cp alltoall"]
        assert cp["status"] == "ok", cp
        assert cp["err"] < 1e-5
        assert (cp["fwd"], cp["bwd"]) == ((P - 1) * kv, (P - 1) * kv + P * kv)
        ours = res["ringmaster ring p2p"]
        assert ours["status"] == "ok" and ours["rm_fwd"] == ours["fwd"] and ours["rm_bwd"] == ours["bwd"]
        for name, package in PACKAGE.items():
            row = res[name]
            if _installed(package):
                assert row["status"] == "ok", row
                assert row["fwd"] > 0 and row["bwd"] > 0 and row["err"] == row["err"]  # measured, not NaN
            else:
                assert row["status"] == "skipped" and f"No module named '{package}'" in row["reason"], row
                assert "[bench]" in row["reason"]
