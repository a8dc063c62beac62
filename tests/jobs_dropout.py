"""Rank-side jobs of tests/test_dropout.py: dropout under CP (ringmaster/sharding/rng.py), on every rank of the pool."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from ringmaster.sharding import rng
from ringmaster_tools.parity import compare, group_mean_grad_errors, rel_err, tiny_batch, tiny_model

# tiny dims on top of each family's DEFAULT config (gpt2: every *_pdrop 0.1 and summary_first_dropout 0.1;
# gpt_neox: classifier_dropout 0.1, its hidden/attention dropout 0)
TINY = {
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, n_positions=256),
    "gpt_neox": dict(num_attention_heads=4),
}
GPT2_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # summary_first_dropout stays 0.1


def _no_fork():
    """Mutation: every rank's forward is seeded by the step seed alone (the fork's rank and index ignored), as
    if the state were not forked per rank."""
    original = rng.fork_seed
    rng.fork_seed = lambda base, rank, index: base
    return lambda: setattr(rng, "fork_seed", original)


MUTATIONS = {"no_fork": _no_fork}


def wire_default(ctx, model_type, P=2, backend="ulysses"):
    """What ``rm.wire`` raises for the family's default config (tiny dims), or None; and the config's dropout
    fields."""
    model = tiny_model(model_type, **TINY[model_type])
    fields = {k: v for k, v in vars(model.config).items() if "drop" in k}
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
    except Exception as exc:  # the test asserts on it
        return (type(exc).__name__, str(exc)), fields
    finally:
        rm.unwire(model)
        rm.teardown()
    return None, fields


def parity(ctx, model_type, backend, P=2, extra=None):
    """The family with its real dropout at 0 (fields the causal LM never reads left at their defaults) against
    the model without CP: loss, gathered logits, every gradient."""
    overrides = {**TINY[model_type], **(GPT2_NO_DROPOUT if model_type == "gpt2" else {}), **(extra or {})}
    r = compare(model_type, rm.RingmasterConfig(size=P, backend=backend), seq_len=64, device_mesh=ctx.mesh(P),
                **overrides)
    return {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param", "n_grads", "n_params")}


def _record(model, paths):
    """Forward hooks recording, per dropout module, the kept pattern (output != 0) of each call."""
    seen = {p: [] for p in paths}
    modules = dict(model.named_modules())
    handles = [modules[p].register_forward_hook(
        lambda m, a, out, p=p: seen[p].append((out != 0).detach().clone())) for p in paths]
    return seen, handles


DROPS = ("transformer.drop", "transformer.h.0.mlp.dropout", "transformer.h.1.attn.resid_dropout")


def masks(ctx, p=0.5, seeds=(0, 0, 1), P=2, mutation=None, checkpointing=False):
    """gpt2 (tiny) with residual/embedding dropout ``p`` in train mode under Ulysses: for each seed of ``seeds``
    (``torch.manual_seed`` before the step) the kept patterns of three dropout modules on this rank, as bool
    tensors [B, S/P, D]; the step's loss. ``mutation``: a name of :data:`MUTATIONS`."""
    undo = MUTATIONS[mutation]() if mutation else None
    model = tiny_model("gpt2", **TINY["gpt2"], resid_pdrop=p, embd_pdrop=p, attn_pdrop=0.0)
    if checkpointing:
        model.gradient_checkpointing_enable()
    batch = tiny_batch(model.config.vocab_size, 64, seed=3)
    rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    out = []
    try:
        for seed in seeds:
            torch.manual_seed(seed)
            seen, handles = _record(model, DROPS)
            try:
                with context_parallel_region(batch, model=model) as shard:
                    loss = model(**shard).loss
            finally:
                for h in handles:
                    h.remove()
            out.append({"masks": {k: v[0] for k, v in seen.items()}, "loss": loss.item()})
    finally:
        rm.unwire(model)
        rm.teardown()
        if undo:
            undo()
    return out


def dropout_exact(ctx, p=0.3, P=2, backend="ulysses", checkpointing=False, preserve_rng_state=True):
    """CP with dropout on equals the model without CP run with the masks the CP ranks drew: every nn.Dropout's
    kept pattern recorded on each rank, gathered to the full sequence, and applied in the reference (the same
    ``x * mask / (1 - p)``). Loss, gathered logits and every gradient's error. ``checkpointing``: the CP model
    recomputes its blocks in backward (HF gradient checkpointing; ``preserve_rng_state=False`` is the mutation:
    the recomputation draws new masks)."""
    model = tiny_model("gpt2", **TINY["gpt2"], resid_pdrop=p, embd_pdrop=p, attn_pdrop=0.0)
    reference = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "preserve_rng_state": preserve_rng_state})
    batch = tiny_batch(model.config.vocab_size, 64, seed=5)
    paths = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
    group = runtime.cp_group
    try:
        torch.manual_seed(11)
        seen, handles = _record(model, paths)
        try:
            with context_parallel_region(batch, model=model) as shard:
                out = model(**shard)
                out.loss.backward()
        finally:
            for h in handles:
                h.remove()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        logits = rm.gather_sequence(out.logits.detach(), dim=1)
        full = {k: rm.gather_sequence(v[0].float(), dim=1).bool() for k, v in seen.items()}

        modules = dict(reference.named_modules())
        hooks = [modules[k].register_forward_hook(
            lambda m, a, o, k=k: a[0] * full[k].to(a[0].dtype) / (1 - m.p)) for k in paths]
        try:
            ref = reference(**batch)
            ref.loss.backward()
        finally:
            for h in hooks:
                h.remove()
        errs, missing, total = group_mean_grad_errors(model, reference, group, P)
    finally:
        rm.unwire(model)
        rm.teardown()
    worst = max(errs, key=errs.get)
    return {"loss": rel_err(loss / P, ref.loss), "logits": rel_err(logits, ref.logits), "grad": errs[worst],
            "worst": worst, "grad_total": total, "missing": missing, "calls": {k: len(v) for k, v in seen.items()}}


def default_step(ctx, model_type="gpt2", backend="ulysses", P=2):
    """One training step of the family's default config (gpt2: attention dropout 0.1 too): its loss (finite)."""
    model = tiny_model(model_type, **TINY[model_type])
    batch = tiny_batch(model.config.vocab_size, 64, seed=3)
    rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
    try:
        with context_parallel_region(batch, model=model) as shard:
            loss = model(**shard).loss
            loss.backward()
    finally:
        rm.unwire(model)
        rm.teardown()
    return loss.item()
