"""Jobs for tests/test_peers.py (run on every rank of the session pool)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_to_all_single as all_to_all_by_name  # bound before any counter exists

F32 = 4


def c10d_count_job(ctx, P: int):
    """Known collectives issued four ways (a name imported at module load, a process-group call,
    a functional collective, a batched p2p): the bytes count_collectives sees, per kind and phase."""
    from ringmaster_tools.profiling import count_collectives

    group = ctx.mesh(P)["cp"].get_group()
    me, n = dist.get_rank(group), 6
    x = torch.arange(P * n * 4, dtype=torch.float32).reshape(P * n, 4)   # P*n*16 bytes
    peers = [dist.get_global_rank(group, (me + s) % P) for s in (1, -1)]
    with count_collectives() as seen:
        out = torch.empty_like(x)
        all_to_all_by_name(out, x, group=group)                                # (P-1)/P of x
        gathered = torch.empty(P * x.shape[0], 4)
        dist.all_gather_into_tensor(gathered, x, group=group)                 # x to P-1 peers
        funcol.wait_tensor(funcol.permute_tensor(x.flatten(), [(i + 1) % P for i in range(P)], group))  # x once
        y = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, peers[0], group), dist.P2POp(dist.irecv, y, peers[1], group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()                                                           # x once
        dist.broadcast(x.clone(), src=dist.get_global_rank(group, 0), group=group)  # the root: x to P-1 peers
        leaf = x.clone().requires_grad_(True)
        (funcol.all_to_all_single_autograd(leaf, None, None, group) * 2).sum().backward()  # (P-1)/P fwd and bwd
    return {(r.kind, r.phase): seen.total_bytes(r.kind, r.phase) for r in seen.records}, x.numel() * F32, me


def peers_tiny_job(ctx, P: int, systems):
    """peers_job on tiny shapes; also what the peers left behind in this (shared) process."""
    import sys

    from torch.distributed.tensor import DTensor

    from ringmaster_tools.bench import peers_job

    out = peers_job(ctx, P, 64, 4, 2, 8, 1, systems)
    if out is not None:
        cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        dispatcher = DTensor._op_dispatcher
        out["_left"] = {"cp handler": cpu_op in dispatcher._custom_op_handlers,
                        "cp strategy": cpu_op in dispatcher.sharding_propagator.op_strategy_funcs,
                        "flash_attn": getattr(sys.modules.get("flash_attn"), "STANDIN", None) is not None,
                        "sdpa patched": torch.nn.functional.scaled_dot_product_attention.__name__ != "scaled_dot_product_attention"}
    return out
