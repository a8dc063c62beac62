"""Each layer kind's saved-for-backward bytes: the memory planner's formula
(ringmaster_tools.memory_kinds) against what the module's autograd graph saves, on CPU.

    python benchmarks/memory_kinds.py [--kinds gated_deltanet,mamba2] [--P 1,2] [--backend ulysses] [--seqs 128,256]

For each kind, its ``CASES`` (tiny random models, fp32 and bf16), every decoder-layer part of that
kind: measured bytes (``memory_probe.saved_per_module``, rank 0 at P > 1), predicted bytes
(``kind_model(kind).saved(dims, b, "torch", P, backend)``) and their ratio."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="attention,mlp,moe,gated_deltanet,kda,lightning,mamba2,mamba1,rglru,rwkv,"
                                           "mlstm,short_conv")
    parser.add_argument("--P", default="1,2")
    parser.add_argument("--backend", default="ulysses")
    parser.add_argument("--seqs", default="128,256")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--all-parts", action="store_true", help="print every part of the case's layers")
    args = parser.parse_args(argv)
    import jobs_memory_kinds
    import torch

    from ringmaster_tools.memory_kinds import kind_model
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    seqs = [int(s) for s in args.seqs.split(",")]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    pool = None
    worst = 1.0
    try:
        for kind in args.kinds.split(","):
            for model_type, overrides in kind_model(kind).CASES:
                for P in (int(p) for p in args.P.split(",")):
                    for dname in args.dtypes.split(","):
                        dt = dtypes[dname]
                        if P == 1:
                            rows = jobs_memory_kinds.measure_saved(model_type, overrides, seqs, dtype=dt)
                        else:
                            if pool is None:
                                pool = LocalPool(2, timeout=600, init=torch_kernels_only).__enter__()
                            rows = pool.run(jobs_memory_kinds.measure_saved_job, model_type, overrides, seqs, P,
                                            args.backend, dt)[0]
                        for r in rows:
                            for path, k, meas, pred, source in r["parts"]:
                                if k != kind and not args.all_parts:
                                    continue
                                ratio = pred / meas if meas else float("inf") if pred else 1.0
                                if k == kind:
                                    worst = max(worst, ratio, 1 / ratio if ratio else float("inf"))
                                print(f"{kind:<15} {model_type:<16} P={P} {dname:<4} S={r['S']:<6} {path:<32} "
                                      f"{k:<14} measured {meas:>10} predicted {pred:>12.0f} ratio {ratio:6.3f}",
                                      flush=True)
    finally:
        if pool is not None:
            pool.__exit__(None, None, None)
    print(f"worst ratio (either way): {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
