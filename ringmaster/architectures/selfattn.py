"""Families whose attention modules compute attention themselves (they never read transformers'
``ALL_ATTENTION_FUNCTIONS``), wired through a declared site (:class:`.spec.SelfAttentionSite`,
run by :mod:`ringmaster.attention.selfattn`), or refused with the layer and what is missing.

Each site is data: which method (or torch's SDPA name) holds q, k, v, how the module scales its
scores, and which layers have a sliding window. The learned position tables of gpt_neo, openai-gpt,
megatron-bert and rembert are indexed by the ``position_ids`` ringmaster passes (the global row's
``arange``, the numbering these models use themselves), so as registered families they skip the
position probe of :mod:`.positions`; tests/test_selfattn.py checks them dense and padded.
"""

import sys

import torch

from .spec import ArchitectureSpec, SelfAttentionSite, register_architecture

# falcon: FalconAttention calls torch.nn.functional.scaled_dot_product_attention itself while its config
# says "sdpa" (its eager and ALiBi branches multiply and softmax inline: refused)
FALCON = register_architecture(ArchitectureSpec(
    name="falcon", model_types=("falcon",), attention_classes=("FalconAttention",),
    num_heads_attr="num_attention_heads", num_kv_heads_attr="num_kv_heads", supported_inner=("sdpa",),
    self_attention={"FalconAttention": SelfAttentionSite(
        kind="sdpa", refuse_kwargs=("output_attentions",),
        refuse_config=(("alibi", "FalconAttention adds ALiBi to its scores inline (slopes * key positions in "
                                 "bfloat16) outside any kernel ringmaster can reach; use a CP size of 1"),))},
    notes="torch SDPA called by the module: re-bound per instance; RoPE from global position_ids",
))

# gpt_neo: _attn(query, key, value, attention_mask) with unscaled scores; "local" layers see the previous
# config.window_size tokens (a causal band in its `bias` buffer)
GPT_NEO = register_architecture(ArchitectureSpec(
    name="gpt_neo", model_types=("gpt_neo",), attention_classes=("GPTNeoSelfAttention",),
    num_heads_attr="num_heads", num_kv_heads_attr="num_heads",
    self_attention={"GPTNeoSelfAttention": SelfAttentionSite(
        kind="method", method="_attn", scale=1.0, window_when=("attention_type", "local"),
        window_config="window_size")},
    notes="_attn re-bound per instance; unscaled scores; local layers as sliding windows; wpe reads position_ids",
))

GPT_NEOX_JAPANESE = register_architecture(ArchitectureSpec(
    name="gpt_neox_japanese", model_types=("gpt_neox_japanese",), attention_classes=("GPTNeoXJapaneseAttention",),
    num_heads_attr="num_attention_heads", num_kv_heads_attr="num_attention_heads",
    self_attention={"GPTNeoXJapaneseAttention": SelfAttentionSite(kind="method", method="_attn")},
    notes="_attn re-bound per instance; partial RoPE applied before it from global position_ids",
))

# openai-gpt: _attn(q, k, v, attention_mask, output_attentions) with k as [B, H, D, S]; scaled only when the
# module's `scale` flag is set; returns a list
OPENAI_GPT = register_architecture(ArchitectureSpec(
    name="openai-gpt", model_types=("openai-gpt",), attention_classes=("Attention",),
    num_heads_attr="n_head", num_kv_heads_attr="n_head",
    self_attention={"Attention": SelfAttentionSite(
        kind="method", method="_attn", args=("q", "k", "v", "attention_mask", "output_attentions"),
        key_layout="bhds", returns="list", scale_if="scale")},
    notes="_attn re-bound per instance; positions_embed reads position_ids",
))

def _bloom_slopes(module):
    """BLOOM's per-head ALiBi slopes, from its own modeling module (``_get_alibi_slopes``)."""
    return getattr(sys.modules[type(module).__module__], "_get_alibi_slopes")(module.num_heads, torch.device("cpu"))


def _mpt_slopes(module):
    """MPT's per-head ALiBi slopes: its own ``build_mpt_alibi_tensor`` (as MptModel calls it, alibi_bias_max 8)
    over two positions is ``[-slope, 0]`` per head."""
    bias = getattr(sys.modules[type(module).__module__], "build_mpt_alibi_tensor")(module.n_heads, 2,
                                                                                  device=torch.device("cpu"))
    return -bias[:, 0, 0]


_NO_CACHE = ("layer_past", "cache", "output_attentions")
# dropout: the sites' own dropout is refused by attention/selfattn.bypassed_dropout (read from the replaced code);
# dropout outside the sites runs under each rank's forked random state (sharding/rng.py)

