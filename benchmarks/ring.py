"""Ring attention on CPU gloo ranks: bytes, causal work balance and step time vs Ulysses.

    python benchmarks/ring.py [--seq 4096] [--heads 8] [--kv-heads 2] [--head-dim 64] [--sizes 2,4] [--reps 3]

At the attention-function level (one layer, causal, GQA, fp32), per rank:
  * bytes sent forward / backward, measured by rm.profile_comms, next to the closed forms
    p2p fwd = (P-1)*|KV_local|, p2p bwd = (P-1)*|KV_local| + (P-1)*|dKV_local (fp32)|,
    allgather fwd = (P-1)*|KV_local|, bwd = (P-1)*|dKV_local| (reduce-scatter),
    ulysses fwd = bwd = (2*Hq + 2*Hkv)*D*(S/P)*4 bytes*(P-1)/P (only when P divides the KV heads);
  * causal work (query-key pairs computed) as max/mean over ranks: head_tail must be ~1.0;
  * median fwd+bwd time as a ratio to Ring p2p head_tail, measured in the same run.
Times on a shared 2-core machine are noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _work(plan, P):
    from ringmaster.attention.ring.loop import block_pairs

    total = 0
    c = plan.chunk
    for src in range(P):
        for _, _, mask in block_pairs(plan, src, "cpu"):
            total += c * c if mask.full else int(mask.to_dense("cpu").sum())
    return total


def job(ctx, P, S, H, Hkv, D, reps):
    import torch
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.config import RingImpl
    from ringmaster.attention.ring.kernels import get_kernel
    from ringmaster_tools.bench import attention_system
    from ringmaster.attention.ring.loop import RingPlan, ring_attention

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(r)
    n = S // P
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (H, Hkv, Hkv))
    kernel = get_kernel(RingImpl.ATEN)

    methods = {}
    for name, layout, rotate in (("ring p2p head_tail", "head_tail", "alltoall"),
                                 ("ring p2p contiguous", "contiguous", "alltoall"),
                                 ("ring allgather head_tail", "head_tail", "allgather")):
        chunks = 2 if layout == "head_tail" else 1
        plan = RingPlan(layout, P, r, n // chunks)
        methods[name] = (lambda q, k, v, plan=plan, rotate=rotate:
                         ring_attention(q, k, v, group, plan, kernel, rotate=rotate), _work(plan, P))
    if H % P == 0 and Hkv % P == 0:  # every rank: H/P heads over the whole causal sequence
        methods["ulysses"] = (attention_system("ringmaster ulysses", group, P, r, S, H, Hkv, D, None)[1],
                              S * (S + 1) // 2)
    out = {}
    for name, (fn, work) in methods.items():
        times = []
        for i in range(reps + 1):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            dist.barrier(group=group)
            with rm.profile_comms() as comms:
                start = time.perf_counter()
                o = fn(*leaves)
                o.float().sum().backward()
                elapsed = time.perf_counter() - start
            if i:  # the first run warms up
                times.append(elapsed)
            fwd, bwd = comms.total_bytes(phase="forward"), comms.total_bytes(phase="backward")
        out[name] = {"fwd": fwd, "bwd": bwd, "time": statistics.median(times), "work": work}
    out["kv_local"] = 2 * k.numel() * k.element_size()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    print(f"causal attention, seq={args.seq} heads={args.heads} kv_heads={args.kv_heads} "
          f"head_dim={args.head_dim} fp32, one layer, per rank\n")
    header = (f"{'P':>2} {'method':<26} {'fwd sent':>10} {'fwd theory':>10} {'bwd sent':>10} {'bwd theory':>10} "
              f"{'work max/mean':>13} {'fwd+bwd s':>9} {'time ratio':>10}")
    print(header)
    print("-" * len(header))
    for P in (int(p) for p in args.sizes.split(",")):
        with LocalPool(P, init=torch_kernels_only) as pool:
            results = pool.run(job, P, args.seq, args.heads, args.kv_heads, args.head_dim, args.reps)
        kv = results[0]["kv_local"]
        base = max(res["ring p2p head_tail"]["time"] for res in results)
        theory = {"ring p2p head_tail": ((P - 1) * kv, 2 * (P - 1) * kv),
                  "ring p2p contiguous": ((P - 1) * kv, 2 * (P - 1) * kv),
                  "ring allgather head_tail": ((P - 1) * kv, (P - 1) * kv)}
        a2a = (2 * args.heads + 2 * args.kv_heads) * args.head_dim * (args.seq // P) * 4 * (P - 1) // P
        theory["ulysses"] = (a2a, a2a)
        for name in results[0]:
            if name == "kv_local":
                continue
            works = [res[name]["work"] for res in results]
            t = max(res[name]["time"] for res in results)  # a step waits for the slowest rank
            fwd, bwd = results[0][name]["fwd"], results[0][name]["bwd"]
            tf, tb = theory.get(name, (None, None))
            fmt = lambda b: f"{b / 2**20:7.2f} MiB" if b is not None else f"{'-':>10}"
            print(f"{P:>2} {name:<26} {fmt(fwd)} {fmt(tf)} {fmt(bwd)} {fmt(tb)} "
                  f"{max(works) / (sum(works) / len(works)):>13.3f} {t:>9.3f} {t / base:>10.2f}")


if __name__ == "__main__":
    main()
