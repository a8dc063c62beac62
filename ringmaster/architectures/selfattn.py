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

from .generic import refuse
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
_DROP = "attention/hidden dropout: each CP rank would draw the same mask stream; set it to 0.0"

# bloom: fused query_key_value laid out [.., H, 3, D], scores inv_norm_factor * q.k + alibi, dense, + residual
BLOOM = register_architecture(ArchitectureSpec(
    name="bloom", model_types=("bloom",), attention_classes=("BloomAttention",),
    num_heads_attr="n_head", num_kv_heads_attr="n_head",
    self_attention={"BloomAttention": SelfAttentionSite(
        kind="fused_qkv", args=("hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
                                "output_attentions"),
        qkv="query_key_value", qkv_layout="per_head", out="dense", heads_attr="num_heads",
        residual_arg="residual", scale_attr="inv_norm_factor", alibi_slopes=_bloom_slopes,
        refuse_kwargs=_NO_CACHE, refuse_config=(("hidden_dropout", _DROP),))},
    notes="fused_qkv site with ALiBi from global positions (slopes sliced to each rank's heads under Ulysses)",
))

# mpt: fused Wqkv chunked [.., 3, H, D] (clamped by clip_qkv), scores softmax_scale * q.k + alibi, out_proj
MPT = register_architecture(ArchitectureSpec(
    name="mpt", model_types=("mpt",), attention_classes=("MptAttention",),
    num_heads_attr="n_heads", num_kv_heads_attr="n_heads",
    self_attention={"MptAttention": SelfAttentionSite(
        kind="fused_qkv", args=("hidden_states", "position_bias", "cache", "attention_mask"),
        qkv="Wqkv", qkv_layout="chunked", out="out_proj", heads_attr="n_heads", clip_attr="clip_qkv",
        scale_attr="softmax_scale", alibi_slopes=_mpt_slopes, refuse_kwargs=_NO_CACHE,
        refuse_config=(("attn_dropout_p", _DROP),))},
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
# trocr is left to the generic path, which refuses TrOCRAttention (attention outside the interface); a site
# would not be enough: TrOCRDecoder numbers its position embeddings from the local input and takes no
# position_ids. xlm's MultiHeadAttention would fit a fused_qkv site; what stops it is elsewhere:
XLM = refuse(("xlm",), (
    "XLMModel derives each row's length and its padding mask from the local input_ids (tokens equal to "
    "pad_index), which under CP describe the shard, not the row (its MultiHeadAttention itself could run "
    "through a SelfAttentionSite). Use a CP size of 1"))
