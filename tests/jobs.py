"""Functions the gloo pool runs on every rank (importable by the spawned workers)."""

from __future__ import annotations

import torch

import ringmaster as rm


def parity(ctx, model_type, P, attn="sdpa", overrides=None, backend="ulysses", seq_len=64, via="region",
           cfg_kwargs=None):
    from ringmaster_tools.parity import compare

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


def unwired_cp_is_wrong(ctx, P):
    """Negative control: shard the batch but keep plain sdpa (no Ulysses) -> the comparison must see it."""
    import copy

    import torch.distributed as dist

    from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model
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
    from ringmaster_tools.parity import rel_err
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
    from ringmaster_tools.parity import rel_err
    from ringmaster.attention.ring.kernels import get_kernel
    from ringmaster.attention.ring.loop import RingPlan, ring_attention
    from ringmaster.attention.ring.merge import reference_attention
    from ringmaster.shard import shard_tensor

    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, S, D, generator=g) for h in (H, Hkv, Hkv))
    local = [shard_tensor(t, 2, r, P, "head_tail").clone().requires_grad_(True) for t in (q, k, v)]
    plan = RingPlan("head_tail", P, r, S // (2 * P))
    with rm.profile_memory() as mem:
        out = ring_attention(*local, group, plan, get_kernel(RingImpl.ATEN), rotate=rotate)
    ref, _ = reference_attention(q, k, v, D ** -0.5, torch.ones(S, S, dtype=torch.bool).tril())
    err = rel_err(out, shard_tensor(ref, 2, r, P, "head_tail"))
    kv_local = 2 * local[1].numel() * 4
    return {"saved": mem.peak_saved_bytes, "kv_local": kv_local, "kv_full": kv_local * P, "err": err}


def packed_parity(ctx, P, doc_lens, backend="ulysses", cfg_kwargs=None, model_type="llama", attn="sdpa",
                  overrides=None, pad=0):
    """A packed row against every document run alone (token-weighted)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    overrides = dict(overrides or {})
    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    batch = packed_batch(128, doc_lens, pad=pad)
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), attn_implementation=attn, batch=batch,
                   reference_forward=per_document_forward, **overrides)


def document_isolation(ctx, P, doc_lens, backend, cfg_kwargs=None, model_type="llama", prepare=None, **overrides):
    """Change every token of document 0: the other documents' CP logits must stay bit-identical."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import packed_batch, tiny_model

    if model_type == "llama" and not overrides:
        overrides = dict(num_attention_heads=8, num_key_value_heads=2)
    model = tiny_model(model_type, **overrides)
    if prepare is not None:
        prepare(model)
    model.eval()
    vocab = model.config.vocab_size
    rm.wire(model, rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {})), device_mesh=ctx.mesh(P))
    try:
        logits = []
        for shift in (0, 17):
            batch = packed_batch(vocab, list(doc_lens))
            batch["input_ids"][:, :doc_lens[0]] = (batch["input_ids"][:, :doc_lens[0]] + shift) % vocab
            with torch.no_grad(), context_parallel_region(batch) as shard:
                logits.append(rm.gather_sequence(model(**shard).logits, dim=1))
    finally:
        rm.unwire(model)
        rm.teardown()
    first = doc_lens[0]
    return {"others_identical": bool(torch.equal(logits[0][:, first:], logits[1][:, first:])),
            "doc0_changed": not torch.equal(logits[0][:, :first], logits[1][:, :first])}


def padded_parity(ctx, P, backend="ulysses", cfg_kwargs=None, model_type="llama", prepare=None, S=64, left=0,
                  real=41, **overrides):
    """B=2 rows: row 0 one full document, row 1 padded (``left`` tokens before, the rest after
    ``real`` tokens). Real tokens match each row run alone; padding is never attended nor counted."""
    import copy

    import torch.distributed as dist

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.sharding.batch import global_num_items, shift_labels
    from ringmaster_tools.parity import group_mean_grad_errors, padded_rows, rel_err, tiny_model

    if model_type == "llama" and not overrides:
        overrides = dict(num_attention_heads=8, num_key_value_heads=2)
    model = tiny_model(model_type, **overrides)
    if prepare is not None:
        prepare(model)
    reference = copy.deepcopy(model)
    vocab = model.config.vocab_size
    batch = padded_rows(vocab, S, left, real)
    ids, labels = batch["input_ids"], batch["labels"]
    total = global_num_items(batch)
    ref_loss, ref_logits = 0.0, []
    for row, (a, b) in ((0, (0, S)), (1, (left, left + real))):
        lab = labels[row:row + 1, a:b]
        out = reference(input_ids=ids[row:row + 1, a:b], labels=lab, shift_labels=shift_labels(lab),
                        position_ids=torch.arange(a, b)[None], num_items_in_batch=total, use_cache=False)
        ref_loss = ref_loss + out.loss
        ref_logits.append(out.logits)
    ref_loss.backward()
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {})),
                      device_mesh=ctx.mesh(P))
    try:
        with context_parallel_region(batch) as shard:
            out = model(**shard)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
        errs, _, total_err = group_mean_grad_errors(model, reference, runtime.cp_group, P)
    finally:
        rm.unwire(model)
        rm.teardown()
    return {"loss_err": rel_err(loss / P, ref_loss.detach()),
            "logits_err": max(rel_err(logits[0:1], ref_logits[0]),
                              rel_err(logits[1:2, left:left + real], ref_logits[1])),
            "grad_err": max(errs.values()), "grad_err_total": total_err, "nan": bool(torch.isnan(logits).any())}


