"""Compiled training over many packings: graphs per block, recompiles, exactness and work, CPU gloo ranks.

    python benchmarks/compile.py [--models llama,gdn-hybrid,mamba2-hybrid] [--backends ulysses,...]
                                 [--batches dense,packed,padded,documents] [--steps 50] [--compiler eager]
                                 [--size 2] [--dynamic] [--flash]

Per (model, backend, batch), on every rank (two-block tiny models, fp32, S=64; P=2, USP 2x2 at P=4): every decoder
block compiled with ``torch.compile(block, fullgraph=True)`` before the first CP step, then ``--steps`` steps,
each a new random packing (1 to 6 documents; ``many``: 12 to 20; ``padded``: new left and right padding; ``documents``:
``load_balance="documents"`` on packed rows; ``dense``: new tokens), forward and backward
(``ringmaster_tools.packings.over_packings``, dynamo's recompile limit raised so that a path which recompiles
shows how often): graphs compiled after 1, 5 and all steps (rank 0; `graphs_end_ranks`: every rank), graphs compiled after the fifth (with dynamo's
default limit of 8 per block, more than 8 graphs fail under ``fullgraph=True``), the worst loss error of any step and the worst gradient error
(first and last step) against the model without CP, the attention work issued (query-key pairs, forward) compiled
vs eager on the packed steps after the first (whose one-time checks replay it eagerly), and the CPU step time compiled vs eager (median of the steps after the fifth;
``--compiler eager`` measures dynamo's graphs, not inductor's code). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

BACKENDS = ("ulysses", "ring-alltoall", "ring-allgather", "distflash", "usp")
# each backend's configuration under load_balance="documents" (ringmaster_tools.step_shape.BACKENDS)
DOCUMENTS = {"ulysses": "ulysses-documents", "ring-alltoall": "ring-documents",
             "ring-allgather": "ring-allgather-documents", "usp": "usp-documents"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,gdn-hybrid,mamba2-hybrid")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--batches", default="dense,packed,padded,documents")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compiler", default="eager", help="torch.compile backend of the blocks")
    parser.add_argument("--size", type=int, default=2, help="CP size of every backend but USP (2x2 at 4)")
    parser.add_argument("--dynamic", action="store_true", help="compile the blocks with dynamic=True")
    parser.add_argument("--flash", action="store_true",
                        help="name the CP model's attention flash_attention_2: the hub flash kernel (the ring's "
                             "blocks, Ulysses' inner attention), here ringmaster's CPU stand-in (tests/standins) "
                             "through kernels' LOCAL_KERNELS; the reference without CP stays on sdpa")
    args = parser.parse_args()
    prepare = None
    if args.flash:   # before the pool starts: its ranks inherit LOCAL_KERNELS
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from jobs_ring import as_flash_model
        from standins.flash_repos import local_kernels

        os.environ["LOCAL_KERNELS"] = local_kernels(os.environ.get("LOCAL_KERNELS"))
        prepare = partial(as_flash_model, name="flash_attention_2")

    from ringmaster_tools import packings
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    rows = []
    pool = LocalPool(4, timeout=3600, init=torch_kernels_only)
    try:
        for model in args.models.split(","):
            for backend in args.backends.split(","):
                for batch in args.batches.split(","):
                    name = backend
                    if batch == "documents":   # load_balance="documents" (distflash is a load balance of its own)
                        if backend not in DOCUMENTS:
                            continue
                        name = DOCUMENTS[backend]
                    size = 4 if backend == "usp" else args.size
                    t0 = time.time()
                    row = {"model": model, "backend": name, "batch": batch, "P": size}
                    try:
                        c = pool.run(packings.over_packings, model, name, batch, args.steps, size=size,
                                     compiler=args.compiler, dynamic=True if args.dynamic else None, prepare=prepare)
                        e = pool.run(packings.over_packings, model, name, batch, args.steps, size=size, eager=True,
                                     prepare=prepare)
                    except Exception as exc:   # a rank raised: the row says where
                        row["error"] = str(exc).strip().splitlines()[-1][:100]
                        if pool.broken:
                            pool.close()
                            pool = LocalPool(4, timeout=3600, init=torch_kernels_only)
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    g = c[0]["graphs"]
                    n = len(g)
                    # after the first step (its one-time checks replay it eagerly)
                    packed = [i for i in range(1, min(n, len(e[0]["pairs"]))) if c[0]["pairs"][i] or e[0]["pairs"][i]]
                    work = [(max(r["pairs"][i] for r in c), max(r["pairs"][i] for r in e)) for i in packed
                            if any(r["pairs"][i] for r in c)]
                    tc = statistics.median(max(r["seconds"][i] for r in c) for i in range(5, n)) if n > 5 else None
                    te = statistics.median(max(r["seconds"][i] for r in e) for i in range(5, n)) if n > 5 else None
                    row.update(graphs_1=g[0], graphs_5=g[min(4, n - 1)], graphs_end=g[-1],
                               graphs_end_ranks="/".join(str(r["graphs"][-1]) for r in c), steps=n,
                               after_warmup=g[-1] - g[min(4, n - 1)],
                               loss_err=max(max(r["loss"]) for r in c),
                               grad_err=max((max(r["grad"]) for r in c if r["grad"]), default=None),
                               work_equal=all(a == b for a, b in work) if work else "n/a",
                               step_ms_compiled=None if tc is None else round(1e3 * tc, 1),
                               step_ms_eager=None if te is None else round(1e3 * te, 1),
                               seconds=round(time.time() - t0, 1))
                    rows.append(row)
                    print(row, flush=True)
    finally:
        pool.close()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.1e}" if k.endswith("_err") and isinstance(r.get(k), float)
                                else str(r.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
