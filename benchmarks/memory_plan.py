"""The memory planner (``ringmaster plan --config``) against measured peak memory, on CPU.

    python benchmarks/memory_plan.py [--models tiny,deep,gdn,mamba2,mamba1,moe,100m] [--quick]

Random models (fixed seed; tests/jobs_plan.py MODELS): llama "tiny" (0.6M parameters), "deep" and
"100m" (87M); "gdn" (Qwen3.5-style, 3 gated-DeltaNet : 1 attention layer), "mamba2" (Nemotron-H:
Mamba2, attention, MLP-only, Mamba2), "mamba1" (Falcon-Mamba), "moe" (Qwen3-MoE, 8 experts, top-2).
Every layer kind runs transformers' pure-torch kernels (the CPU path), so the plan uses
``kernel="torch"``. One AdamW training step after a warm-up step, grads set to None before it as a
training loop leaves them. Measured = bytes alive before the step (parameters + AdamW state) + the peak of tensor
bytes created and alive at once during forward + backward + optimizer step
(``profiling.track_tensor_memory(skip_aliases=True)``; at P=2 the rank that holds the most). Predicted =
``memory_plan.plan(...).total`` for the same shapes (no master weights, for-loop AdamW as on CPU).
The bf16 rows cast the model (and so AdamW's state) to bf16: their static part is the measured one,
the peak above it is predicted. P=1 runs in this process, P=2 on two CPU gloo ranks (Ulysses and Ring).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

# (model, P, backend, loss, checkpointing, sequence lengths[, dtype])
ROWS = [
    ("tiny", 1, "none", "full", "none", (256, 1024, 4096)),
    ("tiny", 1, "none", "chunked", "none", (1024, 4096)),
    ("tiny", 1, "none", "full", "full", (1024, 4096)),
    ("tiny", 2, "ulysses", "full", "none", (1024, 4096)),
    ("tiny", 2, "ring", "full", "none", (1024, 4096)),
    ("deep", 1, "none", "full", "none", (1024, 4096)),
    ("deep", 1, "none", "full", "full", (4096,)),
    ("deep", 2, "ulysses", "full", "none", (4096,)),
    ("deep", 2, "ring", "full", "none", (4096,)),
    ("tiny", 1, "none", "full", "none", (2048,), "bf16"),
    ("deep", 1, "none", "full", "none", (2048,), "bf16"),
    ("deep", 1, "none", "full", "full", (2048,), "bf16"),
    ("deep", 2, "ring", "full", "none", (4096,), "bf16"),
    # every layer kind the planner models beside attention: a gated-DeltaNet hybrid (3:1), a Nemotron-H
    # (Mamba2, attention, MLP only, Mamba2), a Mamba1 model, an MoE model (8 experts, top-2)
    # (the pure-torch recurrent kernels loop over chunks, Mamba1's over tokens: S up to 2048, 1024 for
    # Mamba1, keeps the run in minutes)
    *[row for name, S in (("gdn", 2048), ("mamba2", 2048), ("mamba1", 1024), ("moe", 2048)) for row in (
        (name, 1, "none", "full", "none", (S // 4, S)),
        (name, 1, "none", "full", "full", (S,)),
        (name, 2, "ulysses", "full", "none", (S,)),
        (name, 2, "ring", "full", "none", (S,)),
        (name, 2, "ulysses", "full", "full", (S,)),
        (name, 1, "none", "full", "none", (S // 2,), "bf16"),
        (name, 1, "none", "full", "full", (S // 2,), "bf16"),
        (name, 2, "ring", "full", "none", (S,), "bf16"),
    )],
    ("100m", 1, "none", "full", "none", (256, 1024)),
    ("100m", 2, "ulysses", "full", "none", (2048,)),
    ("100m", 2, "ring", "full", "none", (2048,)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,deep,gdn,mamba2,mamba1,moe,100m")
    parser.add_argument("--quick", action="store_true", help="tiny and deep rows only")
    args = parser.parse_args()
    import jobs_plan
    import torch

    from ringmaster_tools.memory_plan import ModelShape, PlanOptions, plan
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    wanted = set(args.models.split(","))
    if args.quick:
        wanted = {"tiny", "deep"}
    rows = [r for r in ROWS if r[0] in wanted]
    print(f"{'model':<6} {'dtype':<5} {'P':>2} {'backend':<8} {'loss':<8} {'ckpt':<5} {'S':>6} {'static MiB':>10} "
          f"{'pred peak':>10} {'meas peak':>10} {'pred/meas':>9} {'pred step':>10} {'meas step':>10} {'ratio':>6}  "
          "measured peak at")
    start = time.perf_counter()
    pool = None
    try:
        for name, P, backend, loss, ckpt, seqs, *rest in rows:
            dtype = rest[0] if rest else "fp32"
            torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
            model_type, overrides = jobs_plan.MODELS[name]
            if P == 1:
                res = jobs_plan.measure_step(model_type, overrides, seqs, loss=loss, checkpointing=ckpt,
                                             dtype=torch_dtype)
            else:
                if pool is None:
                    pool = LocalPool(2, timeout=900, init=torch_kernels_only).__enter__()
                ranks = pool.run(jobs_plan.measure_job, model_type, overrides, seqs, P, backend, loss, ckpt,
                                 torch_dtype)
                # the rank that holds the most (a plan must fit on every rank): the planner predicts that one
                res = [max(rows, key=lambda r: r["total"]) for rows in zip(*ranks)]
            shape = ModelShape.from_config(jobs_plan.build_config(model_type, overrides))
            for r in res:
                p = plan(shape, PlanOptions(seq=r["S"], gpus=P, dtype=dtype, optimizer="forloop", loss=loss, kernel="torch",
                                            master_weights=False, checkpointing=ckpt,
                                            backend="ulysses" if backend == "none" else backend))
                dyn = p.total - p.static
                if dtype != "fp32":  # CPU bf16 keeps AdamW's state in bf16: the static part is the measured one
                    p.total, p.static = r["static"] + dyn, r["static"]
                print(f"{name:<6} {dtype:<5} {P:>2} {backend:<8} {loss:<8} {ckpt:<5} {r['S']:>6} "
                      f"{r['static'] / 2**20:>10.1f} "
                      f"{dyn / 2**20:>10.1f} {r['peak_dynamic'] / 2**20:>10.1f} {dyn / r['peak_dynamic']:>9.3f} "
                      f"{p.total / 2**20:>10.1f} {r['total'] / 2**20:>10.1f} {p.total / r['total']:>6.3f}  "
                      f"{r['peak_op'].replace('aten.', '')}", flush=True)
    finally:
        if pool is not None:
            pool.__exit__(None, None, None)
    print(f"({time.perf_counter() - start:.0f}s; peak = bytes created in the step and alive at once, over the "
          "static parameters + AdamW state; step = static + peak)")


if __name__ == "__main__":
    main()
