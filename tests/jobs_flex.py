"""Jobs for tests/test_flex.py: Ulysses over HF's flex_attention, forward only (flex_attention has
no CPU backward in torch 2.13), against the same model run with sdpa and without CP."""

from __future__ import annotations

import copy

import torch

import ringmaster as rm


def _padded_rows(vocab: int, S: int) -> dict[str, torch.Tensor]:
    from ringmaster_tools.parity import padded_rows

    return padded_rows(vocab, S)


def flex_forward_parity(ctx, P, model_type="llama", overrides=None, kind="plain", seq_len=64):
    """Ulysses(flex_attention) at CP size P vs the same weights with sdpa and no CP: loss and
    gathered logits, under no_grad. ``kind``: "plain" (one causal row), "packed" (documents of
    one row, each run alone as reference) or "padded" (B=2, row 1 padded both sides)."""
    import torch.distributed as dist

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import (_plain_forward, packed_batch, per_document_forward, per_row_forward,
                                           rel_err, tiny_batch, tiny_model)

    model = tiny_model(model_type, "flex_attention", **(overrides or {})).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    vocab = model.config.vocab_size
    if kind == "plain":
        batch, ref_fwd = tiny_batch(vocab, seq_len), _plain_forward
    elif kind == "packed":
        batch, ref_fwd = packed_batch(vocab, [20, 30, 14]), per_document_forward
    elif kind == "padded":
        batch, ref_fwd = _padded_rows(vocab, seq_len), per_row_forward
    else:
        raise ValueError(kind)
    with torch.no_grad():
        ref = ref_fwd(reference, batch)

    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        with torch.no_grad(), rm.profile_comms() as comms, context_parallel_region(batch) as shard:
            out = model(**shard)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        loss = loss / P
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
    finally:
        rm.unwire(model)
        rm.teardown()
    if kind == "padded":  # padding tokens' logits are nobody's business
        keep = batch["attention_mask"].bool()
        logits, ref_logits = logits[keep], ref.logits[keep]
    else:
        ref_logits = ref.logits
    return {
        "cp_size": P,
        "attn": model.config._attn_implementation,
        "attention_layers": len(runtime.report.attention),
        "a2a_bytes": comms.total_bytes("all_to_all"),
        "loss_ref": float(ref.loss),
        "loss_err": abs(loss.item() - float(ref.loss)) / abs(float(ref.loss)),
        "logits_err": rel_err(logits, ref_logits),
    }


def flex_causality(ctx, P=1, model_type="llama", overrides=None, seq_len=64):
    """Wired flex model: changing the last token must leave every earlier position's logits unchanged."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model(model_type, "flex_attention", **(overrides or {})).eval()
    vocab = model.config.vocab_size
    rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        logits = []
        for shift in (0, 17):
            batch = tiny_batch(vocab, seq_len)
            batch["input_ids"][:, -1] = (batch["input_ids"][:, -1] + shift) % vocab
            with torch.no_grad(), context_parallel_region(batch) as shard:
                logits.append(rm.gather_sequence(model(**shard).logits, dim=1))
    finally:
        rm.unwire(model)
        rm.teardown()
    a, b = logits
    return {"pos0_diff": (a[:, 0] - b[:, 0]).abs().max().item(),
            "earlier_diff": (a[:, :-1] - b[:, :-1]).abs().max().item(),
            "last_diff": (a[:, -1] - b[:, -1]).abs().max().item()}
