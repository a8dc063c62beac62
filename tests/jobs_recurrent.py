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
        from standins import naive

        return naive.mamba2_chunk_scan_ref, naive.chunk_gated_delta_rule_ref, naive.causal_conv1d_ref
    from transformers.models.nemotron_h import modeling_nemotron_h as nh
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q5

    return nh.mamba2_chunk_scan, q5.torch_chunk_gated_delta_rule, q5.causal_conv1d_fn


def segment(kind: str, kernel_name: str, inputs: dict, sl: slice | torch.Tensor, chunk_size: int = 5):
    """One Segment over the positions ``sl`` of the full ``inputs``."""
    from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment
    from ringmaster.recurrent.mamba2 import Mamba2Segment

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
    from ringmaster.sharding import balancers

    if lengths is None:
        return balancers.shard_positions(l, P, rank, layout)
    assert layout == "contiguous"
    start = sum(lengths[:rank])
    return torch.arange(start, start + lengths[rank])


def state_passing(ctx, P, layout, strategy, kind, kernel_name="ref", lengths=None, l=24, chunk_size=5):
    """Real collectives: ``pass_state`` on this rank's shard vs the full single-process run,
    outputs and every input gradient (shared parameters summed over the group)."""
    import torch.distributed as dist

    from ringmaster.recurrent.scan import chunk_ids, pass_state

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

    from ringmaster.recurrent.conv import cp_causal_conv1d

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


def hybrid_parity(ctx, model_type, P, strategy, backend="ulysses", seq_len=96, fp64=False):
    """``compare`` with slow decays; ``fp64``: model in float64, reference and CP under ``keep_fp64``."""
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy)
    return compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=slow_decay, fp64=fp64)


def jamba_raises(ctx):
    """Jamba registered *without* its Mamba1 mixer declared (a user spec that forgot it): wire must refuse,
    naming the mixer. The built-in spec is put back afterwards."""
    from dataclasses import replace

    from ringmaster.architectures.mamba import JAMBA
    from ringmaster_tools.parity import tiny_model

    model = tiny_model("jamba", num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1,
                       attn_layer_period=2)
    rm.register_architecture(replace(JAMBA, recurrent_classes={}, recurrent_kernels={}), override=True)
    try:
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        rm.register_architecture(JAMBA, override=True)
        rm.teardown()
    return None


def without_state_passing(ctx, model_type, P):
    """Negative control: Ulysses on, recurrent layers left unwired -> the gathered logits must differ."""
    import copy

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model

    model = tiny_model(model_type)
    slow_decay(model)
    reference = copy.deepcopy(model)
    batch = tiny_batch(model.config.vocab_size, 64)
    ref = reference(**batch, use_cache=False)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        runtime.recurrent_wiring.restore()
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
    from ringmaster_tools.parity import tiny_batch, tiny_model

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


# --------------------------------------------------------------------------- packed rows (document resets)

# L=24: doc 1 covers tokens 2..17 (shards 0-2 at P=4), doc 2 starts on the P=4 edge 18; the second row
# has a document start on the edge 12 (P=2 and P=4) followed by two 1-token documents (padding-like).
# EDGE_ROW: every document starts on a chunk edge (P=2/4, contiguous and head_tail), so the incoming
# state is ignored by the whole chunk: the receive / all-gather must still join the backward.
PACKED_ROWS = ([2, 16, 6], [12, 1, 1, 10])
EDGE_ROW = ([12, 6, 6],)


def packed_doc_ids(rows=PACKED_ROWS) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def document_reference(kind, inputs, docs, chunk_size=5):
    """Every document of every row run alone from a zero state (naive float64 kernels)."""
    rows = []
    for r in range(docs.shape[0]):
        row = {k: (v[r:r + 1] if k in SEQ_KEYS[kind] else v) for k, v in inputs.items()}
        outs = []
        for d in docs[r].unique().tolist():
            idx = (docs[r] == d).nonzero().flatten()
            outs.append(segment(kind, "ref", row, slice(int(idx[0]), int(idx[-1]) + 1), chunk_size).run(None)[0])
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0)


def packed_function_level(ctx, P, layout, strategy, l=24, chunk_size=5):
    errs = {}
    for name, rows in (("rows", PACKED_ROWS), ("edges", EDGE_ROW)):
        errs.update({f"{name}_{k}": v for k, v in _packed_function_level(ctx, P, layout, strategy, rows, l,
                                                                         chunk_size).items()})
    return errs


