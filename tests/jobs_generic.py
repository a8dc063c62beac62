"""Jobs for tests/test_generic.py: unregistered families through the generic path, refusals, and the
first-forward accounting guard (run on every rank of the pool)."""

from __future__ import annotations


import torch

import ringmaster as rm
from ringmaster.sharding import rng
from ringmaster_tools.parity import compare, tiny_batch, tiny_model

# per-family tiny overrides on top of testing.parity.COMMON (heads that split over 2 ranks, short windows)
GENERIC_TINY = {
    "phi3": dict(num_attention_heads=4, num_key_value_heads=2),
    "olmo2": dict(num_attention_heads=4, num_key_value_heads=2),
    "olmo": dict(num_attention_heads=4, num_key_value_heads=2),
    "granite": dict(num_attention_heads=4, num_key_value_heads=2),
    "glm4": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "glm": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "smollm3": dict(num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    output_router_logits=False, sliding_window=None),
    "cohere": dict(num_attention_heads=4, num_key_value_heads=2),
    "helium": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "stablelm": dict(num_attention_heads=4, num_key_value_heads=2),
    "phi": dict(num_attention_heads=4, num_key_value_heads=2),
    "gemma": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "starcoder2": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "exaone4": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "arcee": dict(num_attention_heads=4, num_key_value_heads=2),
    "seed_oss": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_dropout=0.0),
    "ministral": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None),
    "hunyuan_v1_dense": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "ernie4_5": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "apertus": dict(num_attention_heads=4, num_key_value_heads=2),
    "persimmon": dict(num_attention_heads=4),
    "phimoe": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                   sliding_window=None),
    "nemotron": dict(num_attention_heads=4, num_key_value_heads=2),
    "diffllama": dict(num_attention_heads=4, num_key_value_heads=2),
    "bitnet": dict(num_attention_heads=4, num_key_value_heads=2),
    "dbrx": dict(d_model=64, n_heads=4, attn_config=dict(kv_n_heads=2), ffn_config=dict(moe_num_experts=4,
                                                                                          moe_top_k=2, ffn_hidden_size=64)),
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, n_positions=256),
    "opt": dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
    "biogpt": dict(num_attention_heads=4),
}


def overrides_for(model_type: str, extra=None) -> dict:
    return {**GENERIC_TINY.get(model_type, {}), **(extra or {})}


def parity(ctx, model_type, P, backend="ulysses", extra=None, seq_len=64, prepare=None):
    cfg = rm.RingmasterConfig(size=P, backend=backend)
    r = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), prepare=prepare,
                **overrides_for(model_type, extra))
    return {k: r[k] for k in ("loss_err", "logits_err", "grad_err", "worst_param", "grad_err_total", "n_grads",
                              "n_params", "attention_layers", "backend")}


def sweep(ctx, families, P=2, backend="ulysses"):
    """family -> the parity summary, or ``("refused"|"error", message)``; never stops at the first one."""
    out = {}
    for mt in families:
        try:
            out[mt] = parity(ctx, mt, P, backend)
        except rm.UnsupportedLayerError as exc:
            out[mt] = ("refused", str(exc))
        except Exception as exc:  # reported per family by the sweep
            out[mt] = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            rm.teardown()
    return out


def add_feature_dropout(model):
    """A Dropout1d (whole channels, one draw shared along the sequence) in the first MLP."""
    model.model.layers[0].mlp.channel_drop = torch.nn.Dropout1d(0.1)


def wire_error(ctx, model_type, P=2, extra=None, prepare=None):
    """(type, message) of what ``rm.wire`` raises for this tiny model, or None."""
    model = tiny_model(model_type, **overrides_for(model_type, extra))
    if prepare is not None:
        prepare(model)
    try:
        rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc)
    finally:
        rm.unwire(model)
        rm.teardown()
    return None


# ---- mutations of a decoder layer: the batch dropped, attention over a pooled sequence / never called
def _drop_kwargs(layer):
    forward = layer.forward

    def no_kwargs(hidden_states, *args, **kwargs):
        kwargs.pop("ringmaster_batch", None)
        return forward(hidden_states, *args, **kwargs)

    layer.forward = no_kwargs


