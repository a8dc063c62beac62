"""Recurrent-layer CP jobs the gloo pool runs on every rank, and the inputs the unit tests share."""

from __future__ import annotations

import math

import torch

import ringmaster as rm

F64 = torch.float64


# --------------------------------------------------------------------------- inputs


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def mamba_inputs(b=2, l=24, h=4, p=3, g=2, n=5, dtype=F64, seed=0):
    """Mamba2 scan inputs with a spread of decays: the slowest heads keep ~all their state over
    the whole sequence (so state crosses several shards), the fastest forget within a few tokens."""
    gen = _gen(seed)
    A = -torch.logspace(-4, 0.3, h, dtype=dtype)                       # per-token decay exp(A*dt) in (0.3, 1)
    return dict(
        x=torch.randn(b, l, h, p, generator=gen, dtype=dtype),
        dt=torch.randn(b, l, h, generator=gen, dtype=dtype) * 0.5,
        A=A,
        B=torch.randn(b, l, g, n, generator=gen, dtype=dtype),
        C=torch.randn(b, l, g, n, generator=gen, dtype=dtype),
        D=torch.randn(h, generator=gen, dtype=dtype),
        dt_bias=torch.randn(h, generator=gen, dtype=dtype) * 0.3,
    )


def gdn_inputs(b=2, l=24, hk=2, hv=4, dk=4, dv=3, dtype=F64, seed=0):
    """Gated delta rule inputs: decays from ~1 (g=-1e-4: state survives every shard) to fast, and
    beta in [0, 2] (negative eigenvalues of I - beta k k^T)."""
    gen = _gen(seed)
    rate = torch.logspace(-4, 0, hv, dtype=dtype)
    return dict(
        q=torch.randn(b, l, hk, dk, generator=gen, dtype=dtype),
        k=torch.randn(b, l, hk, dk, generator=gen, dtype=dtype),
        v=torch.randn(b, l, hv, dv, generator=gen, dtype=dtype),
        g=-rate * torch.rand(b, l, hv, generator=gen, dtype=dtype),
        beta=2 * torch.rand(b, l, hv, generator=gen, dtype=dtype),
    )


def conv_inputs(b=2, c=6, l=24, k=4, dtype=F64, seed=0):
    gen = _gen(seed)
    return dict(x=torch.randn(b, c, l, generator=gen, dtype=dtype), weight=torch.randn(c, k, generator=gen, dtype=dtype),
                bias=torch.randn(c, generator=gen, dtype=dtype))


SEQ_KEYS = {"mamba2": ("x", "dt", "B", "C"), "gated_deltanet": ("q", "k", "v", "g", "beta")}


def kernels(name: str):
    """``(mamba2_chunk_scan, chunk_gated_delta_rule, causal_conv1d_fn)``: ``ref`` = the float64
    naive recurrences, ``hf`` = transformers' pure-torch fallbacks (fp32 inside)."""
    if name == "ref":
        from ringmaster.strategies import naive

        return naive.mamba2_chunk_scan_ref, naive.chunk_gated_delta_rule_ref, naive.causal_conv1d_ref
    from transformers.models.nemotron_h import modeling_nemotron_h as nh
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q5

    return nh.mamba2_chunk_scan, q5.torch_chunk_gated_delta_rule, q5.causal_conv1d_fn


def segment(kind: str, kernel_name: str, inputs: dict, sl: slice | torch.Tensor, chunk_size: int = 5):
    """One Segment over the positions ``sl`` of the full ``inputs``."""
    from ringmaster.strategies.linear_attn import GatedDeltaSegment
    from ringmaster.strategies.mamba import Mamba2Segment

    mamba, gdn, _ = kernels(kernel_name)
    t = {k: (v[:, sl] if k in SEQ_KEYS[kind] else v) for k, v in inputs.items()}
    if kind == "mamba2":
        return Mamba2Segment(mamba, t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size, D=t["D"],
                             dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(1e-3, math.inf))
    return GatedDeltaSegment(gdn, t["q"], t["k"], t["v"], t["g"], t["beta"],
                             kwargs=dict(chunk_size=chunk_size, use_qk_l2norm_in_kernel=True))


def full_output(kind: str, kernel_name: str, inputs: dict, chunk_size: int = 5) -> torch.Tensor:
    l = inputs["x" if kind == "mamba2" else "v"].shape[1]
    out, _ = segment(kind, kernel_name, inputs, slice(0, l), chunk_size).run(None)
    return out


