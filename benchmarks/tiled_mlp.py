"""What rm.tiled_mlp saves on CPU: peak tensor memory of one forward + backward, tiled vs not.

    python benchmarks/tiled_mlp.py [--sizes 2048,4096,8192] [--hidden 512] [--intermediate 2048] [--layers 4]

Two rows per sequence length S (batch 1, fp32, one process, one thread):
- ``mlp``: one SwiGLU MLP (transformers' LlamaMLP, hidden x intermediate; 3.1M parameters at the
  defaults), ``out.square().mean().backward()``;
- ``model``: a llama-shaped causal LM (4 layers of that width, vocab 8000; 25M parameters), the loss
  backward (its [S, vocab] logits and loss temporaries included).
``profiling.track_tensor_memory`` counts the bytes of tensor storages created in the step and alive at
once (parameters, their gradient buffers, allocated before, and inputs are not counted): the memory a
step adds, exactly and deterministically (no allocator noise). The tile is the hidden size
(rm.tiled_mlp's default). Tiled runs recompute each MLP tile in backward, so they are slower; the
time column is the wall time of one step (noise on a loaded machine).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def step_peak(model, run) -> tuple[float, float]:
    from ringmaster_tools.profiling import track_tensor_memory

    for p in model.parameters():   # gradients allocated before: the row measures what the step adds
        p.grad = torch.zeros_like(p)
    with track_tensor_memory() as mem:
        start = time.perf_counter()
        run(model)
        seconds = time.perf_counter() - start
    return mem.peak_bytes / 2**20, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2048,4096,8192")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    import ringmaster as rm

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64, vocab_size=8000,
                         max_position_embeddings=max(int(s) for s in args.sizes.split(",")), use_cache=False,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.mlp = LlamaMLP(config)
    model = LlamaForCausalLM(config).train()
    n_mlp = sum(p.numel() for p in holder.parameters()) / 1e6
    n_model = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"hidden {args.hidden}, intermediate {args.intermediate}, tile {args.hidden} tokens; "
          f"mlp {n_mlp:.1f}M params, model {n_model:.1f}M params ({args.layers} layers), fp32, batch 1")
    print(f"{'row':<7} {'S':>6} {'peak MiB':>10} {'tiled MiB':>10} {'ratio':>7} {'step s':>8} {'tiled s':>8}")
    for S in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(1, S, args.hidden)
        ids = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
        rows = [("mlp", holder, lambda m: m.mlp(x).square().mean().backward(), dict(hidden_size=args.hidden)),
                ("model", model, lambda m: m(input_ids=ids, labels=ids).loss.backward(), {})]
        for name, module, run, extra in rows:
            plain, t_plain = step_peak(module, run)
            tiled_module = copy.deepcopy(module)
            handle = rm.tiled_mlp(tiled_module, **extra)
            tiled, t_tiled = step_peak(tiled_module, run)
            handle.restore()
            print(f"{name:<7} {S:>6} {plain:>10.1f} {tiled:>10.1f} {plain / tiled:>6.2f}x {t_plain:>8.2f} "
                  f"{t_tiled:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