def _never(attn):
    """Attention computed by hand (plain causal sdpa on the local shard): the interface is bypassed."""
    import torch.nn.functional as F

    def local(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        B, S, _ = hidden_states.shape
        D = attn.head_dim
        q = attn.q_proj(hidden_states).view(B, S, -1, D).transpose(1, 2)
        k = attn.k_proj(hidden_states).view(B, S, -1, D).transpose(1, 2)
        v = attn.v_proj(hidden_states).view(B, S, -1, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(B, S, -1)), None

    attn.forward = local


def _pooled(attn):
    """A second attention call over every other token (a pooled sequence) next to the normal one."""
    forward = attn.forward

    def pooled(hidden_states, *args, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        out, weights = forward(hidden_states, *args, **kwargs)
        h = hidden_states[:, ::2]
        B, S, _ = h.shape
        q, k, v = (proj(h).view(B, S, -1, attn.head_dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj,
                                                                                        attn.v_proj))
        extra, _ = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation](
            attn, q, k, v, None, scaling=attn.scaling, ringmaster_batch=kwargs.get("ringmaster_batch"))
        return out + 0 * extra.sum(), weights

    attn.forward = pooled


def _own_mask(attn):
    """The model builds its own mask (as from the local cache_position) and hands it to the kernel."""
    forward = attn.forward

    def own(hidden_states, *args, **kwargs):
        S = hidden_states.shape[1]
        kwargs["attention_mask"] = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        return forward(hidden_states, *args, **kwargs)

    attn.forward = own


MUTATIONS = {"own_mask": lambda m: _own_mask(m.model.layers[0].self_attn),"drop_kwargs": lambda m: _drop_kwargs(m.model.layers[1]),
             "pooled": lambda m: _pooled(m.model.layers[0].self_attn),
             "never": lambda m: _never(m.model.layers[1].self_attn)}


def mutated_forward(ctx, mutation, P=2, model_type="granite", backend="ulysses"):
    """Wire a tiny model, break one layer, run one CP forward; return (raised?, message, whether backward
    could have run: the error must come from the forward)."""
    from ringmaster.adapters.raw import context_parallel_region

    model = tiny_model(model_type, **overrides_for(model_type))
    rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=ctx.mesh(P))
    MUTATIONS[mutation](model)
    batch = tiny_batch(model.config.vocab_size, 64)
    try:
        with context_parallel_region(batch) as shard:
            out = model(**shard)
        return None, "forward returned", out.loss.item()
    except Exception as exc:  # the test asserts on type and message
        return type(exc).__name__, str(exc), None
    finally:
        rm.unwire(model)
        rm.teardown()


def accounting_passes_then_disarms(ctx, P=2, model_type="phi3"):
    """Two CP forwards of an intact model: the first arms and passes, then the hooks are gone."""
    from ringmaster.adapters.raw import context_parallel_region

    model = tiny_model(model_type, **overrides_for(model_type))
    rt = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    ledger = rt.binding.ledger
    armed_before = ledger.armed
    batch = tiny_batch(model.config.vocab_size, 64)
    try:
        for _ in range(2):
            with context_parallel_region(batch) as shard:
                model(**shard).loss.backward()
        # the per-rank random-state fork (sharding/rng.py) stays for every CP forward; the token-mixing check's
        # hooks until it has seen a CP forward in eval mode too (architectures/mixing.py)
        mixing = {h.id for h in rt.mixing.handles}

        def others(hooks):
            return sum(1 for k, h in hooks.items()
                       if k not in mixing and not isinstance(getattr(h, "__self__", None), rng.RankFork))

        return armed_before, ledger.armed, len(ledger.handles), others(model._forward_hooks), others(
            model._forward_pre_hooks)
    finally:
        rm.unwire(model)
        rm.teardown()


def refused_spec(ctx, P=2):
    """A registered refusal wins over the generic path; overriding it back restores the generic path."""
    from ringmaster.architectures import generic
    from ringmaster.architectures.spec import _REGISTRY

    saved = _REGISTRY.pop("olmo2", None)
    try:
        generic.refuse(("olmo2",), "test refusal: reason naming the feature")
        err = wire_error(ctx, "olmo2", P)
    finally:
        _REGISTRY.pop("olmo2", None)
        if saved is not None:
            _REGISTRY["olmo2"] = saved
    return err, wire_error(ctx, "olmo2", P)
