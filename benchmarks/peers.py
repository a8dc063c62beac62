"""ringmaster vs the other context-parallel attentions on the same shapes.

    python benchmarks/peers.py [--seq 4096] [--heads 8] [--kv-heads 4] [--head-dim 64] [--sizes 2,4] [--reps 3]
    torchrun --nproc_per_node 4 benchmarks/peers.py ...      # the same on GPUs with NCCL

One causal GQA attention layer, forward + backward, fp32, batch 1, through:
  * ringmaster Ulysses (fused q/k/v all-to-all + SDPA), Ring p2p, Ring allgather (head_tail) and
    Ring distflash;
  * the peers (``pip install -e ".[bench]"``; ringmaster_tools.peers makes them run on CPU gloo):
    DeepSpeed Ulysses (``deepspeed.sequence.layer.DistributedAttention``, as shipped); torch's
    native ``context_parallel`` with all-to-all and with all-gather rotation (CPU sharding rules
    for aten._scaled_dot_product_flash_attention_for_cpu, registered for the benchmark only, route
    to torch's own templated ring attention); ring-flash-attn's zigzag ring and yunchang's Ulysses
    and zigzag ring on the CPU flash stand-in (importable as ``flash_attn`` for their import only);
  * a no-library baseline: all-gather K/V with torch.distributed.nn, then SDPA with a causal mask.
A system that is not installed or cannot run here is listed with the reason.

Per system and P: the max relative error of the output and dq/dk/dv against the
single-process reference (a fast wrong answer shows here: ring-flash-attn's and yunchang's ring
backward alias their fp32 dq buffer), the bytes each rank sends forward and backward at the c10d
op level (ringmaster_tools.profiling.count_collectives: every collective, whoever issues it, functional
collectives included), ringmaster's own record next to it, the bytes saved for backward per
rank, and the median step time (slowest rank) as a ratio to the fastest ringmaster system of
the same class (Ulysses / ring). Times on a shared CPU machine are noisy; the stand-in kernel is
a Python-tiled test double, so rows with kernel "flash stand-in" time the kernel, not the library.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV (and the plot next to it, .png)")
    parser.add_argument("--systems", default=None, help="comma-separated subset of the systems (default: all)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    from ringmaster_tools.bench import (PEER_CSV_FIELDS, SYSTEMS, is_main, make_pool, peers_table, run_peers, write_csv,
                                  write_peers_png)

    sizes = tuple(int(p) for p in args.sizes.split(","))
    with make_pool(max(sizes)) as pool:
        rows = run_peers(pool, sizes, args.seq, args.heads, args.kv_heads, args.head_dim, args.reps,
                         systems=tuple(args.systems.split(",")) if args.systems else SYSTEMS,
                         progress=not args.no_progress)
    if not is_main(pool):
        return
    print(peers_table(rows))
    if args.csv:
        write_csv(rows, args.csv, PEER_CSV_FIELDS)
        print(f"\nwrote {args.csv}; " + write_peers_png(rows, os.path.splitext(args.csv)[0] + ".png"))


if __name__ == "__main__":
    main()
