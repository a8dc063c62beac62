"""The recurrent strategies side by side: ``heads`` (head-parallel), ``scan``, ``sequential`` (state passing).

1. Bytes one rank sends per recurrent layer, forward (backward sends the same again), real model shapes, bf16
   activations, fp32 states and gates: ``heads`` moves the kernel's per-token inputs to whole rows and its outputs
   back (two all-to-alls; inputs shared by a group of heads go to every rank that reads them), ``scan`` all-gathers
   one map per rank, ``sequential`` sends one state per hop. Analytic.
2. Measured on tiny hybrids (gloo on CPU, forward + backward, one rank): bytes sent per step, the step time
   relative to ``scan``, and the peak of the activations autograd saved (``rm.profile_memory``), P = 2, 4 and 8;
   ``auto`` too, which picks heads per layer where it sends no more than the state passing (``recurrent/cost.py``).
   CPU timings of tiny models say how the work scales, not what a GPU does: no speed claim is made from them.
3. bf16 drift: the gathered logits of a bf16 model, without CP and under each strategy, against the same model
   in float64 (its kernels kept in float64), at growing sequence length, P = 4.
4. What ``scan`` holds for backward at large P: the last rank composes the P-1 gathered maps before its chunk, and
   autograd keeps the all-gather's output (P maps) until the layer's backward (analytic, per rank; a log-depth
   prefix scan would hold ceil(log2 P); ``sequential`` holds the one state it received, ``heads`` none).

    python benchmarks/recurrent_modes.py [--skip-pool] [--sizes 2,4,8] [--drift-seqs 256,1024,4096]

``fla_cp`` (flash-linear-attention's own CP) runs only on FLA's kernels; it is checked for exactness in
tests/test_real_kernels.py under Triton's interpreter, whose speed says nothing, so it has no column here.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from state_passing import BF16, F32, MODELS, _state_bytes  # noqa: E402

STRATEGIES = ("heads", "scan", "sequential")


def heads_per_token(m: dict, P: int) -> tuple[int, int]:
    """``(input bytes, output bytes)`` per token of one recurrent layer's kernel in heads mode, each summed over
    every head (inputs read by a group of heads counted once per rank that reads them when the groups are fewer
    than P). 0, 0 for a kind without a scan (short convs keep their halo)."""
    kind = m["kind"]
    if kind == "gdn":
        qk = 2 * max(m["hk"], P) * m["dk"] * BF16
        gate = m["hv"] * (m["dk"] if "(KDA)" in m.get("name", "") else 1) * F32   # KDA: a decay per channel
        return qk + m["hv"] * m["dv"] * BF16 + gate + m["hv"] * BF16, m["hv"] * m["dv"] * BF16
    if kind == "mamba":
        return (m["h"] * m["p"] * BF16 + m["h"] * BF16 + 2 * max(m["g"], P) * m["n"] * BF16,
                m["h"] * m["p"] * BF16)
    if kind == "lightning":
        return 3 * m["h"] * m["d"] * BF16, m["h"] * m["d"] * BF16
    if kind == "rglru":
        return 2 * m["w"] * BF16 + P * BF16, m["w"] * BF16
    if kind == "rwkv":
        return 2 * m["c"] * BF16, m["c"] * BF16
    if kind == "mamba1":
        return 3 * m["d"] * BF16 + 2 * P * m["n"] * BF16, m["d"] * BF16
    if kind == "mlstm":
        return m["h"] * (2 * m["dk"] + m["dv"] + 2) * BF16, m["h"] * m["dv"] * BF16
    return 0, 0


def analytic(seq: int) -> None:
    """Part 1. The last two columns are the short conv's: ``halo`` is what every strategy sends for it (each rank's
    last K-1 inputs, all-gathered: counted as sent to each of the P-1 others), ``conv by channel`` what moving the
    conv's own input to whole rows for C/P channels and its output back would send instead (two all-to-alls
    around the model's unchanged conv call: the model's forward reads the conv's output per token)."""
    print(f"\n## 1. bytes one rank sends per recurrent layer, forward, S={seq}, batch 1")
    print(f"{'model':<28} {'P':>2} {'heads':>11} {'scan':>11} {'sequential':>11} {'heads/scan':>11} "
          f"{'conv halo':>11} {'conv by channel':>16}")
    for name, m in MODELS.items():
        for P in (2, 4, 8):
            state, maps, conv_channels = _state_bytes(m)
            fin, fout = heads_per_token({**m, "name": name}, P)
            heads = seq // P * (fin + fout) * (P - 1) // P
            scan = maps * (P - 1)
            ratio = f"{heads / scan:>11.0f}" if scan else f"{'halo':>11}"
            halo = (P - 1) * (m["conv"] - 1) * conv_channels * BF16
            by_channel = 2 * seq // P * conv_channels * BF16 * (P - 1) // P
            print(f"{name:<28} {P:>2} {heads / 2**20:>8.1f}MiB {scan / 2**20:>8.2f}MiB {state / 2**20:>8.2f}MiB"
                  f" {ratio} {halo / 2**10:>8.1f}KiB {by_channel / 2**20:>13.1f}MiB")


# tiny hybrids wide enough for 8 ranks to split their heads: (model_type, config overrides)
POOL_MODELS = {
    "qwen3_5_text": dict(linear_num_key_heads=8, linear_num_value_heads=8, num_attention_heads=8,
                         num_key_value_heads=8, hidden_size=256, head_dim=32, linear_key_head_dim=32,
                         linear_value_head_dim=32),
    "nemotron_h": dict(mamba_num_heads=16, n_groups=2, num_attention_heads=8, num_key_value_heads=8),
}


