"""Jobs for tests/test_position_embeddings.py: families with learned absolute position tables (GPT-2,
OPT, RoBERTa, BioGPT) under CP against the same model on one device, in float64.

The reference is the model's own single-device run of the *full* batch with no position_ids (its own
numbering: arange, OPT's attention-mask cumsum, RoBERTa's pad-token cumsum), which is what a
trainer without CP runs. Padded rows compare logits at the real tokens only (padding is never
attended, never counted, and its logits are whatever each side makes of a masked row).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist

import ringmaster as rm

S = 64


def build(family: str):
    from ringmaster_tools.zoo import build_tiny

    return build_tiny(family)   # the zoo's tiny config (BERT-likes as decoders), float64


def make_batch(model, kind: str) -> dict[str, torch.Tensor]:
    """``dense``: one random row (token ids include the pad id, which RoBERTa's numbering skips);
    ``padded``: B=2, row 1 with pad tokens (attention_mask 0, labels -100) on both sides;
    ``packed``: one row of three documents with restarting position_ids (given by the batch);
    ``embeds``: the padded batch as ``inputs_embeds``."""
    from ringmaster_tools.parity import packed_batch, padded_rows, tiny_batch

    cfg = model.config.get_text_config()
    vocab, pad = cfg.vocab_size, cfg.pad_token_id if cfg.pad_token_id is not None else 0
    if kind == "dense":
        return tiny_batch(vocab, S, batch_size=2, seed=1)
    if kind == "packed":
        return packed_batch(vocab, [20, 30, 14])
    batch = padded_rows(vocab, S, left=5, real=41)
    batch["input_ids"][batch["attention_mask"] == 0] = pad
    if kind == "embeds":
        ids = batch.pop("input_ids")
        with torch.no_grad():
            batch["inputs_embeds"] = model.get_input_embeddings()(ids)
    return batch


def _rel(a, b) -> float:
    from ringmaster_tools.parity import rel_err

    return rel_err(a, b)


def parity(ctx, family: str, kind: str, cases, mutation: str | None = None) -> list[dict]:
    """One result per ``(backend, P, load_balance, via)`` case: loss, real-token logits, every
    parameter's gradient (each against its own norm) vs the single-device run."""
    from ringmaster_tools.parity import group_mean_grad_errors, keep_fp64

    ctx.uses(P for _, P, _, _ in cases)
    base = build(family)
    out = []
    for backend, P, lb, via in cases:
        if ctx.repeats(P):   # the first CP group of P runs it (a solo pool); this rank's results lack it
            continue
        with keep_fp64(), mutated(mutation):
            out.append(_case(ctx, base, kind, backend, P, lb, via, group_mean_grad_errors))
    return out


def _case(ctx, base, kind, backend, P, lb, via, group_mean_grad_errors) -> dict:
    from ringmaster.adapters.raw import context_parallel_region

    model = copy.deepcopy(base)
    reference = copy.deepcopy(base)
    batch = make_batch(model, kind)
    if kind == "packed":   # documents never see each other: each runs alone, numbered from 0 like its given ids
        from ringmaster_tools.parity import per_document_forward

        ref = per_document_forward(reference, batch)
    else:
        ref = reference(**batch, use_cache=False)
    ref.loss.backward()
    cfg = rm.RingmasterConfig(size=P, backend=backend, **({"load_balance": lb} if lb else {}))
    runtime = rm.wire(model, cfg, device_mesh=ctx.mesh(P))
    result = {"backend": backend, "P": P, "layout": runtime.shard_load_balance, "via": via,
              "positions": runtime.report.positions}
    try:
        if via == "region":
            with context_parallel_region(batch, runtime=runtime) as shard:
                cp = model(**shard)
        else:
            manager = rm.ContextParallelContextManager([model], runtime.cp_group)
            handles = manager.install()
            try:
                cp = model(**batch)
            finally:
                for handle in handles:
                    handle.remove()
        cp.loss.backward()
        loss = cp.loss.detach().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        logits = rm.gather_sequence(cp.logits.detach(), dim=1, runtime=runtime)
        errs, missing, _ = group_mean_grad_errors(model, reference, runtime.cp_group, P)
    finally:
        rm.unwire(model)
        rm.teardown()
    real = batch.get("attention_mask", torch.ones(logits.shape[:2], dtype=torch.long)).bool()
    worst = max(errs, key=errs.get)
    result.update(loss_err=_rel(loss / P, ref.loss.detach()), logits_err=_rel(logits[real], ref.logits.detach()[real]),
                  grad_err=errs[worst], worst_param=worst, missing=missing, n_grads=len(errs))
    return result


@contextlib.contextmanager
def mutated(mutation: str | None):
    """``skip_rewrite``: the shard step passes ringmaster's plain global arange instead of the model's
    numbering (the first-forward accounting must trip); ``skip_rewrite_unchecked``: the same with
    the accounting's position check off too (the parity numbers must show it)."""
    from ringmaster.attention.accounting import Ledger
    from ringmaster.sharding.positions import PositionConvention

    with contextlib.ExitStack() as stack:
        if mutation in ("skip_rewrite", "skip_rewrite_unchecked"):
            stack.enter_context(mock.patch.object(PositionConvention, "apply", lambda self, kwargs: None))
        if mutation == "skip_rewrite_unchecked":
            stack.enter_context(mock.patch.object(Ledger, "position_problems", lambda self, kwargs: []))
        elif mutation is not None and mutation != "skip_rewrite":
            raise ValueError(mutation)
        yield


def mutated_error(ctx, family: str, kind: str, backend: str, P: int):
    """(type, message) of what a CP forward raises with the rewrite skipped, or None."""
    try:
        parity(ctx, family, kind, [(backend, P, None, "region")], mutation="skip_rewrite")
    except Exception as exc:  # the test asserts on type and message
        rm.teardown()
        return type(exc).__name__, str(exc)
    return None


# ---- the probe refuses what it cannot number
def _numbering(kind: str):
    """Break GPT-2's numbering: ``ignore_given`` drops the position_ids it is given; ``unknown``
    numbers a row without position_ids 0, 2, 4, ... (no rule ringmaster knows); ``also_read``
    keeps the table right but lets something else read position_ids (scales the hidden states)."""
    def prepare(model):
        inner = model.transformer
        forward = inner.forward

        def patched(*args, position_ids=None, **kwargs):
            ref = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            if ref is None and args:
                ref = args[0]
            if kind == "ignore_given":
                position_ids = None
            elif kind == "unknown" and position_ids is None:
                position_ids = 2 * torch.arange(ref.shape[1], device=ref.device)[None]
            out = forward(*args, position_ids=position_ids, **kwargs)
            if kind == "also_read" and position_ids is not None:
                out.last_hidden_state = out.last_hidden_state * 1.5
            return out

        inner.forward = patched
    return prepare


def wire_error(ctx, kind: str):
    """(type, message) of what ``rm.wire`` raises for a GPT-2 whose numbering was broken by ``kind``."""
    model = build("gpt2")
    _numbering(kind)(model)
    try:
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ulysses"), device_mesh=ctx.mesh(2))
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    finally:
        rm.unwire(model)
        rm.teardown()
    return None