# bloom: fused query_key_value laid out [.., H, 3, D], scores inv_norm_factor * q.k + alibi, dense, + residual
BLOOM = register_architecture(ArchitectureSpec(
    name="bloom", model_types=("bloom",), attention_classes=("BloomAttention",),
    num_heads_attr="n_head", num_kv_heads_attr="n_head",
    self_attention={"BloomAttention": SelfAttentionSite(
        kind="fused_qkv", args=("hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
                                "output_attentions"),
        qkv="query_key_value", qkv_layout="per_head", out="dense", heads_attr="num_heads",
        residual_arg="residual", scale_attr="inv_norm_factor", alibi_slopes=_bloom_slopes,
        refuse_kwargs=_NO_CACHE)},
    notes="fused_qkv site with ALiBi from global positions (slopes sliced to each rank's heads under Ulysses)",
))

# mpt: fused Wqkv chunked [.., 3, H, D] (clamped by clip_qkv), scores softmax_scale * q.k + alibi, out_proj
MPT = register_architecture(ArchitectureSpec(
    name="mpt", model_types=("mpt",), attention_classes=("MptAttention",),
    num_heads_attr="n_heads", num_kv_heads_attr="n_heads",
    self_attention={"MptAttention": SelfAttentionSite(
        kind="fused_qkv", args=("hidden_states", "position_bias", "cache", "attention_mask"),
        qkv="Wqkv", qkv_layout="chunked", out="out_proj", heads_attr="n_heads", clip_attr="clip_qkv",
        scale_attr="softmax_scale", alibi_slopes=_mpt_slopes, refuse_kwargs=_NO_CACHE)},
    notes="fused_qkv site with ALiBi from global positions (slopes sliced to each rank's heads under Ulysses)",
))
# BERT-style decoders: separate query/key/value Linears, context returned unprojected (the output Linear is in
# *SelfOutput); causal iff the module's is_decoder; absolute position embeddings read the passed position_ids
_BERT = dict(kind="fused_qkv", args=("hidden_states", "attention_mask", "encoder_hidden_states", "cache",
                                     "output_attentions"),
             qkv=("query", "key", "value"), out="", heads_attr="num_attention_heads", causal_attr="is_decoder",
             cross_arg="encoder_hidden_states", refuse_kwargs=("cache", "output_attentions"))
MEGATRON_BERT = register_architecture(ArchitectureSpec(
    name="megatron-bert", model_types=("megatron-bert",), attention_classes=("MegatronBertSelfAttention",),
    self_attention={"MegatronBertSelfAttention": SelfAttentionSite(**_BERT)},
    notes="BERT-style separate q/k/v; causal iff is_decoder; position_embeddings read position_ids",
))
REMBERT = register_architecture(ArchitectureSpec(
    name="rembert", model_types=("rembert",), attention_classes=("RemBertSelfAttention",),
    self_attention={"RemBertSelfAttention": SelfAttentionSite(**_BERT)},
    notes="BERT-style separate q/k/v; causal iff is_decoder; position_embeddings read position_ids",
))
# roformer: BERT-style, plus rotary applied inside the module from `sinusoidal_pos`, which the encoder looks up
# in RoFormerSinusoidalPositionalEmbedding for the local length: the site looks it up at global positions
ROFORMER = register_architecture(ArchitectureSpec(
    name="roformer", model_types=("roformer",), attention_classes=("RoFormerSelfAttention",),
    self_attention={"RoFormerSelfAttention": SelfAttentionSite(**{
        **_BERT, "args": ("hidden_states", "attention_mask", "sinusoidal_pos", "encoder_hidden_states", "cache",
                          "output_attentions"),
        "rotary_arg": "sinusoidal_pos", "rotary_table": "encoder.embed_positions",
        "rotary_apply": "apply_rotary_position_embeddings", "rotary_value_attr": "rotary_value"})},
    notes="BERT-style; rotary table looked up at the shard's global positions",
))
# trocr: BART-style separate q/k/v (query scaled by head_dim**-0.5), out_proj, causal; TrOCRDecoder numbers its
# learned position table from 0 over the *local* input and takes no position_ids: the site's pre-hook on that
# table passes this shard's global positions (the table's own forward accepts them)
TROCR = register_architecture(ArchitectureSpec(
    name="trocr", model_types=("trocr",), attention_classes=("TrOCRAttention",),
    self_attention={"TrOCRAttention": SelfAttentionSite(
        kind="fused_qkv", args=("hidden_states", "key_value_states", "cache", "attention_mask", "output_attentions"),
        qkv=("q_proj", "k_proj", "v_proj"), out="out_proj", heads_attr="num_heads",
        cross_arg="key_value_states", refuse_kwargs=_NO_CACHE, position_table="embed_positions",
        cross_modules=("encoder_attn",), mean_loss=".",
        refuse_config=(("config.decoder_layerdrop", "decoder layerdrop skips layers at random per rank; set it "
                                                    "to 0.0"),))},
    notes="fused_qkv site (separate q/k/v); learned position table given the shard's global positions",
))


