"""Functions the gloo pool runs on every rank (importable by the spawned workers)."""

from __future__ import annotations

import torch

import ringmaster as rm


def parity(ctx, model_type, P, attn="sdpa", overrides=None, backend="ulysses", seq_len=64, via="region",
           cfg_kwargs=None):
    from ringmaster.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), attn_implementation=attn,
                   via=via, **(overrides or {}))


def error_of(fn):
    """Run ``fn``; return (exception type name, message) or None when it did not raise."""
    try:
        fn()
    except Exception as exc:  # the tests assert on the type and the message
        return type(exc).__name__, str(exc)
    finally:
        rm.teardown()
    return None


def bad_input(ctx, scenario):
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.parity import tiny_batch, tiny_model

    if scenario == "seq_not_divisible":
        model = tiny_model("llama")
        def go():
            rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
            with context_parallel_region(tiny_batch(128, 63)) as shard:
                model(**shard)
        return error_of(go)
    if scenario == "heads_not_divisible":
        model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=6, hidden_size=48)
        return error_of(lambda: rm.wire(model, rm.RingmasterConfig(size=4, backend="ulysses"), device_mesh=ctx.mesh(4)))
    if scenario == "kv_heads_unsplittable":
        model = tiny_model("llama", num_attention_heads=12, num_key_value_heads=6, hidden_size=96)
        return error_of(lambda: rm.wire(model, rm.RingmasterConfig(size=4, backend="ulysses"), device_mesh=ctx.mesh(4)))
    if scenario == "mesh_without_cp_dim":
        return error_of(lambda: rm.setup(rm.RingmasterConfig(size=2, backend="ulysses"), num_kv_heads=4,
                                         device_mesh=ctx.mesh(2), cp_dim="sequence"))
    if scenario == "size_mismatch":
        return error_of(lambda: rm.setup(rm.RingmasterConfig(size=4, backend="ulysses"), num_kv_heads=4,
                                         device_mesh=ctx.mesh(2)))
    if scenario == "wire_twice":
        model = tiny_model("llama")
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
        result = error_of(lambda: rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"),
                                          device_mesh=ctx.mesh(2)))
        rm.unwire(model)
        return result
    if scenario == "unknown_model":
        model = tiny_model("phi3", num_attention_heads=4, num_key_value_heads=4)
        return error_of(lambda: rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2)))
    if scenario == "unknown_stateful_layer":
        model = tiny_model("llama")

        class FakeMamba2Mixer(torch.nn.Module):
            def forward(self, x):
                return x

        model.model.layers[1].mlp = FakeMamba2Mixer()
        return error_of(lambda: rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2)))
    raise ValueError(scenario)


def unwired_cp_is_wrong(ctx, P):
    """Negative control: shard the batch but keep plain sdpa (no Ulysses) -> the comparison must see it."""
    import copy

    import torch.distributed as dist

    from ringmaster.parity import rel_err, tiny_batch, tiny_model
    from ringmaster.shard import CP_SHARD_KEY, shard_collated_batch

    mesh = ctx.mesh(P)
    group = mesh["cp"].get_group()
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    batch = tiny_batch(128, 64)
    ref = reference(**batch, use_cache=False)
    shard = shard_collated_batch(batch, dist.get_rank(group), P)
    shard.pop(CP_SHARD_KEY)
    out = model(**shard, use_cache=False)
    logits = rm.gather_sequence(out.logits.detach(), dim=1, group=group, layout="contiguous")
    return rel_err(logits, ref.logits)


def collectives(ctx, P, layout):
    """all_to_all / all_gather / gather_sequence against single-process references, with gradients."""
    import torch.distributed as dist

    from ringmaster.comm import all_gather, all_to_all
    from ringmaster.parity import rel_err
    from ringmaster.shard import shard_tensor

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(P, P, 3, 5, generator=g)  # full[i, j]: what rank i sends to rank j
    x = full[r].clone().requires_grad_(True)
    y = all_to_all(x, group)
    errs = {"a2a_fwd": rel_err(y, full[:, r])}
    weight = torch.randn(P, P, 3, 5, generator=g)  # loss = sum_r <y_r, weight[r]>
    (y * weight[r]).sum().backward()
    errs["a2a_bwd"] = rel_err(x.grad, weight[:, r])

    seq = torch.randn(2, 8 * P, 6, generator=g)
    local = shard_tensor(seq, 1, r, P, layout).clone().requires_grad_(True)
    back = rm.gather_sequence(local, dim=1, group=group, layout=layout)
    errs["gather_fwd"] = rel_err(back, seq)
    w = torch.randn(seq.shape, generator=g)
    (back * w).sum().backward()
    errs["gather_bwd"] = rel_err(local.grad, P * shard_tensor(w, 1, r, P, layout))  # every rank's loss adds w

    stacked = all_gather(torch.full((2,), float(r)), group)
    errs["all_gather"] = rel_err(stacked, torch.arange(P, dtype=torch.float32)[:, None].expand(P, 2))
    return errs


def ring_memory(ctx, P, rotate, S=256, H=4, Hkv=2, D=16):
    """Bytes autograd keeps for backward in one ring attention call, and the exactness of its output."""
    import torch.distributed as dist

    from ringmaster.config import RingImpl
    from ringmaster.parity import rel_err
    from ringmaster.ring.kernels import get_kernel
    from ringmaster.ring.loop import RingPlan, ring_attention
    from ringmaster.ring.merge import reference_attention
    from ringmaster.shard import shard_tensor

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, S, D, generator=g) for h in (H, Hkv, Hkv))
    local = [shard_tensor(t, 2, r, P, "head_tail").clone().requires_grad_(True) for t in (q, k, v)]
    plan = RingPlan("head_tail", P, r, S // (2 * P))
    with rm.profile_memory() as mem:
        out = ring_attention(*local, group, plan, get_kernel(RingImpl.TORCH_NATIVE), rotate=rotate)
    ref, _ = reference_attention(q, k, v, D ** -0.5, torch.ones(S, S, dtype=torch.bool).tril())
    err = rel_err(out, shard_tensor(ref, 2, r, P, "head_tail"))
    kv_local = 2 * local[1].numel() * 4
    return {"saved": mem.peak_saved_bytes, "kv_local": kv_local, "kv_full": kv_local * P, "err": err}
