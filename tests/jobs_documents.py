"""Jobs for load_balance="documents" (length-aware CP): run on every rank by the gloo pool."""

from __future__ import annotations

import contextlib

import ringmaster as rm


def documents_parity(ctx, P, model_type, backend, doc_lens, threshold=None, cfg_kwargs=None, fp64=False,
                     via="region", mutation=None, overrides=None, checkpointing=False, compiled=False):
    """A packed row under ``load_balance="documents"`` against every document run alone (token-weighted):
    loss, gathered logits, every gradient. ``mutation``: a name from :data:`MUTATIONS`, applied while the CP
    model runs; ``checkpointing``: every decoder layer recomputed in backward (HF gradient checkpointing);
    ``compiled``: wired as for torch.compile, run eagerly (a compiled runtime's parts: the whole part's spare tokens,
    something split where anything can be)."""
    from ringmaster_tools.parity import compare, packed_batch, per_document_forward

    cfg = rm.RingmasterConfig(size=P, backend=backend, load_balance="documents", documents_threshold=threshold,
                              **(cfg_kwargs or {}))
    extra = {"attn_implementation": ATTN.get(model_type, "sdpa"), **(overrides or {})}
    with (MUTATIONS[mutation]() if mutation else contextlib.nullcontext()):
        return compare(model_type, cfg, device_mesh=ctx.mesh(P), prepare=_prepare(model_type, checkpointing),
                       batch=lambda m: packed_batch(m.config.vocab_size, list(doc_lens)),
                       reference_forward=per_document_forward, fp64=fp64, via=via, compiled=compiled, **extra)


ATTN = {"rwkv": "eager", "xlstm": "eager"}   # attention-free families: transformers refuses sdpa for them


def _prepare(model_type, checkpointing=False):
    """Slow decays (state survives across shards; any A_log shape, Mamba1's [d, n] too), plus what the family's
    own parity jobs prepare: MiniMax's decay buffers recomputed in the model's dtype, xLSTM's input-dependent
    gates; ``checkpointing``: HF gradient checkpointing on."""
    from jobs_linear_recurrent import wide_decays
    from jobs_mamba1 import slow_decay
    from jobs_xlstm import random_gates

    extra = {"minimax": wide_decays, "xlstm": random_gates}.get(model_type)

    def prepare(model):
        slow_decay(model)
        if extra is not None:
            extra(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
    return prepare


def logprobs_parity(ctx, P, backend, doc_lens, threshold):
    """``rm.token_logprobs`` (with entropy) on a documents shard of an fp64 llama against every document run alone:
    the gathered values in row order, and the gradient of a fixed weighted sum of them."""
    import copy

    import torch

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.sharding.batch import shift_labels
    from ringmaster_tools.parity import group_mean_grad_errors, keep_fp64, packed_batch, per_document_forward, tiny_model

    with keep_fp64():
        model = tiny_model("llama", dtype=torch.float64, num_attention_heads=8, num_key_value_heads=2)
        reference = copy.deepcopy(model)
        batch = packed_batch(model.config.vocab_size, list(doc_lens))
        labels = shift_labels(batch["labels"])
        logits = per_document_forward(reference, batch).logits.double()
        logp = logits.log_softmax(-1)
        ref_lp = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1).masked_fill(labels == -100, 0.0)
        ref_ent = -(logp.exp() * logp).sum(-1).masked_fill(labels == -100, 0.0)
        g = torch.Generator().manual_seed(11)
        w1, w2 = (torch.randn(labels.shape, generator=g, dtype=torch.float64) for _ in range(2))
        ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()
        cfg = rm.RingmasterConfig(size=P, backend=backend, load_balance="documents", documents_threshold=threshold)
        runtime = rm.wire(model, cfg, device_mesh=ctx.mesh(P))
        try:
            with context_parallel_region(batch, runtime=runtime) as shard:
                local_labels = shard.pop("shift_labels")
                for key in ("labels", "num_items_in_batch"):
                    shard.pop(key)
                hidden = model(**shard, output_hidden_states=True, logits_to_keep=1)
                lp, ent = rm.token_logprobs(hidden, local_labels, model=model, batch=shard, entropy=True, chunk_size=7)
            ((lp * w1).sum() + (ent * w2).sum()).backward()
            errs, missing, _ = group_mean_grad_errors(model, reference, runtime.cp_group, P)
        finally:
            rm.unwire(model)
            rm.teardown()
    scale = ref_lp.abs().max()
    return {"lp_err": float((lp.detach() - ref_lp).abs().max() / scale),
            "ent_err": float((ent.detach() - ref_ent).abs().max() / ref_ent.abs().max()),
            "grad_err": max(errs.values()), "missing": missing}


@contextlib.contextmanager
def _twice():
    """A whole document assigned to two ranks: the first whole document of rank 0 is also rank 1's."""
    from unittest import mock

    from ringmaster.sharding import assignment

    real = assignment.assign

    def assign(*args, **kwargs):
        a = real(*args, **kwargs)
        whole = [list(w) for w in a.whole]
        if whole[0] and len(whole) > 1 and whole[1]:
            whole[1][0] = whole[0][0]
        import dataclasses
        return dataclasses.replace(a, whole=tuple(tuple(w) for w in whole))

    with mock.patch.object(assignment, "assign", assign):
        yield


@contextlib.contextmanager
def _state_not_passed():
    """A split document's recurrent state is not passed: the split part runs as if each rank were alone."""
    import importlib
    import pkgutil
    from unittest import mock

    import ringmaster.recurrent as recurrent
    from ringmaster.recurrent import scan

    def alone(segments, *args, **kwargs):
        return scan.simulate_sequential(segments)

    with contextlib.ExitStack() as stack:
        for info in pkgutil.iter_modules(recurrent.__path__):
            module = importlib.import_module(f"ringmaster.recurrent.{info.name}")
            if getattr(module, "pass_state", None) is scan.pass_state:
                stack.enter_context(mock.patch.object(module, "pass_state", alone))
        yield


@contextlib.contextmanager
def _local_sees_split():
    """The local attention is given the split document's keys: each rank's whole documents run together with its
    piece of the split documents, and its first whole document attends to that piece (as one document)."""
    from unittest import mock

    import torch

    from ringmaster.attention import register, ulysses
    from ringmaster.sharding.documents import CPBatch, Runs

    real = register._documents

    def mutated(fn, binding, module, query, key, value, cpb, kwargs):
        out, _ = real(fn, binding, module, query, key, value, cpb, kwargs)   # the collectives as they were
        n, whole = cpb.split_share, cpb.whole_part()
        if whole is None or n == 0:
            return out, None
        N = query.shape[2]
        runs = Runs(N, ((0,) + tuple(n + s for s in whole.runs.row(0)[1:]),))
        merged = CPBatch(0, 1, "contiguous", N, cpb._part_ids(runs), runs=runs, origin=cpb.local_positions())
        kw = {k: v for k, v in kwargs.items() if k not in ulysses.LOCAL_ONLY_KWARGS}
        local = ulysses.local_attention(module, query, key, value, binding=binding, cpb=merged, **kw)[0]
        return torch.cat([out[:, :n], local[:, n:]], dim=1), None

    with mock.patch.object(register, "_documents", mutated):
        yield


MUTATIONS = {"whole_on_two_ranks": _twice, "split_state_not_passed": _state_not_passed,
             "local_sees_split_keys": _local_sees_split}
