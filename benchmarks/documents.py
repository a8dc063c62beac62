"""Length-aware CP (``load_balance="documents"``) against the best static layout, per backend.

    python benchmarks/documents.py [--seq 32768] [--P 4] [--reps 3] [--seed 0] [--hidden 128] [--layers 2]
                                   [--mu 6] [--sigma 1.5]

One packed row of long-tailed documents (lognormal lengths, mu 6, sigma 1.5 by default, clipped to [16, S/2]: many short
documents, a few long ones, like SFT data), a tiny Llama (fp32, ``--layers`` layers), forward + backward on P CPU
gloo ranks (one thread each). Per backend, every static layout it takes and ``documents`` (threshold chosen per
batch by the cost model). Per row:

* ``bytes``: what one rank sent in one step (``rm.profile_comms``, forward and backward);
* ``work max/mean``: the cost model's per-rank work (``sharding.assignment.Cost``: a token's linear layers plus
  its causal attention row, attention weighted by the model's hidden size), the slowest rank over the mean;
* ``step s``: median over reps of the slowest rank's step (after one warm-up step);
* ``loss err`` / ``grad err``: against the same model without CP (every document run alone), the worst
  parameter's gradient against its own norm.

Ratios are against the backend's best static layout (smallest step). A second table predicts the same ratios at
8 and 64 GPUs (``ringmaster_tools.step_model``, see :func:`predict`). On a 2-core machine P=4 shares two cores
between four ranks: compute dominates and the links are free, so read the bytes and the balance first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LLAMA = dict(num_attention_heads=4, num_key_value_heads=2)


def lengths(S: int, P: int, seed: int, mu: float = 6.0, sigma: float = 1.5) -> list[int]:
    """Lognormal document lengths filling ``S`` tokens (the last one takes the rest, at least 16)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while True:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=g).clamp(16, S // 2))
        if sum(out) + n + 16 > S:
            out.append(S - sum(out))
            return out
        out.append(n)


SYSTEMS = [   # (backend, name, cfg kwargs)
    ("ulysses", "contiguous", dict(backend="ulysses")),
    ("ulysses", "documents", dict(backend="ulysses", load_balance="documents")),
    ("ring", "head_tail", dict(backend="ring", load_balance="head_tail")),
    ("ring", "contiguous", dict(backend="ring", load_balance="none")),
    ("ring", "distflash", dict(backend="ring", load_balance="distflash")),
    ("ring", "documents", dict(backend="ring", load_balance="documents")),
    ("usp 2x2", "contiguous", dict(backend="usp", ulysses_size=2, ring_size=2)),
    ("usp 2x2", "documents", dict(backend="usp", ulysses_size=2, ring_size=2, load_balance="documents")),
]


def _work(batch, P: int, name: str, backend: str, cost, assignment) -> float:
    """The cost model's max/mean work over ranks for a static layout (``assignment`` None) or a documents one."""
    from ringmaster.sharding import balancers

    if assignment is not None:
        return assignment.work_max_over_mean
    pos = batch["position_ids"][0]
    S = pos.numel()
    per_token = 1.0 + cost.quadratic * (pos.double() + 1)      # linear layers + its causal attention row
    if backend.startswith("ulysses"):                          # heads split: every rank a 1/P share of each
        return 1.0
    layout = "contiguous" if name == "distflash" else name
    work = [float(per_token[balancers.shard_positions(S, P, r, layout)].sum()) for r in range(P)]
    # distflash counts as its contiguous cut: its schedule balances one long sequence's blocks, not documents
    return max(work) / (sum(work) / P)


def run_system(ctx, P, cfg_kwargs, lens, reps, hidden, layers, ref_grads):
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import packed_batch, tiny_model

    torch.set_num_threads(1)
    model = tiny_model("llama", "sdpa", 0, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       **LLAMA)
    batch = packed_batch(model.config.vocab_size, lens)
    cfg = rm.RingmasterConfig(size=P, **cfg_kwargs)
    rt = rm.wire(model, cfg, device_mesh=ctx.mesh(P))
    group = rt.cp_group
    try:
        def step():
            model.zero_grad(set_to_none=True)
            with context_parallel_region(batch) as shard:
                out = model(**shard)
            out.loss.backward()
            return out, shard["ringmaster_batch"].assignment

        step()   # warm-up (and the first CP forward's checks)
        with rm.profile_comms() as comms:
            out, assignment = step()
        sent = comms.total_bytes()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g, group=group)
        times = []
        for _ in range(reps):
            dist.barrier(group)
            t0 = time.perf_counter()
            step()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            times.append(float(t))
    finally:
        rm.unwire(model)
        rm.teardown()
    grad_err = max(float((grads[n] / P - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30))
                   for n in ref_grads)
    return {"bytes": sent, "loss": float(loss / P), "grad_err": grad_err, "step": statistics.median(times),
            "assignment": assignment, "cost": rt.cost}


