"""The shape of one CP training step on CPU gloo ranks: host syncs per step and per-block fullgraph compile.

    python benchmarks/step_shape.py [--models llama,gdn-hybrid,mamba2-hybrid] [--backends ulysses,...]
                                    [--batches dense,packed,padded] [--no-compile | --no-syncs]
                                    [--compiler inductor] [--out step_shape]

Per (model, backend, batch), on every rank (tiny 4-layer models, fp32; P=2, USP 2x2 at P=4):
  * host syncs over one warm forward + backward (``ringmaster_tools.profiling.count_host_syncs``: scalar reads,
    ``nonzero``/boolean indexing/``bincount``/``unique``, ``tolist``/``numpy``), the model without CP next to
    the same model wired for CP; the shard step (once per batch, from the full batch on the host) apart;
  * every decoder block compiled with ``torch.compile(block, fullgraph=True)`` after ``rm.wire`` (``--compiler``,
    inductor by default), compared on the second CP step (the first runs eagerly: its one-time accounting):
    whether it compiles, graph breaks, and loss / gathered-logit / worst-gradient error against the
    model without CP (each relative to its own norm).
Prints a markdown table and writes <out>.csv. The worst rank is reported.
"""

from __future__ import annotations

import argparse
import csv
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,gdn-hybrid,mamba2-hybrid")
    parser.add_argument("--backends", default="ulysses,ring-alltoall,ring-allgather,distflash,usp")
    parser.add_argument("--batches", default="dense,packed,padded")
    parser.add_argument("--no-compile", action="store_true", help="host syncs only")
    parser.add_argument("--no-syncs", action="store_true", help="compile only")
    parser.add_argument("--compiler", default="inductor",
                        help="torch.compile backend for the blocks (aot_eager_decomp_partition: inductor's "
                             "forward/backward graphs and partitioner without its CPU code generation)")
    parser.add_argument("--out", default="step_shape")
    args = parser.parse_args()

    from ringmaster_tools.pool import LocalPool, torch_kernels_only
    from ringmaster_tools import step_shape

    rows = []
    pool = LocalPool(4, timeout=1800, init=torch_kernels_only)
    try:
        for model in args.models.split(","):
            for backend in args.backends.split(","):
                size = 4 if backend == "usp" else 2
                for batch in args.batches.split(","):
                    t0 = time.time()
                    row = {"model": model, "backend": backend, "batch": batch, "P": size}
                    if not args.no_syncs:
                        syncs = pool.run(step_shape.host_syncs, model, backend, batch, size)
                        row.update(syncs_plain=max(r["plain_all"] for r in syncs),
                                   syncs_cp=max(r["cp_all"] for r in syncs),
                                   syncs_shard=max(r["shard"] for r in syncs))
                    if not args.no_compile:
                        try:
                            res = pool.run(step_shape.compile_parity, model, backend, batch, size,
                                           compiler=args.compiler)
                            row.update(compiles="yes", graph_breaks=max(r["graph_breaks"] for r in res),
                                       graphs=max(r["graphs"] for r in res),
                                       loss_err=max(r["loss"] for r in res), logit_err=max(r["logits"] for r in res),
                                       grad_err=max((r["grad"] for r in res if r["grad"] is not None), default=None))
                        except Exception as exc:  # a block that does not compile: the row says where
                            row.update(compiles="no: " + str(exc).strip().splitlines()[-1][:120])
                            if pool.broken:   # a rank failed: the next row gets fresh ranks
                                pool.close()
                                pool = LocalPool(4, timeout=1800, init=torch_kernels_only)
                    row["seconds"] = round(time.time() - t0, 1)
                    rows.append(row)
                    print(row, flush=True)
    finally:
        pool.close()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(f"{args.out}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.1e}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys)
              + " |")


if __name__ == "__main__":
    main()
