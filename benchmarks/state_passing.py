"""What exact state passing costs next to attention, and what ``scan`` costs over ``sequential``.

1. Per-layer bytes one rank sends (analytic, real model shapes, bf16 activations, fp32 states):
   Ulysses all-to-all of one attention layer vs the state passing of one recurrent layer
   (scan: all-gather of the maps; sequential: one state per hop) and the conv halo.
2. Measured bytes per layer on tiny hybrid models (gloo pool, forward + backward).
3. Extra compute of scan vs sequential: one rank's recurrent kernel work for its shard
   (transformers torch kernels, CPU, fwd+bwd), P = 2 and 4. Timings are printed, never asserted.

    python benchmarks/state_passing.py [--seq 4096] [--skip-pool]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

BF16, F32 = 2, 4

# (name, kind, shapes); attention shapes are the model's full-attention layers
MODELS = {
    "Qwen3-Next-80B (GDN)": dict(kind="gdn", hk=16, hv=32, dk=128, dv=128, conv=4, hq=16, hkv=2, hd=256),
    "Qwen3.5-27B-ish (GDN)": dict(kind="gdn", hk=16, hv=48, dk=128, dv=128, conv=4, hq=24, hkv=4, hd=256),
    "Nemotron-H-8B (Mamba2)": dict(kind="mamba", h=128, p=64, n=128, g=8, conv=4, hq=32, hkv=8, hd=128),
    # Mamba1: state [d_inner, d_state], one decay per entry (maps: 2x the state); Jamba's attention layers
    "Jamba-v0.1 (Mamba1)": dict(kind="mamba1", d=8192, n=16, conv=4, hq=32, hkv=8, hd=128),
}


def analytic(seq: int) -> None:
    print(f"\n## 1. bytes one rank sends per layer, forward (backward is the same again), S={seq}, batch 1")
    print(f"{'model':<24} {'P':>2} {'ulysses attn':>13} {'scan maps':>11} {'seq state/hop':>14} {'conv halo':>10}"
          f" {'scan/attn':>10}")
    for name, m in MODELS.items():
        for P in (2, 4, 8):
            attn = seq // P * (2 * m["hq"] + 2 * m["hkv"]) * m["hd"] * BF16 * (P - 1) // P  # q,k,v out, o back
            if m["kind"] == "gdn":
                state = m["hv"] * m["dk"] * m["dv"] * F32
                maps = m["hv"] * m["dk"] * (m["dv"] + m["dk"]) * F32
                conv_dim = 2 * m["hk"] * m["dk"] + m["hv"] * m["dv"]
            elif m["kind"] == "mamba1":
                state = m["d"] * m["n"] * F32
                maps = m["d"] * 2 * m["n"] * F32
                conv_dim = m["d"]
            else:
                state = m["h"] * m["p"] * m["n"] * F32
                maps = m["h"] * (m["p"] * m["n"] + 1) * F32
                conv_dim = m["h"] * m["p"] + 2 * m["g"] * m["n"]
            scan = maps * (P - 1)
            halo = conv_dim * (m["conv"] - 1) * BF16 * (P - 1)
            print(f"{name:<24} {P:>2} {attn / 2**20:>10.1f}MiB {scan / 2**20:>8.2f}MiB {state / 2**20:>11.2f}MiB"
                  f" {halo / 2**10:>7.1f}KiB {scan / attn:>10.3f}")


def measured(pool) -> None:
    print("\n## 2. measured bytes per layer, tiny models (gloo, fwd+bwd, S=96, rank 0)")
    print(f"{'model':<14} {'P':>2} {'strategy':<10} {'a2a/attn layer':>15} {'state+halo/rec layer':>21}")
    for model_type in ("qwen3_5_text", "nemotron_h"):
        for P in (2, 4):
            for strategy in ("scan", "sequential"):
                r = pool.run(_bytes_job, model_type, P, strategy)[0]
                print(f"{model_type:<14} {P:>2} {strategy:<10} {r['a2a'] / max(r['attn'], 1):>14.0f}B"
                      f" {r['rec_bytes'] / max(r['rec'], 1):>20.0f}B")


def _bytes_job(ctx, model_type, P, strategy):
    import jobs_recurrent as jr

    r = jr.hybrid_parity(ctx, model_type, P, strategy)
    return {"a2a": r["a2a_bytes"], "attn": r["attention_layers"], "rec": r["recurrent_layers"],
            "rec_bytes": r["bytes_sent"] - r["a2a_bytes"]}  # compare() gathers logits outside the profile


def _time(fn, reps=7) -> float:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)  # least disturbed run (shared CPU)


def compute(seq: int) -> None:
    import jobs_recurrent as jr

    from ringmaster.recurrent.scan import compose_prefix

    torch.set_num_threads(1)
    print(f"\n## 3. one rank's recurrent compute for its shard (S={seq}, fwd+bwd, CPU torch kernels, 1 thread)")
    print(f"{'kernel':<16} {'P':>2} {'sequential':>11} {'scan':>9} {'scan/seq':>9}")
    shapes = {"mamba2": dict(b=1, h=8, p=16, g=2, n=32), "gated_deltanet": dict(b=1, hk=2, hv=4, dk=32, dv=32)}
    for kind, shape in shapes.items():
        for P in (2, 4):
            L = seq // P
            make = jr.mamba_inputs if kind == "mamba2" else jr.gdn_inputs
            inputs = make(l=L, dtype=torch.float32, **shape)
            chunk = 64

            def sequential():
                x = jr.leaves(inputs)
                seg = jr.segment(kind, "hf", x, slice(0, L), chunk)
                state = torch.zeros(seg.state_meta()[0]).requires_grad_(True)
                y, final = seg.run(state)
                (y.sum() + final.sum()).backward()

            def scan():
                x = jr.leaves(inputs)
                seg = jr.segment(kind, "hf", x, slice(0, L), chunk)
                packed, aux = seg.local_map()
                maps = [packed.detach().requires_grad_(True) for _ in range(P)]  # what the all-gather returns
                states = compose_prefix(seg, maps)
                y = seg.finish(aux, states[-1])
                (y.sum() + packed.sum()).backward()

            t_seq, t_scan = _time(sequential), _time(scan)
            print(f"{kind:<16} {P:>2} {t_seq * 1e3:>9.1f}ms {t_scan * 1e3:>7.1f}ms {t_scan / t_seq:>9.2f}")
    _compute_mamba1(seq)


def _compute_mamba1(seq: int) -> None:
    """Mamba1: both strategies run the kernel once from a zero state plus the same closed-form correction
    (the kernels take no initial state); scan adds only the prefix over the P gathered maps."""
    import jobs_mamba1 as jm1

    from ringmaster.recurrent.scan import compose_prefix

    for P in (2, 4):
        L = seq // P
        inputs = jm1.mamba1_inputs(b=1, d=64, n=16, l=L, dtype=torch.float32)

        def sequential():
            x = jm1.leaves(inputs)
            seg = jm1.segment("hf", x, slice(0, L))
            state = torch.zeros(seg.state_meta()[0]).requires_grad_(True)
            y, final = seg.run(state)
            (y.sum() + final.sum()).backward()

        def scan():
            x = jm1.leaves(inputs)
            seg = jm1.segment("hf", x, slice(0, L))
            packed, aux = seg.local_map()
            maps = [packed.detach().requires_grad_(True) for _ in range(P)]
            y = seg.finish(aux, compose_prefix(seg, maps)[-1])
            (y.sum() + packed.sum()).backward()

        t_seq, t_scan = _time(sequential, reps=3), _time(scan, reps=3)
        print(f"{'mamba1':<16} {P:>2} {t_seq * 1e3:>9.1f}ms {t_scan * 1e3:>7.1f}ms {t_scan / t_seq:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--skip-pool", action="store_true")
    args = ap.parse_args()
    analytic(32768)
    if not args.skip_pool:
        from ringmaster.testing.pool import LocalPool

        with LocalPool(4, timeout=300) as pool:
            measured(pool)
    compute(args.seq)


if __name__ == "__main__":
    main()