def _step_job(ctx, model_type, P, strategy, seq_len, steps=3):
    """One rank's bytes, time (best of ``steps`` warm steps) and peak saved activations of a forward + backward."""
    import torch.distributed as dist
    from jobs_mamba1 import slow_decay

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    model = tiny_model(model_type, **POOL_MODELS[model_type])
    slow_decay(model)
    batch = tiny_batch(model.config.vocab_size, seq_len)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy), device_mesh=mesh)
    out = {}
    try:
        times = []
        for i in range(steps + 1):
            model.zero_grad(set_to_none=True)
            dist.barrier(group=runtime.cp_group)
            t = time.perf_counter()
            with rm.profile_comms() as comms, rm.profile_memory() as mem:
                with context_parallel_region(batch) as shard:
                    loss = model(**shard).loss
                loss.backward()
            dist.barrier(group=runtime.cp_group)
            if i:
                times.append(time.perf_counter() - t)
        out = {"bytes": comms.total_bytes(), "seconds": min(times), "saved": mem.peak_saved_bytes}
    finally:
        rm.unwire(model)
        rm.teardown()
    return out


def measured(sizes, seq_len: int) -> None:
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    print(f"\n## 2. measured, tiny hybrids, S={seq_len}, forward + backward, rank 0 (gloo on CPU)")
    print(f"{'model':<14} {'P':>2} {'strategy':<11} {'bytes/step':>11} {'time/scan':>10} {'saved acts':>11}")
    with LocalPool(max(sizes), timeout=900, init=torch_kernels_only) as pool:
        for model_type in POOL_MODELS:
            for P in sizes:
                rows = {s: pool.run(_step_job, model_type, P, s, seq_len)[0] for s in (*STRATEGIES, "auto")}
                for s, r in rows.items():
                    print(f"{model_type:<14} {P:>2} {s:<11} {r['bytes'] / 2**20:>8.2f}MiB "
                          f"{r['seconds'] / rows['scan']['seconds']:>10.2f} {r['saved'] / 2**20:>8.2f}MiB", flush=True)


def _drift_job(ctx, model_type, P, seq_len):
    """Max relative error of the gathered logits against the float64 model: bf16 without CP, and bf16 under each
    strategy; ``<strategy> vs no CP``: the bf16 logits under the strategy against the bf16 logits without CP."""
    from jobs_mamba1 import slow_decay

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import keep_fp64, rel_err, tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    truth_model = tiny_model(model_type, dtype=torch.float64, **POOL_MODELS[model_type])
    slow_decay(truth_model)
    batch = tiny_batch(truth_model.config.vocab_size, seq_len)
    with torch.no_grad(), keep_fp64():
        truth = truth_model(**batch, use_cache=False).logits
    low = copy.deepcopy(truth_model).to(torch.bfloat16)
    with torch.no_grad():
        plain = low(**batch, use_cache=False).logits
    out = {"no CP": rel_err(plain, truth)}
    for strategy in STRATEGIES:
        model = copy.deepcopy(low)
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent=strategy), device_mesh=mesh)
        try:
            with torch.no_grad(), context_parallel_region(batch) as shard:
                logits = rm.gather_sequence(model(**shard).logits, dim=1)
            out[strategy] = rel_err(logits, truth)
            out[f"{strategy} vs no CP"] = rel_err(logits, plain)
        finally:
            rm.unwire(model)
            rm.teardown()
    return out


def drift(seqs, P: int = 4) -> None:
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    print(f"\n## 3. bf16 logits against the float64 model (max relative error), P={P}")
    columns = ("no CP", *STRATEGIES, *(f"{s} vs no CP" for s in STRATEGIES))
    print(f"{'model':<14} {'S':>6} " + " ".join(f"{c:>18}" for c in columns))
    with LocalPool(P, timeout=900, init=torch_kernels_only) as pool:
        for model_type in POOL_MODELS:
            for S in seqs:
                r = pool.run(_drift_job, model_type, P, S)[0]
                print(f"{model_type:<14} {S:>6} " + " ".join(f"{r[c]:>18.2e}" for c in columns), flush=True)


# (model, recurrent layers of that kind) for the held-maps table
HELD = {"Qwen3.5-27B-ish (GDN)": 48, "Nemotron-H-8B (Mamba2)": 24, "MiniMax-Text-01 (lightning)": 70,
        "Kimi-Linear-48B (KDA)": 20}


def held(sizes=(8, 32, 64)) -> None:
    print("\n## 4. maps the last rank holds for backward under scan, every recurrent layer of the model, no checkpointing")
    print(f"{'model':<28} {'layers':>6} {'P':>3} {'scan (P maps)':>16} {'log-depth scan':>15} {'sequential':>11}")
    for name, layers in HELD.items():
        state, maps, _ = _state_bytes(MODELS[name])
        for P in sizes:
            log = (P - 1).bit_length()
            print(f"{name:<28} {layers:>6} {P:>3} {P * maps * layers / 2**30:>13.2f}GiB "
                  f"{log * maps * layers / 2**30:>12.2f}GiB {state * layers / 2**30:>8.2f}GiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768, help="sequence length of the analytic table")
    ap.add_argument("--skip-pool", action="store_true")
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--pool-seq", type=int, default=1024)
    ap.add_argument("--drift-seqs", default="256,1024,4096")
    ap.add_argument("--parts", default="1,2,3,4",
                    help="which tables to print (1: analytic bytes, 2: measured, 3: drift, 4: maps held by scan)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "1" in parts:
        analytic(args.seq)
    if "4" in parts:
        held()
    if not args.skip_pool and "2" in parts:
        measured([int(p) for p in args.sizes.split(",")], args.pool_seq)
    if not args.skip_pool and "3" in parts:
        drift([int(s) for s in args.drift_seqs.split(",")])


if __name__ == "__main__":
    main()
