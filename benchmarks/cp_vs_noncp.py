"""Peak memory and step time per rank, CP at P=2/4 vs the same model without CP.

    python benchmarks/cp_vs_noncp.py [--models llama,qwen3_5-hybrid] [--sizes 1,2,4] [--start-seq 512]
                                     [--max-seq 16384] [--time-budget 20] [--mem-budget-gib 4]
                                     [--total-budget 900] [--reps 2] [--out cp_vs_noncp]
    torchrun --nproc_per_node 4 benchmarks/cp_vs_noncp.py ...      # the same on GPUs with NCCL

Models: a small Llama (4 layers, hidden 256, 8 heads over 4 KV heads) and a Qwen3.5-style
hybrid (3 gated-DeltaNet layers + 1 attention layer, same width), random weights, fp32.
For each model and P the sequence length doubles from --start-seq until one training step
(forward + backward with the loss) takes longer than --time-budget seconds, a rank's memory
exceeds --mem-budget-gib, --max-seq is passed or --total-budget seconds have gone.

Per configuration: the step time (median of --reps after a warm-up, slowest rank), the bytes
saved for backward per rank (saved-tensor hooks) and the peak memory per rank: on CPU the rise
of the process RSS high-water mark over the step, on GPU the CUDA allocator peak. The loss
column is the mean over the CP ranks, equal to the non-CP loss. Writes <out>.csv and, when
matplotlib is installed, <out>.png (memory and step time vs sequence length, one line per
model x P). On CPU every rank is one process with one thread: P ranks use P cores, and on a
machine with fewer cores than ranks the CP step times include the oversubscription.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,qwen3_5-hybrid")
    parser.add_argument("--sizes", default="1,2,4", help="CP sizes; 1 is the non-CP reference")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--start-seq", type=int, default=512)
    parser.add_argument("--max-seq", type=int, default=16384)
    parser.add_argument("--time-budget", type=float, default=20.0, help="seconds per step before a config stops")
    parser.add_argument("--mem-budget-gib", type=float, default=4.0, help="GiB per rank before a config stops")
    parser.add_argument("--total-budget", type=float, default=900.0, help="seconds for the whole run")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default="cp_vs_noncp", help="path prefix of the .csv and .png")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    from ringmaster_tools.bench import MODELS, cp_table, is_main, make_pool, run_cp_vs_noncp, write_csv, write_png

    models = {name: MODELS[name] for name in args.models.split(",")}
    sizes = tuple(int(p) for p in args.sizes.split(","))
    with make_pool(max(sizes)) as pool:
        rows = run_cp_vs_noncp(pool, models, sizes, args.start_seq, args.max_seq, args.time_budget,
                               args.mem_budget_gib * 2**30, args.total_budget, args.reps, args.backend,
                               progress=not args.no_progress)
    if not is_main(pool):
        return
    print(f"one training step (fwd+bwd with loss), fp32, batch 1, {pool.world} ranks; "
          "ratios vs non-CP (P=1) at the same length\n")
    print(cp_table(rows))
    write_csv(rows, args.out + ".csv")
    print(f"\nwrote {args.out}.csv; {write_png(rows, args.out + '.png')}")


if __name__ == "__main__":
    main()
