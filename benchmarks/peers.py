"""ringmaster vs the other context-parallel attentions on the same shapes.

    python benchmarks/peers.py [--seq 4096] [--heads 8] [--kv-heads 4] [--head-dim 64] [--sizes 2,4] [--reps 3]
    torchrun --nproc_per_node 4 benchmarks/peers.py ...      # the same on GPUs with NCCL

One causal GQA attention layer, forward + backward, fp32, batch 1, through:
  * ringmaster Ulysses (fused q/k/v all-to-all + SDPA), Ring p2p and Ring allgather (head_tail);
  * torch's native ``context_parallel`` (torch.distributed.tensor.experimental, SDPA);
  * DeepSpeed Ulysses (``deepspeed.sequence.layer.DistributedAttention``) and yunchang's
    ``UlyssesAttention`` when installed (KV heads expanded first where a peer needs equal heads);
  * a no-library baseline: all-gather K/V with torch.distributed.nn, then SDPA with a causal mask.
A system that is not installed or cannot run here is listed with the reason.

Per system and P: the max relative error of the output and dq/dk/dv against the
single-process reference, the bytes each rank sends forward and backward (every
torch.distributed call counted the same way, ringmaster.profiling.count_collectives: what the
backend really moves, e.g. gloo has no reduce-scatter and ringmaster falls back to all-reduce),
the bytes saved for backward per rank, and the median step time (slowest rank) as a ratio to
the fastest ringmaster system of the same run. Times on a shared CPU machine are noisy.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    from ringmaster.bench import PEER_CSV_FIELDS, is_main, make_pool, peers_table, run_peers, write_csv

    sizes = tuple(int(p) for p in args.sizes.split(","))
    with make_pool(max(sizes)) as pool:
        rows = run_peers(pool, sizes, args.seq, args.heads, args.kv_heads, args.head_dim, args.reps,
                         progress=not args.no_progress)
    if not is_main(pool):
        return
    print(peers_table(rows))
    if args.csv:
        write_csv(rows, args.csv, PEER_CSV_FIELDS)
        print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