def _xlm_batch(batch, kwargs, config) -> None:
    """Refuse an xlm batch its CP run would not match exactly.

    XLMModel zeroes the hidden states of positions ``>= lengths`` (``lengths``: the count of non-pad
    tokens in the row it sees, or the given ``attention_mask``); under CP it sees the shard. When
    every row's pad tokens are trailing, a shard's non-pad tokens come first in both layouts
    (contiguous; head_tail's head chunk precedes its tail chunk, and a row is padded only after its
    head chunk is full), so the shard's count gives exactly the row's mask there. Its non-causal
    attention masks pad keys: the batch must then say where they are (an ``attention_mask`` equal
    to ``input_ids != pad_index``). Packed rows: XLMModel attends across documents on one device,
    the CP attention would not."""
    if kwargs.get("lengths") is not None:
        raise NotImplementedError("XLMModel got `lengths`, which under CP would be compared with the shard's "
                                  "local positions; pass an attention_mask instead")
    rows = batch.rows
    if rows is None:
        raise NotImplementedError("the batch brought its own position_ids, so ringmaster cannot see the full "
                                  "rows' pad tokens XLMModel derives its padding mask from; pass the batch "
                                  "without position_ids")
    ids, mask = rows["input_ids"], rows["attention_mask"]
    if ids is None:
        if mask is not None and bool((mask == 0).any()):
            raise NotImplementedError("XLMModel with inputs_embeds and a padding attention_mask: under CP the "
                                      "shard's mask cannot be rebuilt; pass input_ids")
        real = None
    else:
        real = ids != config.pad_index
        after = (real[:, 1:] & ~real[:, :-1]).nonzero()
        if after.numel():
            row, pos = (int(x) for x in after[0])
            raise NotImplementedError(
                f"row {row} has a pad token (pad_index={config.pad_index}) before a real token at position "
                f"{pos + 1}: XLMModel counts pad tokens to mask the row's last positions, which a CP shard cannot "
                "reproduce; pad rows on the right only (tokenizer padding_side='right')")
        if mask is not None and not torch.equal(mask != 0, real):
            raise NotImplementedError(f"the attention_mask differs from input_ids != pad_index ({config.pad_index})"
                                      ": under CP XLMModel masks by its pad tokens; pass a mask that matches them")
        if mask is None and not config.causal and not bool(real.all()):
            raise NotImplementedError("right-padded rows without an attention_mask: XLM's bidirectional attention "
                                      "masks the pad keys, so the CP attention needs the batch's attention_mask")
    docs = batch.doc_ids
    if docs is not None:
        docs = docs.expand(real.shape if real is not None else docs.shape)
        split = (docs != docs[:, :1]) if real is None else ((docs != docs[:, :1]) & real)
        if bool(split.any()):
            raise NotImplementedError("packed rows: XLMModel attends across the documents of a row on one device "
                                      "(it reads no position_ids restarts), which the CP attention would not; "
                                      "train xlm on unpacked rows")


# xlm: MultiHeadAttention with separate q_lin/k_lin/v_lin (query scaled by head_dim**-0.5), out_lin; causal iff
# config.causal; XLMModel always passes a fresh (empty) cache; the batch rule keeps its padding mask exact
XLM = register_architecture(ArchitectureSpec(
    name="xlm", model_types=("xlm",), attention_classes=("MultiHeadAttention",),
    self_attention={"MultiHeadAttention": SelfAttentionSite(
        kind="fused_qkv", args=("input", "mask", "kv", "cache", "output_attentions"),
        qkv=("q_lin", "k_lin", "v_lin"), out="out_lin", heads_attr="n_heads", causal_config="causal",
        cross_arg="kv", empty_cache_arg="cache", refuse_kwargs=("output_attentions",), batch_rule=_xlm_batch,
        mean_loss="pred_layer", refuse_config=(
            ("config.asm", "an adaptive softmax head's loss is a mean over the local shard; use asm=False"),))},
    notes="fused_qkv site (separate q/k/v); causal per config; right-padded rows only (batch rule)",
))
