"""Jobs for tests/test_selfattn.py: families whose attention modules compute attention themselves, wired
through a SelfAttentionSite (run on every rank of the pool). Float64 parity against the same model
without CP: loss, gathered logits, every parameter gradient against its own norm."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist

import ringmaster as rm
from ringmaster.adapters.raw import context_parallel_region
from ringmaster_tools.parity import (compare, group_mean_grad_errors, keep_fp64, padded_rows, per_row_forward,
                                       rel_err, tiny_model)

# tiny configs: 4 heads, 2 layers, no dropout; gpt_neo's second layer is "local" with a window that cuts
# the 64-token sequence; falcon in its three head layouts
TINY = {
    "falcon": dict(num_attention_heads=4, num_hidden_layers=2),
    "falcon_gqa": dict(num_attention_heads=4, num_hidden_layers=2, new_decoder_architecture=True, num_kv_heads=2),
    "falcon_mha": dict(num_attention_heads=4, num_hidden_layers=2, multi_query=False, parallel_attn=False),
    "gpt_neo": dict(num_heads=4, num_layers=2, attention_types=[[["global", "local"], 1]], window_size=8),
    "gpt_neox_japanese": dict(num_attention_heads=4, num_hidden_layers=2),
    "bloom": dict(num_attention_heads=4),
    "bloom_6h": dict(num_attention_heads=6, hidden_size=96),
    "mpt": dict(num_attention_heads=4),
    "megatron-bert": dict(num_attention_heads=4, is_decoder=True, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0),
    "megatron-bert_bidi": dict(num_attention_heads=4, is_decoder=False, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0),
    "rembert": dict(num_attention_heads=4, is_decoder=True, input_embedding_size=64, output_embedding_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
    "roformer": dict(num_attention_heads=4, is_decoder=True, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0),
    "roformer_rv": dict(num_attention_heads=4, is_decoder=True, rotary_value=True, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0),
    "xlm": dict(n_heads=4, n_layers=2, dropout=0.0, attention_dropout=0.0, pad_index=2),  # 2: not in the batch
    "xlm_causal": dict(n_heads=4, n_layers=2, dropout=0.0, attention_dropout=0.0, pad_index=2, causal=True),
    "trocr": dict(decoder_attention_heads=4, decoder_layers=2, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0),
    "openai-gpt": dict(n_embd=64, n_head=4, n_layer=2, n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0,
                       embd_pdrop=0.0),
}
# parameters with no gradient even without CP: cls.predictions.bias (the decoder's bias is the one used), and
# roformer's frozen sinusoid table; trocr's idle cross-attention (encoder_attn and its layer norm, 2 layers)
UNUSED = {"megatron-bert": 1, "roformer": 2, "trocr": 20}
KEYS = ("loss_err", "logits_err", "grad_err", "worst_param", "n_grads", "n_params", "attention_layers", "backend")


def model_type_of(case: str) -> str:
    return case.split("_gqa")[0].split("_mha")[0].split("_6h")[0].split("_bidi")[0].split("_rv")[0].split("_causal")[0]


def _attn(case):
    return "sdpa" if model_type_of(case) == "falcon" else "eager"


def parity(ctx, case, P, backend="ulysses", seq_len=64, extra=None):
    cfg = rm.RingmasterConfig(size=P, backend=backend)
    r = compare(model_type_of(case), cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), fp64=True,
                attn_implementation=_attn(case), **{**TINY[case], **(extra or {})})
    return {**{k: r[k] for k in KEYS}, "n_params": r["n_params"] - UNUSED.get(model_type_of(case), 0)}


def padded_parity(ctx, case, P, backend="ulysses", S=64, left=3, real=41):
    """B=2: row 0 one full document, row 1 ``left`` padding tokens, ``real`` tokens, padding. The model's
    own (local) padding mask is dropped by the site; the batch's document ids rebuild it. The reference
    runs each row's real tokens alone at their global positions; logits are compared on real tokens."""
    with keep_fp64():
        model = tiny_model(model_type_of(case), _attn(case), dtype=torch.float64, **TINY[case])
        reference = copy.deepcopy(model)
        batch = padded_rows(model.config.vocab_size, S, left, real)
        ref = per_row_forward(reference, batch)
        ref.loss.backward()
        runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
        try:
            with context_parallel_region(batch) as shard:
                out = model(**shard)
            out.loss.backward()
            loss = out.loss.detach().clone()
            dist.all_reduce(loss, group=runtime.cp_group)
            logits = rm.gather_sequence(out.logits.detach(), dim=1)
            errs, _, _ = group_mean_grad_errors(model, reference, runtime.cp_group, P)
        finally:
            rm.unwire(model)
            rm.teardown()
    real_rows = [(0, slice(0, S)), (1, slice(left, left + real))]
    return {"loss_err": rel_err(loss / P, ref.loss.detach()),
            "logits_err": max(rel_err(logits[r, s], ref.logits[r, s]) for r, s in real_rows),
            "grad_err": max(errs.values()), "worst_param": max(errs, key=errs.get),
            "n_grads": len(errs), "n_params": sum(1 for _ in model.parameters()), "attention_layers": 2}


# -- mutations: each returns [(module, attribute, replacement)] patched inside the worker ---------------------

def window_ignored():
    """Local layers run as global ones: the site's window is never passed to the CP attention."""
    return [("ringmaster.attention.selfattn", "site_window", lambda site, module, path="": None)]