def leaves(inputs: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


# --------------------------------------------------------------------------- pool jobs


def _local_positions(P, rank, layout, l, lengths):
    from ringmaster import balancers

    if lengths is None:
        return balancers.shard_positions(l, P, rank, layout)
    assert layout == "contiguous"
    start = sum(lengths[:rank])
    return torch.arange(start, start + lengths[rank])


def state_passing(ctx, P, layout, strategy, kind, kernel_name="ref", lengths=None, l=24, chunk_size=5):
    """Real collectives: ``pass_state`` on this rank's shard vs the full single-process run,
    outputs and every input gradient (shared parameters summed over the group)."""
    import torch.distributed as dist

    from ringmaster.strategies.state_passing import chunk_ids, pass_state

    group = ctx.mesh(P)["cp"].get_group()
    rank = dist.get_rank(group)
    dtype = F64 if kernel_name == "ref" else torch.float32
    make = mamba_inputs if kind == "mamba2" else gdn_inputs
    base = make(l=l, dtype=dtype)
    ref_in = leaves(base)
    y_ref = full_output(kind, kernel_name, ref_in, chunk_size)
    W = torch.randn(y_ref.shape, generator=_gen(5), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()

    pos = _local_positions(P, rank, layout, l, lengths)
    local = {k: (v[:, pos] if k in SEQ_KEYS[kind] else v).detach().clone().requires_grad_(True)
             for k, v in base.items()}
    n = len(chunk_ids(layout, P, rank))
    m = len(pos) // n
    segs = [segment(kind, kernel_name, local, slice(j * m, (j + 1) * m), chunk_size) for j in range(n)]
    with rm.profile_comms() as comms:
        outs = pass_state(segs, strategy, group, layout)
        y = torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)
        (y * W[:, pos]).sum().backward()
    errs = {"out": rel(y, y_ref[:, pos])}
    for k, v in local.items():
        g = v.grad.detach().clone()
        if k not in SEQ_KEYS[kind]:
            dist.all_reduce(g, group=group)
            errs[f"grad_{k}"] = rel(g, ref_in[k].grad)
        else:
            errs[f"grad_{k}"] = rel(g, ref_in[k].grad[:, pos])
    errs["bytes"] = comms.total_bytes()
    return errs


def conv_halo(ctx, P, layout, lengths=None, l=24, k=4, kernel_name="ref"):
    """``cp_causal_conv1d`` on this rank's shard vs the full conv, with gradients."""
    import torch.distributed as dist

    from ringmaster.strategies.conv import cp_causal_conv1d

    group = ctx.mesh(P)["cp"].get_group()
    rank = dist.get_rank(group)
    _, _, conv = kernels(kernel_name)
    dtype = F64 if kernel_name == "ref" else torch.float32
    base = conv_inputs(l=l, k=k, dtype=dtype)
    ref = leaves(base)
    y_ref = conv(ref["x"], ref["weight"], ref["bias"], activation="silu")
    W = torch.randn(y_ref.shape, generator=_gen(3), dtype=dtype)
    (y_ref * W).sum().backward()
    pos = _local_positions(P, rank, layout, l, lengths)
    loc = leaves(base)
    x = loc["x"][:, :, pos]
    y = cp_causal_conv1d(conv, x, loc["weight"], loc["bias"], "silu", group=group, layout=layout, lengths=lengths)
    (y * W[:, :, pos]).sum().backward()
    gw, gb = loc["weight"].grad.clone(), loc["bias"].grad.clone()
    dist.all_reduce(gw, group=group)
    dist.all_reduce(gb, group=group)
    # every rank's x.grad covers the whole sequence (the halo's gradient comes back to its owner)
    gx = loc["x"].grad.clone()
    dist.all_reduce(gx, group=group)
    return {"out": rel(y, y_ref[:, :, pos]), "grad_x": rel(gx, ref["x"].grad), "grad_w": rel(gw, ref["weight"].grad),
            "grad_b": rel(gb, ref["bias"].grad)}


# --------------------------------------------------------------------------- model parity

def slow_decay(model) -> None:
    """Push some heads' decay towards 1 (A_log very negative) so state survives across shards;
    random init forgets within a few tokens and would hide multi-hop bugs."""
    with torch.no_grad():
        for module in model.modules():
            a_log = module._parameters.get("A_log") if hasattr(module, "_parameters") else None
            if a_log is not None:
                h = a_log.numel()
                a_log.copy_(torch.linspace(-9.0, 0.5, h))


def hybrid_parity(ctx, model_type, P, strategy, backend="ulysses", seq_len=96):
    from ringmaster.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy)
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=slow_decay)


def jamba_raises(ctx):
    from ringmaster.parity import tiny_model

    model = tiny_model("jamba", num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1,
                       attn_layer_period=2)
    try:
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        rm.teardown()
    return None


def without_state_passing(ctx, model_type, P):
    """Negative control: Ulysses on, recurrent layers left unwired -> the gathered logits must differ."""
    import copy

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.parity import rel_err, tiny_batch, tiny_model

    model = tiny_model(model_type)
    slow_decay(model)
    reference = copy.deepcopy(model)
    batch = tiny_batch(model.config.vocab_size, 64)
    ref = reference(**batch, use_cache=False)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        runtime.extras["recurrent_wiring"].restore()
        with context_parallel_region(batch) as shard:
            out = model(**shard)
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
    finally:
        rm.unwire(model)
        rm.teardown()
    return rel_err(logits, ref.logits)


def wire_unwire_roundtrip(ctx, model_type):
    """wire() swaps the recurrent layers' forward per instance; unwire() puts the class forward back
    and the model computes exactly what it did before."""
    from ringmaster.parity import tiny_batch, tiny_model

    model = tiny_model(model_type)
    batch = tiny_batch(model.config.vocab_size, 32)
    before = model(**batch, use_cache=False).logits.detach()
    runtime = rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
    wired = [p for p, m in model.named_modules() if "forward" in vars(m)]
    report = list(runtime.report.recurrent)
    rm.unwire(model)
    rm.teardown()
    left = [p for p, m in model.named_modules() if "forward" in vars(m)]
    after = model(**batch, use_cache=False).logits.detach()
    return {"wired": wired, "report": report, "left": left, "same": bool(torch.equal(before, after))}


def packed_hybrid_refused(ctx, P):
    """Packed rows through recurrent layers are refused (until state resets at document starts land)."""
    import ringmaster as rm
    from jobs import error_of
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.parity import packed_batch, tiny_model

    model = tiny_model("qwen3_5_text")
    rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        def go():
            with context_parallel_region(packed_batch(model.config.vocab_size, [20, 44])) as shard:
                model(**shard)
        return error_of(go)
    finally:
        rm.unwire(model)
