"""Ulysses communication and activation memory, measured on CPU gloo ranks.

    python benchmarks/ulysses_bytes.py [--seq 2048] [--hidden 256] [--heads 8] [--kv-heads 4] [--layers 2]

For each CP size it runs one forward+backward of a tiny random Llama under Ulysses and prints,
per rank and per attention layer, the all-to-all bytes this rank sent (forward and backward,
measured by rm.profile_comms) next to the closed-form volume

    fwd = (Hq + 2*Hkv_eff + Hq) * D * (S/P) * B * bytes * (P-1)/P     (q, k, v in; output back)
    bwd = the same (the adjoint all-to-alls)

with Hkv_eff = max(Hkv, P) when KV heads are replicated, and the bytes saved for backward per
rank (saved-tensor hooks) against the same model without CP.
"""

from __future__ import annotations

import argparse


def job(ctx, P, seq, hidden, heads, kv_heads, layers):
    import ringmaster as rm
    from ringmaster_tools.parity import compare

    r = compare("llama", rm.RingmasterConfig(size=P, backend="ulysses"), seq_len=seq,
                device_mesh=ctx.mesh(P), hidden_size=hidden, intermediate_size=2 * hidden,
                num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", default="2,4")
    args = parser.parse_args()

    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    D = args.hidden // args.heads
    print(f"Llama hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} head_dim={D} "
          f"layers={args.layers} seq={args.seq} batch=1 fp32\n")
    header = (f"{'P':>2} {'a2a sent/rank/layer':>20} {'theory':>10} {'ratio':>6} "
              f"{'saved CP':>10} {'saved non-CP':>12} {'CP/non-CP':>9} {'max rel err':>11}")
    print(header)
    print("-" * len(header))
    for P in (int(p) for p in args.sizes.split(",")):
        with LocalPool(P, init=torch_kernels_only) as pool:
            r = pool.run(job, P, args.seq, args.hidden, args.heads, args.kv_heads, args.layers)[0]
        kv_eff = args.kv_heads if args.kv_heads % P == 0 else P
        per_direction = (2 * args.heads + 2 * kv_eff) * D * (args.seq // P) * 4 * (P - 1) / P
        theory = 2 * per_direction  # forward + backward
        measured = r["a2a_bytes"] / args.layers
        err = max(r["loss_err"], r["logits_err"], r["grad_err"])
        print(f"{P:>2} {measured / 1024:>16.1f} KiB {theory / 1024:>6.1f} KiB {measured / theory:>6.3f} "
              f"{r['saved_bytes'] / 2**20:>6.2f} MiB {r['ref_saved_bytes'] / 2**20:>8.2f} MiB "
              f"{r['saved_bytes'] / r['ref_saved_bytes']:>9.2f} {err:>11.1e}")


if __name__ == "__main__":
    main()
