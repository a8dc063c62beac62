"""Attention-function-level CP vs dense attention, for the hypothesis suite."""

from __future__ import annotations

import torch

import ringmaster as rm


class FakeAttention(torch.nn.Module):
    """What the attention interface reads from an HF attention module."""

    def __init__(self, groups: int, sinks: torch.Tensor | None):
        super().__init__()
        self.is_causal, self.layer_idx, self.num_key_value_groups = True, 0, groups
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def attention_case(ctx, case: dict) -> dict:
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ringmaster.sharding.documents import BATCH_KWARG, CPBatch
    from ringmaster_tools.parity import rel_err
    from ringmaster.attention.ring.merge import reference_attention
    from ringmaster.shard import shard_tensor

    P, B, Hkv, Hq, D, S = case["P"], case["B"], case["Hkv"], case["Hq"], case["D"], case["S"]
    cfg = rm.RingmasterConfig(size=P, **case["cfg"])
    rt = rm.setup(cfg, num_kv_heads=Hkv, device_mesh=ctx.mesh(P), num_heads=Hq)
    try:
        group, layout = rt.cp_group, rt.shard_load_balance
        r = dist.get_rank(group)
        g = torch.Generator().manual_seed(case["seed"])
        q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
        w = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64) if case["sinks"] else None
        docs = None
        if case["cuts"]:
            cuts = torch.zeros(B, S, dtype=torch.long)
            for b, row in enumerate(case["cuts"]):
                for c in row:
                    cuts[b, c] = 1
            docs = cuts.cumsum(-1)
        window = case["window"]
        pos = torch.arange(S)
        mask = (pos[:, None] >= pos[None, :])
        if window:
            mask = mask & (pos[:, None] - pos[None, :] < window)
        mask = mask[None, None].expand(B, 1, S, S)
        if docs is not None:
            mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sink_leaf = sinks.clone().requires_grad_(True) if sinks is not None else None
        ref, _ = reference_attention(*leaves, D ** -0.5, mask, sink=sink_leaf)
        (ref * w).sum().backward()

        local = [shard_tensor(t, 2, r, P, layout).clone().requires_grad_(True) for t in (q, k, v)]
        module = FakeAttention(Hq // Hkv, sinks)
        fn = ALL_ATTENTION_FUNCTIONS[rt.attn_implementation]
        cpb = CPBatch(r, P, layout, S, docs)
        out, _ = fn(module, *local, None, scaling=D ** -0.5, dropout=0.0, sliding_window=window,
                    **{BATCH_KWARG: cpb})
        (out.transpose(1, 2) * shard_tensor(w, 2, r, P, layout)).sum().backward()
        gathered = rm.gather_sequence(out.detach(), dim=1, group=group, layout=layout)
        errs = {"out": rel_err(gathered, ref.transpose(1, 2))}
        # a gradient that is zero in exact arithmetic (a query that sees one key) is rounding noise:
        # judge every gradient against at least 1e-6 of the largest one
        floor = 1e-6 * max(float(t.grad.abs().max()) for t in leaves)
        for name, leaf, ref_leaf in zip("qkv", local, leaves):
            full = rm.gather_sequence(leaf.grad, dim=2, group=group, layout=layout)
            errs["d" + name] = rel_err(full, ref_leaf.grad, floor)
        if sinks is not None:
            dsink = module.sinks.grad.clone()
            dist.all_reduce(dsink, group=group)
            errs["dsink"] = rel_err(dsink, sink_leaf.grad)
        return errs
    finally:
        rm.teardown()


def attention_cases(ctx, cases: list[dict]) -> list[dict]:
    """:func:`attention_case` for each of ``cases`` (one CP size) in one pool job: one dispatch for several."""
    return [attention_case(ctx, case) for case in cases]