def reference(lens, hidden, layers):
    from ringmaster_tools.parity import packed_batch, per_document_forward, tiny_model

    model = tiny_model("llama", "sdpa", 0, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       **LLAMA)
    batch = packed_batch(model.config.vocab_size, lens)
    out = per_document_forward(model, batch)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--P", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mu", type=float, default=6.0, help="lognormal mu of the document lengths")
    parser.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma of the document lengths")
    args = parser.parse_args()

    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    lens = lengths(args.seq, args.P, args.seed, args.mu, args.sigma)
    torch.set_num_threads(2)
    ref_loss, ref_grads, batch = reference(lens, args.hidden, args.layers)
    print(f"row: {args.seq} tokens, {len(lens)} documents (longest {max(lens)}, median {sorted(lens)[len(lens) // 2]}),"
          f" P={args.P}, llama hidden {args.hidden} x {args.layers} layers, fp32, CPU gloo\n")
    results = {}
    with LocalPool(args.P, timeout=1800, init=torch_kernels_only) as pool:
        for backend, name, kw in SYSTEMS:
            if backend.startswith("usp") and args.P != 4:
                continue
            r = pool.run(run_system, args.P, kw, lens, args.reps, args.hidden, args.layers, ref_grads)[0]
            r["loss_err"] = abs(r["loss"] - ref_loss) / abs(ref_loss)
            r["work"] = _work(batch, args.P, name, backend, r["cost"], r["assignment"])
            results[(backend, name)] = r
    print("| backend | layout | bytes / rank | bytes vs best static | work max/mean | step s | step vs best static "
          "| loss err | grad err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in dict.fromkeys(b for b, _ in results):
        rows = {n: r for (b, n), r in results.items() if b == backend}
        best = min((r for n, r in rows.items() if n != "documents"), key=lambda r: r["step"])
        for name, r in rows.items():
            extra = ""
            if r["assignment"] is not None:
                a = r["assignment"]
                extra = f" (split {a.split_fraction:.0%} of the tokens, threshold {a.threshold})"
            print(f"| {backend} | {name}{extra} | {r['bytes'] / 2**20:.2f} MiB | {r['bytes'] / best['bytes']:.2f} | "
                  f"{r['work']:.3f} | {r['step']:.3f} | {r['step'] / best['step']:.2f} | {r['loss_err']:.1e} | "
                  f"{r['grad_err']:.1e} |")

    from ringmaster_tools.step_model import Hardware, Link, Shape, predict_documents

    print("\nPredicted (ringmaster_tools.step_model.predict_documents, bf16, a Llama-8B-like layer: hidden 4096, 32 "
          "heads, 8 KV heads, 400 TFLOP/s at 50%; NVLink 450 GB/s in a node of 8, InfiniBand 50 GB/s per GPU across "
          "nodes; the same document mix scaled to 128k tokens per GPU; threshold chosen by the step model with these "
          "links, the one it predicts fastest):\n")
    print("| GPUs | backend | static s/layer | documents s/layer | ratio | split tokens |")
    print("|---|---|---|---|---|---|")
    hw = Hardware(200e12, Link(450e9, 10e-6), Link(50e9, 20e-6), ranks_per_node=8)
    for gpus in (8, 64):
        scale = gpus * 131072 / args.seq
        big = [max(int(n * scale), 1) for n in lens]
        big[-1] += -sum(big) % (2 * gpus)
        for name, u, r in (("ulysses" if gpus == 8 else f"usp 8x{gpus // 8}", 8, gpus // 8), ("ring", 1, gpus)):
            s, d, a = predict_documents(big, 4096, Shape(32, 8, 128, sum(big)), hw, u, r)
            print(f"| {gpus} | {name} | {s:.3f} | {d:.3f} | {d / s:.2f} | {a.split_fraction:.0%} |")

if __name__ == "__main__":
    main()
