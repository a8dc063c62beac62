"""Jobs for tests/test_features.py: chunked attention (llama4), cross-layer KV sharing (gemma3n) and
the refusals, each run through the model-level parity harness on every rank of the gloo pool."""

from __future__ import annotations

from contextlib import contextmanager

import torch

import ringmaster as rm

# llama4 text, tiny: layers 0-2 chunked (RoPE), layer 3 full attention (NoPE, with query temperature
# tuning whose floor_scale the test sequence crosses); chunks of 10 cut across the shards of 48 tokens
LLAMA4 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=10,
              num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], intermediate_size_mlp=128, num_local_experts=2,
              interleave_moe_layer_step=2, floor_scale=4, attn_scale=10.0)
# gemma3n text, tiny: layers 2-3 reuse the K/V of layers 0-1 (kv_sharing_modes store, store, reuse, reuse)
GEMMA3N = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, num_kv_shared_layers=2,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
               sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, laurel_rank=8,
               altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4, intermediate_size=[128] * 4)
GEMMA4 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16, num_hidden_layers=4,
              num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                   "full_attention"],
              sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=128)
FAMILIES = {"llama4_text": LLAMA4, "gemma3n_text": GEMMA3N, "gemma4_text": GEMMA4}
_KEYS = ("backend", "layout", "loss_err", "logits_err", "grad_err", "worst_param", "n_grads", "n_params",
         "attention_layers", "grad_err_total")


def _padded(vocab: int, S: int):
    from ringmaster_tools.parity import padded_rows

    return padded_rows(vocab, S)


def parity(ctx, model_type, P, backend, seq_len=48, cfg_kwargs=None, attn_implementation="sdpa", overrides=None,
           packed=None):
    """``compare`` for a family of FAMILIES; ``packed``: document lengths of one packed row (position_ids
    restart per document), the reference being HF's own forward of that row: its chunked mask counts
    chunks from each document's start, its temperature from the row index."""
    from ringmaster_tools.parity import compare, packed_batch

    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    extra = {}
    if packed is not None:
        extra = dict(batch=lambda model: packed_batch(model.config.vocab_size, packed))
    r = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), attn_implementation=attn_implementation,
                **extra, **{**FAMILIES[model_type], **(overrides or {})})
    return {k: r[k] for k in _KEYS}


def chunks_from_local_positions(P: int):
    """Mutation: chunk boundaries counted from each shard's local positions (restarting at every
    ``S / P`` tokens) instead of the global row."""
    from ringmaster.sharding import documents

    def chunk_doc_ids(doc_ids, seq_len, chunk, device=None):
        local = torch.arange(seq_len, device=device) % (seq_len // P)
        return (torch.arange(seq_len, device=device) // (seq_len // P) * seq_len + local // chunk).unsqueeze(0)

    return [(documents, "chunk_doc_ids", chunk_doc_ids)]


def temperature_from_local_positions(P: int):
    """Mutation: llama4's NoPE query temperature left as HF computes it on the shard (local index)."""
    from ringmaster.attention import layer_rules

    return [(layer_rules, "global_temperature", lambda module, query, cpb: query)]


MUTATIONS = {f.__name__: f for f in (chunks_from_local_positions, temperature_from_local_positions)}


@contextmanager
def applied(mutation: str, P: int):
    saved = []
    try:
        for module, attr, value in MUTATIONS[mutation](P):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def mutated_parity(ctx, mutation, model_type, P, backend, **kwargs):
    clean = parity(ctx, model_type, P, backend, **kwargs)
    with applied(mutation, P):
        try:
            mutated = parity(ctx, model_type, P, backend, **kwargs)
        except Exception as exc:
            mutated = {"raised": (type(exc).__name__, str(exc))}
        finally:
            rm.teardown()
    return {"clean": clean, "mutated": mutated}


def refusal(ctx, model_type, P, backend, seq_len=48, overrides=None, call_kwargs=None, cfg_kwargs=None):
    """Run one CP forward expected to raise; ``(type name, message)`` of what it raised, or None."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model(model_type, **{**FAMILIES[model_type], **(overrides or {})})
    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    try:
        rm.wire(model, cfg, device_mesh=ctx.mesh(P))
        batch = tiny_batch(model.config.vocab_size, seq_len)
        with context_parallel_region(batch) as shard:
            model(**shard, **(call_kwargs or {}))
        return None
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    finally:
        rm.unwire(model)
        rm.teardown()


def flash_parity(ctx, model_type, P, backend, seq_len=48, ring_impl="auto", flash_name="flash_attention_2"):
    """``parity`` with the model's attention named a flash kernel (the CPU stand-in, via LOCAL_KERNELS):
    Ulysses calls its varlen function with the chunk documents as ``cu_seqlens``; Ring's hub provider
    gets them as block segments. The reference runs sdpa without CP (HF's own chunked mask refuses
    flash when the sequence is longer than a chunk)."""
    from jobs_ring import _sdpa_reference, as_flash_model

    from ringmaster_tools.parity import _plain_forward, compare

    extra = {"ring_impl": ring_impl} if backend == "ring" else {}
    cfg = rm.RingmasterConfig(size=P, backend=backend, **extra)
    r = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), attn_implementation="sdpa",
                prepare=lambda m: as_flash_model(m, flash_name), reference_forward=_sdpa_reference(_plain_forward),
                **FAMILIES[model_type])
    return {k: r[k] for k in _KEYS}
