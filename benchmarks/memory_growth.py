"""Per-rank memory of one CP step as S doubles, every backend x mask kind (CPU gloo ranks).

    python benchmarks/memory_growth.py [--sizes 1024,2048,4096] [--rows ulysses-sdpa-window,...]

The same rows and measurement as tests/test_memory.py (which asserts growth <= 2.15 per doubling):
``profiling.track_tensor_memory`` counts the bytes of tensors alive at once during one forward +
backward on each rank (gradients allocated before, so the parameter/gradient baseline is not
counted) and the largest single tensor created. Linear in S doubles; a quadratic term (an S x S mask,
an S_local x S_local block) shows as growth toward 4x. Also prints the causal work balance
(max/mean per rank) of the three ring layouts, from the schedules the ring runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,2048,4096")
    parser.add_argument("--rows", default="", help="comma-separated row ids (default: every row)")
    args = parser.parse_args()

    from standins.flash_repos import local_kernels

    # the hub flash rows run ringmaster's CPU stand-in (a CPU benchmark: never the real kernel)
    os.environ["LOCAL_KERNELS"] = local_kernels(os.environ.get("LOCAL_KERNELS"))
    import jobs_memory
    import test_memory

    from ringmaster.sharding.balancers import schedule_work
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    print("causal work max/mean per rank (diagonal block counted as half a block)")
    print(f"{'P':>3} {'contiguous':>11} {'head_tail':>10} {'distflash':>10}")
    for P in (2, 4, 8, 16):
        figs = [schedule_work(P, layout).max_over_mean for layout in ("contiguous", "head_tail", "distflash")]
        print(f"{P:>3} " + " ".join(f"{f:>10.3f}" for f in figs))

    sizes = tuple(int(s) for s in args.sizes.split(","))
    wanted = set(filter(None, args.rows.split(",")))
    rows = [r for r in test_memory.ROWS if not wanted or r[0] in wanted]
    print(f"\nper-rank memory of one CP step (rank 0), S = {sizes} (flex: halved; forward only)")
    print(f"{'row':<24} {'peak MiB per S':<30} {'growth':<14} {'largest tensor MiB':<26} {'growth':<12}")
    with LocalPool(4, timeout=600, init=torch_kernels_only) as pool:
        for row_id, backend, P, kind, cfg, attn, backward, _ in rows:
            row_sizes = tuple(s // 2 for s in sizes) if attn == "flex_attention" else sizes
            res = pool.run(jobs_memory.peak_growth, P, backend, kind, row_sizes, attn=attn, cfg_kwargs=cfg,
                           backward=backward)[0]
            peak = [r["peak"] / 2**20 for r in res]
            big = [r["largest"] / 2**20 for r in res]
            grow = lambda xs: "x" + "/".join(f"{b / a:.2f}" for a, b in zip(xs, xs[1:]))  # noqa: E731
            print(f"{row_id:<24} {' '.join(f'{p:.1f}' for p in peak):<30} {grow(peak):<14} "
                  f"{' '.join(f'{b:.2f}' for b in big):<26} {grow(big):<12}", flush=True)


if __name__ == "__main__":
    main()