def vlm_parity(ctx, model_type, P, backend="ulysses", image_at=28, cfg_kwargs=None, fp64=False):
    """A VLM with one image whose tokens straddle a shard edge, against the same model without CP
    (``fp64``: in float64 under ``keep_fp64``)."""
    from functools import partial

    from ringmaster_tools.parity import compare, tiny_vlm, vlm_batch

    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    return compare(model_type, cfg, device_mesh=ctx.mesh(P), build=tiny_vlm,
                   batch=partial(vlm_batch, seq_len=64, image_at=image_at), fp64=fp64)


def _cp_step(ctx, model, P, cfg_kwargs, batch):
    """One CP forward+backward; returns (mean loss, gathered logits, CP-averaged grads) and unwires."""
    import torch.distributed as dist

    from ringmaster.adapters.raw import context_parallel_region

    runtime = rm.wire(model, rm.RingmasterConfig(size=P, **cfg_kwargs), device_mesh=ctx.mesh(P))
    try:
        with context_parallel_region(batch) as shard:
            out = model(**shard)
        out.loss.backward()
        loss = out.loss.detach().float().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
        grads = []
        for p in model.parameters():
            g = p.grad.detach().float().clone()
            dist.all_reduce(g, group=runtime.cp_group)
            grads.append(g / P)
    finally:
        rm.unwire(model)
        rm.teardown()
    return loss / P, logits, grads


def bf16_gap(ctx, P, cfg_kwargs, model_type="llama", overrides=None):
    """bf16 CP and bf16 non-CP, both measured against the fp32 single-device truth."""
    import copy

    from ringmaster_tools.parity import rel_err, tiny_batch, tiny_model

    truth = tiny_model(model_type, **(overrides or {}))
    batch = tiny_batch(128, 128)
    out = truth(**batch)
    out.loss.backward()
    ref_grads = [p.grad.float() for p in truth.parameters()]
    half = copy.deepcopy(truth).to(torch.bfloat16)
    half.zero_grad(set_to_none=True)
    cp_model = copy.deepcopy(half)
    h = half(**batch)
    h.loss.backward()
    loss_cp, _, grads_cp = _cp_step(ctx, cp_model, P, cfg_kwargs, batch)

    def grad_gap(grads):
        return max(rel_err(g.float(), r, 1e-4 * max(float(x.abs().max()) for x in ref_grads))
                   for g, r in zip(grads, ref_grads))

    return {"loss_noncp": abs(h.loss.item() - out.loss.item()) / out.loss.item(),
            "loss_cp": abs(loss_cp.item() - out.loss.item()) / out.loss.item(),
            "grad_noncp": grad_gap([p.grad for p in half.parameters()]),
            "grad_cp": grad_gap(grads_cp)}


def determinism(ctx, P, cfg_kwargs, model_type="llama"):
    """Two CP runs from the same seed and batch are bit-identical."""
    from ringmaster_tools.parity import packed_batch, tiny_model

    runs = []
    for _ in range(2):
        model = tiny_model(model_type, num_attention_heads=8, num_key_value_heads=2)
        runs.append(_cp_step(ctx, model, P, cfg_kwargs, packed_batch(128, [20, 30, 14])))
    (l0, o0, g0), (l1, o1, g1) = runs
    return torch.equal(l0, l1) and torch.equal(o0, o1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def parity_variants(ctx, model_type, P, attn="sdpa", overrides=None, backend="ulysses", variants=(), seq_len=64):
    """:func:`parity` for each ``cfg_kwargs`` in ``variants``, in one job: the model is built and its reference
    (the same model without CP, forward and backward) run once, shared by every variant (``compare``'s
    ``build`` / ``reference``: the same seeded weights and batch as :func:`parity` builds for each)."""
    import copy

    from ringmaster_tools.parity import _plain_forward, compare, tiny_batch, tiny_model

    base = tiny_model(model_type, attn, 0, **(overrides or {}))
    batch = tiny_batch(base.config.vocab_size, seq_len, 1, seed=1)
    reference = copy.deepcopy(base)
    ref_out = _plain_forward(reference, batch)
    ref_out.loss.backward()
    out = []
    for cfg_kwargs in variants:
        cfg = rm.RingmasterConfig(size=P, backend=backend, **cfg_kwargs)
        out.append(compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), attn_implementation=attn,
                           batch=batch, build=lambda *a, **k: copy.deepcopy(base), reference=(reference, ref_out)))
    return out
