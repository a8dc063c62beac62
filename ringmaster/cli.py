"""``ringmaster`` command line: ``demo`` runs CP on local CPU gloo ranks against a tiny model,
``plan`` prints the cost of each split, ``bench`` runs a short version of the benchmarks."""

from __future__ import annotations

import argparse
import sys
import time


def _demo_job(ctx, model_type, world, backend, seq_len, attn, overrides):
    import ringmaster as rm
    from ringmaster.testing.parity import compare

    cfg = rm.RingmasterConfig(size=world, backend=backend)
    result = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(world), attn_implementation=attn,
                     **overrides)
    result["rank"] = ctx.rank
    return result


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def demo(args) -> int:
    from .testing.pool import LocalPool

    overrides = dict(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    print(f"ringmaster demo: {args.world} CPU gloo ranks, tiny random {args.model} "
          f"(heads={args.heads}, kv_heads={args.kv_heads}, attn={args.attn}), sequence {args.seq} tokens, "
          f"backend={args.backend}")
    start = time.perf_counter()
    with LocalPool(args.world, timeout=args.timeout) as pool:
        results = pool.run(_demo_job, args.model, args.world, args.backend, args.seq, args.attn, overrides)
    r0 = results[0]
    print(f"one CP forward+backward vs the same model without CP ({time.perf_counter() - start:.1f}s incl. spawn)\n")
    print(f"loss      non-CP {r0['loss_ref']:.6f}   CP (mean over ranks) {r0['loss_cp']:.6f}   "
          f"rel err {r0['loss_err']:.2e}")
    print(f"logits    gathered rel err {r0['logits_err']:.2e}")
    print(f"grads     {r0['n_grads']}/{r0['n_params']} parameters, worst rel err {r0['grad_err']:.2e} "
          f"({r0['worst_param']})\n")
    header = f"{'rank':>4}  {'saved-for-bwd CP':>17}  {'saved non-CP':>13}  {'ratio':>6}  {'peak RSS':>10}  {'bytes sent':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["saved_bytes"] / max(r["ref_saved_bytes"], 1)
        print(f"{r['rank']:>4}  {_fmt_bytes(r['saved_bytes']):>17}  {_fmt_bytes(r['ref_saved_bytes']):>13}  "
              f"{ratio:>6.2f}  {_fmt_bytes(r['peak_rss']):>10}  {_fmt_bytes(r['bytes_sent']):>11}")
    ok = max(r0["loss_err"], r0["logits_err"], r0["grad_err"]) <= 1e-4 and not r0["missing_grads"]
    print(f"\nparity {'OK' if ok else 'FAILED'} (tolerance 1e-4 relative, fp32)")
    return 0 if ok else 1


def plan(args) -> int:
    from .planning import plan_table

    print(plan_table(args.heads, args.kv_heads, args.world, args.ranks_per_node, args.seq, args.hidden, args.layers,
                     args.batch, {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]))
    return 0


def bench(args) -> int:
    from .bench import bench as run_bench

    run_bench(quick=args.quick, world=args.world, out_dir=args.out, progress=not args.no_progress,
              max_seq=args.max_seq, peer_seq=args.peer_seq)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringmaster",
        description="Context parallelism (Ulysses / Ring / USP) for Hugging Face models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="run CP on local CPU gloo ranks against a tiny random model and print parity, memory and bytes",
        description="Spawn CPU gloo ranks, build a tiny random model, run one context-parallel forward+backward "
                    "and compare loss, gathered logits and every gradient with the same model run without CP. "
                    "Prints per-rank saved-activation memory, peak RSS and bytes communicated.",
    )
    p.add_argument("--world", type=int, default=4, help="CP ranks to spawn (default 4)")
    p.add_argument("--model", default="llama", help="tiny model family: llama, mistral, qwen2, qwen3, gemma3_text, gpt_oss")
    p.add_argument("--seq", type=int, default=256, help="sequence length in tokens (default 256)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    p.add_argument("--backend", default="ulysses", help="CP backend (default ulysses)")
    p.add_argument("--attn", default=None, help="inner attention kernel (default: sdpa; eager for gpt_oss)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck rank is killed")
    p.set_defaults(func=demo)

    p = sub.add_parser(
        "plan",
        help="choose the Ulysses x Ring split for a model and cluster and print each alternative's cost",
        description="Print the split auto_select chooses and, per rank and attention layer, the bytes each "
                    "alternative (Ulysses, Ring p2p, Ring allgather, USP splits) sends forward and backward and "
                    "the K/V it keeps resident, from closed-form formulas the tests check against gloo runs.",
    )
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--kv-heads", type=int, required=True, help="KV heads")
    p.add_argument("--world", type=int, required=True, help="CP degree (ranks sharing one sequence)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    p.add_argument("--hidden", type=int, required=True, help="hidden size (head_dim = hidden / heads)")
    p.add_argument("--layers", type=int, default=1, help="attention layers (for the whole-model column)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.set_defaults(func=plan)

    p = sub.add_parser(
        "bench",
        help="short CP-vs-non-CP and peers benchmarks on local CPU gloo ranks, printed as tables",
        description="Run a short version of benchmarks/cp_vs_noncp.py (a small Llama and a Qwen3.5-style hybrid, "
                    "one training step per sequence length, non-CP vs CP at P=2/4: step time, saved-for-backward "
                    "bytes and peak memory per rank) and of benchmarks/peers.py (one causal GQA attention through "
                    "ringmaster's Ulysses / Ring p2p / Ring allgather and every peer that runs here: error, bytes "
                    "per rank, saved bytes, time ratio), with a progress bar. Under torchrun it uses the launched "
                    "ranks (NCCL on GPUs).",
    )
    p.add_argument("--quick", action="store_true", help="smallest shapes (about a minute on 2 cores)")
    p.add_argument("--world", type=int, default=4, help="local ranks to spawn (default 4; P=4 needs 4)")
    p.add_argument("--max-seq", type=int, default=None, help="longest sequence of the CP-vs-non-CP sweep")
    p.add_argument("--peer-seq", type=int, default=None, help="sequence length of the peers benchmark")
    p.add_argument("--out", default=None, help="directory for cp_vs_noncp.csv/.png and peers.csv")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    if getattr(args, "attn", "x") is None:
        args.attn = "eager" if args.model == "gpt_oss" else "sdpa"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