def scale_ignored():
    """The site's declared scale is dropped: every layer scales by 1/sqrt(head_dim)."""
    return [("ringmaster.attention.selfattn", "site_scale", lambda site, module, head_dim: head_dim ** -0.5)]


def not_causal():
    """The site calls the CP attention as bidirectional (the model's causal mask was dropped)."""
    from ringmaster.attention import selfattn

    original = selfattn._call

    def call(fn, module, site, slot, path, q, k, v, dropout=0.0, scale=None, alibi=None, causal=None):
        def bidirectional(module, q, k, v, mask, **kwargs):
            return fn(module, q, k, v, mask, **{**kwargs, "is_causal": False})
        return original(bidirectional, module, site, slot, path, q, k, v, dropout, scale, alibi, causal)

    return [("ringmaster.attention.selfattn", "_call", call)]


def causality_ignored():
    """The site ignores the module's causal flag (BERT's is_decoder) and always attends causally."""
    return [("ringmaster.attention.selfattn", "site_causal", lambda site, module: True)]


def rotary_at_local_positions():
    """roformer: the site keeps the rotary table the model looked up for the local length."""
    return [("ringmaster.attention.selfattn", "_global_rotary",
             lambda site, module, table, slot, path, q, k, v: (q, k, v))]


def one_site_unwired():
    """wire leaves the first attention module's own (local) attention in place."""
    from ringmaster import wiring

    original = wiring.wire_sites

    def wire_sites(model, spec, binding, modules, **kw):
        return original(model, spec, binding, dict(list(modules.items())[1:]), **kw)

    return [("ringmaster.wiring", "wire_sites", wire_sites)]


def alibi_slopes_not_sliced():
    """Ulysses: every rank uses the first heads' ALiBi slopes, not those of the heads it computes."""
    return [("ringmaster.attention.ulysses", "local_heads", lambda per_head, rank, count: per_head[:count])]


def ring_alibi_offset_ignored():
    """Ring: every block's ALiBi bias is computed as if its key chunk were the query chunk (offset 0)."""
    import dataclasses

    from ringmaster.attention.ring import loop

    original = loop.block_pairs

    def block_pairs(plan, src, device, rel=None):
        return [(qi, kj, dataclasses.replace(m, alibi_offset=0)) for qi, kj, m in original(plan, src, device, rel)]

    return [("ringmaster.attention.ring.loop", "block_pairs", block_pairs)]


def positions_not_steered():
    """trocr: the position table keeps the local numbering (0..S/P-1 on every rank): no pre-hook."""
    from types import SimpleNamespace

    return [("ringmaster.attention.selfattn", "_steer_positions",
             lambda model, site, slot: SimpleNamespace(remove=lambda: None))]


def batch_rule_skipped():
    """xlm: no batch rule, so a row with leading pad tokens runs with each shard's local padding mask."""
    return [("ringmaster.attention.selfattn", "_check_batch", lambda *a: None)]


def local_mean_loss():
    """xlm / trocr: each rank's loss stays the mean over its own shard's labels."""
    from types import SimpleNamespace

    return [("ringmaster.attention.selfattn", "_global_mean_loss",
             lambda model, site, slot, group: SimpleNamespace(remove=lambda: None))]


def xlm_padded(ctx, case, P, backend="ulysses", left=0, real=41, S=64, mutation=None):
    """xlm on B=2 rows (row 1: ``left`` pad tokens, ``real`` tokens, pad tokens up to ``S``; input_ids are
    pad_index where attention_mask is 0) against the same padded batch without CP (XLMModel's own
    padding mask is the truth). Returns the errors, or ``{"raised": (type, message)}``."""
    model_type = model_type_of(case)
    batch = padded_rows(128, S, left, real)
    batch["input_ids"][batch["attention_mask"] == 0] = 2   # XLMConfig.pad_index
    cfg = rm.RingmasterConfig(size=P, backend=backend)
    try:
        with applied(mutation) if mutation else _nothing():
            r = compare(model_type, cfg, device_mesh=ctx.mesh(P), fp64=True, batch=batch,
                        attn_implementation="eager", **TINY[case])
    except Exception as exc:  # the test asserts on the type and message
        return {"raised": (type(exc).__name__, str(exc))}
    finally:
        rm.teardown()
    return {k: r[k] for k in KEYS}


@contextmanager
def _nothing():
    yield


MUTATIONS = {f.__name__: f for f in (window_ignored, positions_not_steered, batch_rule_skipped, local_mean_loss, scale_ignored, not_causal, causality_ignored, one_site_unwired,
                                     rotary_at_local_positions,
                                     alibi_slopes_not_sliced, ring_alibi_offset_ignored)}


@contextmanager
def applied(name):
    import importlib

    saved = []
    try:
        for target, attr, value in MUTATIONS[name]():
            module = importlib.import_module(target)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def mutated_parity(ctx, mutation, case, P, backend="ulysses", seq_len=64):
    """``{"clean": errors, "mutated": errors | {"raised": (type, message)}}`` on this rank."""
    clean = parity(ctx, case, P, backend, seq_len)
    with applied(mutation):
        try:
            mutated = parity(ctx, case, P, backend, seq_len)
        except Exception as exc:  # the test asserts on the type and message
            mutated = {"raised": (type(exc).__name__, str(exc))}
        finally:
            rm.teardown()
    return {"clean": clean, "mutated": mutated}