def _packed_function_level(ctx, P, layout, strategy, rows, l=24, chunk_size=5):
    """``pass_state`` over DocumentSegments (built by the same helpers the wired layers use) and
    ``cp_causal_conv1d`` with document ids, real collectives, vs each document alone: outputs and
    every input gradient."""
    import torch.distributed as dist

    from ringmaster.sharding import balancers
    from ringmaster.sharding.documents import CPBatch, Runs
    from standins import naive
    from ringmaster.recurrent.conv import cp_causal_conv1d
    from ringmaster.recurrent.documents import local_documents, with_documents
    from ringmaster.recurrent.scan import chunk_ids, pass_state

    group = ctx.mesh(P)["cp"].get_group()
    rank = dist.get_rank(group)
    docs = packed_doc_ids(rows)
    B = docs.shape[0]
    batch = CPBatch(rank, P, layout, l, docs)
    pos = balancers.shard_positions(l, P, rank, layout)
    n = len(chunk_ids(layout, P, rank))
    m = len(pos) // n
    errs = {}
    for kind, make in (("mamba2", mamba_inputs), ("gated_deltanet", gdn_inputs)):
        base = make(b=B, l=l)
        ref_in = leaves(base)
        y_ref = document_reference(kind, ref_in, docs, chunk_size)
        W = torch.randn(y_ref.shape, generator=_gen(5), dtype=y_ref.dtype)
        (y_ref * W).sum().backward()
        local = {k: (v[:, pos] if k in SEQ_KEYS[kind] else v).detach().clone().requires_grad_(True)
                 for k, v in base.items()}
        segs = [segment(kind, "ref", local, slice(j * m, (j + 1) * m), chunk_size) for j in range(n)]
        segs = with_documents(segs, local_documents(batch, kind, P, rank, layout, (B, len(pos)), n))
        y = torch.cat([o[0] if isinstance(o, tuple) else o for o in pass_state(segs, strategy, group, layout)], 1)
        (y * W[:, pos]).sum().backward()
        errs[f"{kind}_out"] = rel(y, y_ref[:, pos])
        for k, v in local.items():
            g = v.grad.detach().clone()
            if k not in SEQ_KEYS[kind]:
                dist.all_reduce(g, group=group)
                errs[f"{kind}_grad_{k}"] = rel(g, ref_in[k].grad)
            else:
                errs[f"{kind}_grad_{k}"] = rel(g, ref_in[k].grad[:, pos])
    # the conv: no tap crosses a document start, halos across ranks included
    base = conv_inputs(b=B, l=l)
    ref = leaves(base)
    rows = []
    for r in range(B):   # documents are contiguous and in order along the row
        rows.append(torch.cat([naive.causal_conv1d(ref["x"][r:r + 1, :, docs[r] == d], ref["weight"], ref["bias"],
                                                   "silu") for d in docs[r].unique().tolist()], dim=-1))
    y_ref = torch.cat(rows, dim=0)
    W = torch.randn(y_ref.shape, generator=_gen(3), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()
    loc = leaves(base)
    y = cp_causal_conv1d(naive.causal_conv1d_ref, loc["x"][:, :, pos], loc["weight"], loc["bias"], "silu",
                         group=group, layout=layout, docs=docs, runs=Runs.from_doc_ids(docs))
    (y * W[:, :, pos]).sum().backward()
    errs["conv_out"] = rel(y, y_ref[:, :, pos])
    for k in ("x", "weight", "bias"):
        g = loc[k].grad.clone()
        dist.all_reduce(g, group=group)
        errs[f"conv_grad_{k}"] = rel(g, ref[k].grad)
    return errs


def packed_hybrid_parity(ctx, model_type, P, strategy, backend="ulysses", cfg_kwargs=None, doc_lens=(5, 67, 10, 14),
                         strip_kwarg=False):
    """A packed row through a hybrid model under CP vs every document run alone (token-weighted).

    ``strip_kwarg``: the mixers are called without the ``ringmaster_batch`` kwarg (a pre-hook on each
    mixer drops it), as a decoder layer that does not forward its kwargs would; the document ids must
    then come from the pre-hook ringmaster puts on the enclosing decoder layer."""
    from ringmaster.sharding.documents import BATCH_KWARG
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, recurrent=strategy, **(cfg_kwargs or {}))

    def batch(m):
        return packed_batch(m.config.vocab_size, list(doc_lens))

    def strip(module, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if k != BATCH_KWARG}

    def prepare(model):
        slow_decay(model)
        if strip_kwarg:
            for module in model.modules():
                if "A_log" in module._parameters:
                    module.register_forward_pre_hook(strip, with_kwargs=True)

    return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=prepare, batch=batch,
                   reference_forward=per_document_forward)


def packed_hybrid_without_resets(ctx, model_type, P, doc_lens, strategy="scan"):
    """Negative control: the same packed comparison with the recurrent layers' document resets switched
    off (state and conv halo flow across document starts; attention stays packed-exact)."""
    from ringmaster.recurrent import conv, documents

    # gated DeltaNet and Mamba2 wrap their segments through documents.document_segments -> with_documents
    saved = [(mod, name, getattr(mod, name)) for mod, name in ((documents, "with_documents"), (conv, "conv_documents"))]
    documents.with_documents = lambda segments, docs: list(segments)
    conv.conv_documents = lambda *args: None   # every wired conv looks it up there (conv.cp_conv_kernel)
    try:
        return packed_hybrid_parity(ctx, model_type, P, strategy, "ulysses", None, doc_lens)
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def packed_hybrid_isolation(ctx, model_type, P, doc_lens, backend="ulysses", cfg_kwargs=None, strategy="scan"):
    """Change every token of document 0: the other documents' CP logits stay bit-identical."""
    from jobs import document_isolation

    return document_isolation(ctx, P, doc_lens, backend, {"recurrent": strategy, **(cfg_kwargs or {})},
                              model_type=model_type, prepare=slow_decay)


def padded_hybrid_parity(ctx, model_type, P, strategy, backend="ulysses", cfg_kwargs=None, S=64, left=7, real=41):
    """B=2 through a hybrid model: row 0 one full document, row 1 left- and right-padded (attention_mask
    zeros). Padding tokens are documents of their own: no state or conv tap reaches the first real token
    after the left padding. Real tokens match each row run alone; padding is never counted."""
    from jobs import padded_parity

    return padded_parity(ctx, P, backend, {"recurrent": strategy, **(cfg_kwargs or {})}, model_type=model_type,
                         prepare=slow_decay, S=S, left=left, real=real)
