"""What the token-mixing check costs: its first-forward runs against a CP training step, on CPU.

    python benchmarks/token_mixing.py [--layers 32] [--seq 4096] [--hidden 256] [--P 2]

A llama-shaped causal LM (``--layers`` decoder layers, hidden ``--hidden``, intermediate 4x, vocab 8000, fp32)
wired for Ulysses over ``--P`` CPU gloo ranks, one ``--seq``-token row, four training steps (forward +
backward). Rank 0's wall time of the first step (its forward runs the check: the decoder three more times at the
shard's length and once at three times it, plus the loss window; :mod:`ringmaster.architectures.mixing`), the
median of the next three, the check's own time as ``runtime.report.token_probe`` gives it and, of it, the loss
test's (the head and loss on a window of the shard and on two pieces of it). The last columns are the check and the
loss test over one training step: what they add, once per mode, to a run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def job(ctx, layers: int, seq: int, hidden: int, P: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch

    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=8000,
                         max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    batch = tiny_batch(config.vocab_size, seq)
    steps = []
    try:
        for _ in range(4):
            with context_parallel_region(batch, runtime=runtime) as shard:
                start = time.perf_counter()
                model(**shard).loss.backward()
                steps.append(time.perf_counter() - start)
        note, check = runtime.report.token_probe or "", runtime.mixing.seconds[True]
        loss = runtime.mixing.loss_seconds.get(True, 0.0)
    finally:
        rm.unwire(model)
    later = sorted(steps[1:])
    return {"first": steps[0], "step": later[len(later) // 2], "check": check, "loss": loss, "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--P", type=int, default=2)
    args = parser.parse_args()
    from ringmaster_tools.pool import LocalPool

    with LocalPool(args.P, timeout=1800) as pool:
        r = pool.run(job, args.layers, args.seq, args.hidden, args.P)[0]
    print(f"llama, {args.layers} layers, hidden {args.hidden}, {args.seq} tokens over P={args.P} "
          f"({args.seq // args.P} per rank), Ulysses, fp32, CPU, rank 0:\n")
    print("| first training step (with the check) | training step (median of the next 3) | the check | "
          "of it, the loss test | check / step | loss test / step |")
    print("|---|---|---|---|---|---|")
    print(f"| {r['first']:.2f} s | {r['step']:.2f} s | {r['check']:.2f} s | {r['loss']:.2f} s | "
          f"{r['check'] / r['step']:.2f} | {r['loss'] / r['step']:.3f} |")
    print("\n" + r["note"])


if __name__ == "__main__":
    main()
