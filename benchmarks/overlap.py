"""Is communication hidden behind compute? Step time vs injected link latency, and the step-time model.

    python benchmarks/overlap.py [--seq 2048] [--heads 8] [--kv-heads 4] [--head-dim 64] [--sizes 2,4]
                                 [--latency-ms 0,2,5,10,20] [--reps 3]

One causal GQA attention layer, fp32, forward + backward, on CPU gloo ranks (1 thread each), through
Ring p2p (head_tail), Ring allgather (head_tail), Ulysses and USP (2x2 at P=4). Every p2p exchange
and collective is delayed by X ms (``ringmaster_tools.latency.inject_latency``: a hop's ``wait()``
returns no earlier than X after it was issued; a collective sleeps X after it ran). Per row:

* ``calls``: p2p exchanges + collectives a rank issued in one step (counted by the injector);
* ``step s``: median over reps of the slowest rank's step;
* ``no-overlap s``: the step at X=0 plus ``calls * X``, what the step would cost if no hop overlapped;
* ``hidden``: ``1 - growth / (calls * X)``, the share of the injected latency the schedule hid, where
  ``growth`` is the median over reps of ``step(X) - step(0)`` within a rep (the reps run every X in
  turn, so a drifting machine load cancels); the p2p ring should hide most of it while X is below the
  block compute printed above the table (the forward compute of one ring step; a backward step
  computes several times longer);
* ``hidden (schedule)``: ``1 - exposed / (calls * X)``, where ``exposed`` (the injector's
  ``Links.exposed_s``, the rank with the most) is, summed over calls, the part of each call's latency
  window ``[issue, issue + X]`` left after the rank began waiting for it (a collective: all of X): the
  share the schedule covered with work. A peer's lag does not enter it, so it holds on a loaded machine
  where the step-time difference is noise; the ``hidden (step)`` column confirms it on a quiet one.
  ``model hidden``: the step model's share;
* ``model s`` / ``err``: ``ringmaster_tools.step_model.predict`` with the link's bandwidth measured (one
  exchange of a K/V block), its latency set to X, the backward/forward factor of the block kernel
  measured here (every rank times one full block at once, so the cores are shared as in the run), and
  the compute rate fitted per system on its X=0 row ("fit": the block rate alone, printed above the
  table, misses the merge, packing and scheduling costs); the X > 0 rows check how the model charges
  and overlaps the latency;
* ``same``: the output equals the X=0 output bit for bit (the delay changes no result).

The slowest rank's step at X=0 is mostly compute. On a loaded 2-core machine P=4 shares two cores
between four ranks, so read ``hidden`` and the model error, not the absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _systems(ctx, P, S, H, Hkv, D):
    import torch.distributed as dist

    from ringmaster.attention.ring.kernels import get_kernel
    from ringmaster.attention.ring.loop import RingPlan, ring_attention
    from ringmaster.attention.ring.select import resolve_ring_impl
    from ringmaster.attention.ulysses import head_to_seq, seq_to_head
    from ringmaster_tools.bench import attention_system
    from ringmaster.config import RingImpl
    from ringmaster.mesh import split_usp_groups

    mesh = ctx.mesh(P)
    group = mesh["cp"].get_group()
    r = dist.get_rank(group)
    kernel = get_kernel(resolve_ring_impl(RingImpl.AUTO, "sdpa"))
    plan = RingPlan("head_tail", P, r, S // (2 * P))
    out = {
        "ring p2p": ((1, P, "alltoall"), lambda q, k, v: ring_attention(q, k, v, group, plan, kernel, "alltoall")),
        "ring allgather": ((1, P, "allgather"),
                           lambda q, k, v: ring_attention(q, k, v, group, plan, kernel, "allgather")),
        "ulysses": ((P, 1, "alltoall"), attention_system("ringmaster ulysses", group, P, r, S, H, Hkv, D, None)[1]),
    }
    if P == 4:  # USP 2x2: Ulysses over pairs of ranks, a contiguous Ring over the pairs (attention/usp.py)
        ug, rg = split_usp_groups(mesh, "cp", group, 2, 2)
        rplan = RingPlan("contiguous", 2, dist.get_rank(rg), S // 2)

        def usp(q, k, v):
            qh, kh, vh = seq_to_head([q, k, v], ug)
            o = ring_attention(qh, kh, vh, rg, rplan, kernel, "alltoall")
            return head_to_seq(o.transpose(1, 2), ug).transpose(1, 2)

        out["usp 2x2"] = ((2, 2, "alltoall"), usp)
    return group, kernel, out


def _calibrate(group, kernel, P, S, H, Hkv, D, reps=5):
    """(forward FLOP/s, backward/forward ratio, link bytes/s) measured on every rank at once."""
    import torch
    import torch.distributed as dist

    from ringmaster.attention.ring.loop import _Ring

    c = S // (2 * P)
    g = torch.Generator().manual_seed(dist.get_rank(group))
    q, k, v, dout = (torch.randn(1, h, c, D, generator=g) for h in (H, Hkv, Hkv, H))
    scale = D ** -0.5
    fwd, bwd = [], []
    for _ in range(reps + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        o, lse = kernel.forward(q, k, v, scale, None)
        t1 = time.perf_counter()
        kernel.backward(dout, q, k, v, o, lse, scale, None)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    t_fwd, t_bwd = statistics.median(fwd[1:]), statistics.median(bwd[1:])
    kv = torch.randn(2, 1, Hkv, S // P, D)
    ring, hops = _Ring(group), []
    for _ in range(reps + 1):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        ring.wait(ring.start(kv, "forward", "calibrate"))
        hops.append(time.perf_counter() - t0)
    bw = kv.numel() * kv.element_size() / statistics.median(hops[1:])
    return 4.0 * H * c * c * D / t_fwd, t_bwd / t_fwd, bw


def job(ctx, P, S, H, Hkv, D, latencies, reps):
    import torch
    import torch.distributed as dist

    from ringmaster_tools.latency import inject_latency

    group, kernel, systems = _systems(ctx, P, S, H, Hkv, D)
    flops, bwd_factor, bw = _calibrate(group, kernel, P, S, H, Hkv, D)
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(r)
    n = S // P
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (H, Hkv, Hkv))
    def step(fn, X):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        dist.barrier(group=group)
        with inject_latency(p2p_ms=X, collective_ms=X) as links:
            start = time.perf_counter()
            o = fn(*leaves)
            o.sum().backward()
            elapsed = time.perf_counter() - start
        result = torch.cat([o.detach().flatten()] + [t.grad.flatten() for t in leaves])
        return (elapsed, links.exposed_s), links.p2p_ops + links.collective_ops, result

    rows = {}
    for name, (split, fn) in systems.items():
        _, _, ref = step(fn, 0.0)  # warm-up, and the reference result
        for X in latencies:
            rows[(name, X)] = dict(split=split, times=[], calls=0, same=True)
        # rep-major, the latencies in alternating order: a machine whose load drifts shifts every X of a
        # rep alike, and the per-rep differences step(X) - step(0) cancel it
        for i in range(reps):
            for X in (latencies if i % 2 == 0 else latencies[::-1]):
                elapsed, calls, result = step(fn, X)  # elapsed: (wall s, injected s not covered by work)
                row = rows[(name, X)]
                row["times"].append(elapsed)
                row["calls"] = calls
                row["same"] = row["same"] and torch.equal(result, ref)
    return dict(rows=rows, flops=flops, bwd_factor=bwd_factor, bw=bw)


def table(P, S, H, Hkv, D, results, latencies) -> list[str]:
    from ringmaster_tools.step_model import Hardware, Link, Shape, predict

    rows0 = results[0]["rows"]
    flops = statistics.median(res["flops"] for res in results)
    bwd_factor = statistics.median(res["bwd_factor"] for res in results)
    bw = statistics.median(res["bw"] for res in results)
    shape = Shape(H, Hkv, D, S, 1, 4)
    block_ms = 2 * 4.0 * H * (S // (2 * P)) ** 2 * D / flops * 1e3  # one ring step forward: two full pairs
    lines = [f"P={P}: kernel {flops / 1e9:.1f} GFLOP/s forward per rank, backward x{bwd_factor:.2f}, "
             f"link {bw / 1e9:.2f} GB/s; ring p2p block compute (one step forward) {block_ms:.1f} ms"]
    fits = []
    for name in dict.fromkeys(n for n, _ in rows0):
        base = None
        u, r, rotate = rows0[(name, latencies[0])]["split"]
        # a step waits for its slowest rank: per rep, the max over ranks (wall time; exposed latency)
        slowest, exposed = ({X: [max(res["rows"][(name, X)]["times"][i][j] for res in results)
                                 for i in range(len(rows0[(name, X)]["times"]))] for X in latencies}
                            for j in (0, 1))
        for X in latencies:
            t = statistics.median(slowest[X])
            grown = statistics.median(a - b for a, b in zip(slowest[X], slowest[latencies[0]]))
            uncovered = statistics.median(exposed[X])
            calls = max(res["rows"][(name, X)]["calls"] for res in results)
            same = all(res["rows"][(name, X)]["same"] for res in results)
            if base is None:
                base = t
                # the model's compute rate for this system: the block kernel's, rescaled so that the
                # X=0 step matches (merge, packing and the runtime's share of two cores are in it); the
                # rows with X > 0 then check how the model charges and overlaps the latency
                rate = flops
                for _ in range(20):
                    rate *= predict(shape, Hardware(rate, Link(bw, 0.0), bwd_factor=bwd_factor), u, r, rotate).total / t
                first = predict(shape, Hardware(flops, Link(bw, 0.0), bwd_factor=bwd_factor), u, r, rotate).total
                fits.append(f"{name}: {rate / 1e9:.1f} GFLOP/s effective (the block rate alone predicts "
                            f"{first:.3f} s at X=0, measured {t:.3f} s)")
            no_overlap = base + calls * X / 1e3
            hidden = (1 - grown / (calls * X / 1e3)) if X else float("nan")
            hidden_w = (1 - uncovered / (calls * X / 1e3)) if X else float("nan")
            pred = predict(shape, Hardware(rate, Link(bw, X / 1e3), bwd_factor=bwd_factor), u, r, rotate)
            err = f"{pred.total / t - 1:+.0%}" if X else "fit"
            lines.append(f"| {P} | {name} | {X:g} | {calls} | {t:.3f} | {no_overlap:.3f} | "
                         f"{'-' if X == 0 else f'{hidden:.0%}'} | {'-' if X == 0 else f'{hidden_w:.0%}'} | "
                         f"{'-' if X == 0 else f'{pred.hidden:.0%}'} | {pred.total:.3f} | {err} | "
                         f"{'yes' if same else 'NO'} |")
    lines[0] += "\n  " + "\n  ".join(fits)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--latency-ms", default="0,2,5,10,20")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    latencies = [float(x) for x in args.latency_ms.split(",")]
    if latencies[0] != 0:
        latencies = [0.0] + latencies

    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    print(f"causal attention, seq={args.seq} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
          f"fp32, one layer, forward + backward, slowest rank, median of {args.reps}\n")
    out = ["| P | system | X ms | calls | step s | no-overlap s | hidden (step) | hidden (schedule) | model hidden "
           "| model s | model err | same |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    start = time.perf_counter()
    for P in (int(p) for p in args.sizes.split(",")):
        with LocalPool(P, init=torch_kernels_only) as pool:
            results = pool.run(job, P, args.seq, args.heads, args.kv_heads, args.head_dim, latencies, args.reps)
        lines = table(P, args.seq, args.heads, args.kv_heads, args.head_dim, results, latencies)
        notes.append(lines[0])
        out.extend(lines[1:])
    print("\n".join(notes + [""] + out))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
