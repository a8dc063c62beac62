"""Raw PyTorch: FSDP2 x context parallelism with ringmaster, runnable on CPU.

    torchrun --nproc-per-node 4 examples/raw_fsdp2.py            # gloo on CPU, nccl on GPUs

A ("dp_shard", "cp") = (2, 2) DeviceMesh: FSDP2 shards the parameters over all 4 ranks (the
flattened dp_shard x cp dim) and averages the gradients over them; each cp pair shares one
sequence, each dp_shard index gets its own batch. ringmaster's loss convention (each rank's
loss is its shard's token sum / (global tokens / cp)) makes that average the exact gradient.
Step 0 prints the CP loss next to the same model's loss without CP.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from ringmaster_tools.parity import tiny_batch, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--model", default="llama", help="any family in ringmaster_tools.parity.TINY (e.g. qwen3_5_text)")
    opts = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    world = dist.get_world_size()
    if world % opts.cp:
        raise SystemExit(f"world size {world} is not a multiple of --cp {opts.cp}")
    mesh = init_device_mesh(device.type, (world // opts.cp, opts.cp), mesh_dim_names=("dp_shard", "cp"))
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    dp_rank = mesh["dp_shard"].get_local_rank()
    first = dist.get_rank() == 0

    model = tiny_model(opts.model).to(device)  # same seed on every rank
    reference = copy.deepcopy(model)
    batch = {k: v.to(device) for k, v in tiny_batch(model.config.vocab_size, opts.seq_len, batch_size=2,
                                                    seed=100 + dp_rank).items()}
    with torch.no_grad():
        ref_loss = reference(**batch, use_cache=False).loss.item()

    runtime = rm.wire(model, rm.RingmasterConfig(size=opts.cp), device_mesh=mesh)
    if first:
        print(runtime.report, flush=True)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    for step in range(opts.steps):
        with context_parallel_region(batch) as shard:  # every cp rank passes the same full batch
            loss = model(**shard).loss
        loss.backward()  # FSDP2 reduce-scatters (averages) the gradients over dp_shard x cp
        optimizer.step()
        optimizer.zero_grad()
        # the CP-group mean of the rank losses is this dp group's loss; average the dp groups for the log
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        logged = (logged / world).item()
        losses.append(logged)
        if step == 0:
            cp_loss = loss.detach().clone()
            dist.all_reduce(cp_loss, group=runtime.cp_group)
            cp_loss = (cp_loss / opts.cp).item()
            err = abs(cp_loss - ref_loss) / abs(ref_loss)
            print(f"[rank {dist.get_rank()} dp {dp_rank}] step 0 loss parity: cp={cp_loss:.6f} "
                  f"single-device={ref_loss:.6f} rel_err={err:.2e}", flush=True)
            if err > 1e-4:
                raise SystemExit(f"loss parity failed: rel_err={err:.2e}")
        if first:
            print(f"step {step}: loss {logged:.4f}", flush=True)

    if first:
        trend = "decreasing" if losses[-1] < losses[0] else "NOT decreasing"
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({trend})", flush=True)
    rm.unwire(model)
    rm.teardown()
    # every rank past its last collective before any tears the groups down: a rank that exits while gloo's
    # worker threads still hold another group's work can abort ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
