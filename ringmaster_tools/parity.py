"""Tiny random models and the CP-vs-single-device comparison the demo and the tests run.

``compare`` runs on every rank of a CP group: the same seeded model once without CP (the
reference, on the full sequence) and once wired for CP on its shard, then reports the
loss error, the gathered-logit error and every parameter's gradient error (gradients
averaged over the CP group, as DDP/FSDP2 would). Errors are relative: ``|a-b| / |b|`` in
the max norm, every tensor against its own norm (see :func:`group_mean_grad_errors` for the
few gradients that are zero in exact arithmetic).

fp32 is not enough to check recurrent parameters one by one: the A_log / dt_bias gradients are
sums of large terms that cancel, and transformers' pure-torch recurrent kernels cast to float32
inside even in an fp64 model. ``compare(..., fp64=True)`` builds the model in float64 and runs the
reference and the CP model under :func:`keep_fp64`, which keeps those casts wide.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from typing import Any

import torch
import torch.distributed as dist

# the smallest configs that still exercise each family's attention features
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=4),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=16),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
    "gemma3_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
    "gpt_oss": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2),
    # hybrids: gated DeltaNet (grouped value heads: 4 value heads over 2 key heads) and Mamba2
    # (2 B/C groups, a scan chunk of 12 that does not divide the shards)
    "qwen3_5_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8),
    "qwen3_next": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "nemotron_h": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
                       hybrid_override_pattern="M*ME", mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                       ssm_state_size=16, chunk_size=12, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2),
    "qwen3_5_moe_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
    # lightning attention (scalar decay per head; a block of 12 that does not divide the shards; the last
    # linear layer's slope is ~0: its state never decays) around one softmax attention layer
    "minimax": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                    layer_types=["linear_attention", "full_attention", "linear_attention"], block_size=12,
                    num_local_experts=4, num_experts_per_tok=2),
    # Kimi Delta Attention (4 heads of 8 channels, a decay per channel) before one MLA attention layer
    "kimi_linear": dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"], linear_head_dim=8, linear_num_heads=4,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32),
    # Griffin: two recurrent blocks (conv1d + RG-LRU, 64 channels in 4 gate blocks) and a local attention layer
    "recurrent_gemma": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                            lru_width=64, attention_window_size=16, conv1d_width=4),
    # attention-free: token shifts + WKV (time mixing), token shift + MLP (channel mixing)
    "rwkv": dict(attention_hidden_size=64, intermediate_size=128, num_hidden_layers=2, context_length=1024),
    # attention-free mLSTM blocks: 4 heads (q/k 8, v 16 channels), a kernel chunk of 12 that does not divide
    # the shards (chunkwise kernel + token loop per chunk)
    "xlstm": dict(embedding_dim=64, num_blocks=2, num_heads=4, chunk_size=12),
    "bamba": dict(num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
                  mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=12),
    "falcon_h1": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_n_heads=8, mamba_d_head=16,
                      mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=12),
    "granitemoehybrid": dict(num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention"],
                             mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                             mamba_chunk_size=12, num_local_experts=4, shared_intermediate_size=32),
    # Mamba1 (selective scan, state [d_inner=128, d_state=8]) and pure Mamba2
    "mamba": dict(state_size=8, time_step_rank=8, expand=2, conv_kernel=4),
    "falcon_mamba": dict(state_size=8, time_step_rank=8, expand=2, conv_kernel=4),
    "jamba": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, attn_layer_offset=1,
                  attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2, num_experts=4,
                  num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=12, expand=2),
    # Mamba hybrids with a shared attention block called from two hybrid layers (Zamba2: per-layer LoRA adapters)
    "zamba": dict(num_attention_heads=4, num_key_value_heads=4, attention_hidden_size=128, attention_head_dim=32,
                  mamba_dt_rank=4, mamba_d_state=8, n_mamba_heads=2, num_hidden_layers=3,
                  layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    "zamba2": dict(num_attention_heads=4, num_key_value_heads=4, mamba_d_state=16, n_mamba_heads=8, mamba_ngroups=2,
                   chunk_size=12, num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                   hybrid_layer_ids=[1, 2], use_shared_attention_adapter=True, adapter_rank=8),
    # short convolutions (LFM): conv layers around attention; lfm3's 7 taps, wider than a zoo shard at P=4 is not
    "lfm2": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, full_attn_idxs=[1],
                 layer_types=["conv", "full_attention", "conv"]),
    "lfm2_moe": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv"], num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32),
    "lfm3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=16,
                 layer_types=["conv", "full_attention", "sliding_attention"]),
    # other gated-DeltaNet hybrids: lara_mini (Qwen3.5's rule, MoE, sliding layers), olmo_hybrid, and
    # bailing_hybrid's delta attention (Kimi's per-channel gate, MLA attention)
    "lara_mini": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
                      layer_types=["linear_attention", "sliding_attention", "full_attention"], sliding_window=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "olmo_hybrid": dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8),
    "bailing_hybrid": dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           mlp_layer_types=["dense", "sparse", "dense"], first_k_dense_replace=1,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           head_dim=8, linear_head_dim=8, linear_num_heads=4, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_group=1, topk_group=1,
                           kda_safe_gate=False),   # the safe gate forgets >= e^-2.5 a token: no state would cross a shard
}

# ``ringmaster demo --model``: every family of TINY, grouped for its help. The attention families run in float32
# (tolerance DEMO_TOL["float32"]); the families with recurrent layers run in float64 under keep_fp64, the way the
# zoo and ``ringmaster check`` run them: their A_log / dt_bias gradients are sums of large terms that cancel, so
# fp32 rounding alone moves them by 1e-4..1e-3 relative (measured: qwen3_next, Ring P=4) while CP is exact.
DEMO_ATTENTION = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss")
DEMO_TOL = {"float32": 1e-4, "float64": 1e-6}


def demo_families() -> dict[str, tuple[str, ...]]:
    """``{"attention": ..., "hybrid / recurrent": ...}``: what ``ringmaster demo --model`` accepts (TINY's keys)."""
    return {"attention": DEMO_ATTENTION,
            "hybrid / recurrent": tuple(k for k in TINY if k not in DEMO_ATTENTION)}


COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def transformers_classes(model_type: str):
    """transformers' own (config class, causal-LM class) of ``model_type``, or None where it has none. Another
    package may re-register a model type in the Auto classes (``import fla`` maps ``mamba`` and ``mamba2`` to
    flash-linear-attention's own models): the families here are transformers' own."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_name = CONFIG_MAPPING_NAMES.get(model_type)
    model_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return (getattr(transformers, config_name, None) if isinstance(config_name, str) else None,
            getattr(transformers, model_name, None) if isinstance(model_name, str) else None)


def tiny_model(model_type: str, attn_implementation: str = "sdpa", seed: int = 0,
               dtype: torch.dtype = torch.float32, **overrides):
    """A random tiny causal LM of ``model_type``, identical for a given seed: initialised in fp32,
    then cast to ``dtype`` (float64: the same weights, every parameter and buffer wide; MoE
    experts run the eager loop, ``grouped_mm`` has no float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**COMMON, "use_cache": False, **TINY.get(model_type, {}), **overrides}
    config_cls, model_cls = transformers_classes(model_type)
    config = config_cls(**kwargs) if config_cls is not None else AutoConfig.for_model(model_type, **kwargs)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    build = model_cls._from_config if model_cls is not None else AutoModelForCausalLM.from_config
    torch.manual_seed(seed)
    try:
        model = build(config, attn_implementation=attn_implementation, dtype=torch.float32, **extra)
    except ValueError:
        if attn_implementation != "sdpa":
            raise
        torch.manual_seed(seed)   # a family without attention (Mamba) has no SDPA path: eager
        model = build(config, attn_implementation="eager", dtype=torch.float32, **extra)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.train()


def tiny_batch(vocab_size: int, seq_len: int, batch_size: int = 1, seed: int = 1, ignore_frac: float = 0.25):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(batch_size, seq_len, generator=g) < ignore_frac] = -100
    return {"input_ids": input_ids, "labels": labels}


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max|a-b| / max(max|b|, floor)``: relative error in the max norm."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, floor, 1e-12)


# Gradients that are zero in exact arithmetic, by model type (fnmatch patterns on parameter names),
# checked to be ~0 on both sides instead of against their own (rounding-noise) norm. Softmax is
# invariant to adding one constant to all of a query's scores, so a key bias with *no* position
# dependence (absolute/learned positions, no RoPE, no attention sinks) gets dL/db = 0 exactly. With
# RoPE the bias is rotated per key position (q_i·R_{j-i} b is not constant over j), so Qwen2's
# k_proj.bias gets a real gradient and is checked like any other (measured own-norm error <= 5e-7
# in fp32, Ulysses P=2/4); with sinks (gpt_oss) the sink logit does not move, so neither is zero.
# LLaVA's CLIP vision tower has one: learned absolute positions, no mask, no sinks. A family is
# listed here, never detected, so a real gradient can never be waved through as "noise".
STRUCTURAL_ZEROS: dict[str, tuple[str, ...]] = {
    "llava": ("model.vision_tower.*.self_attn.k_proj.bias",),
    # learned absolute positions, no RoPE, no sinks: the key bias moves every score of a query by one
    # constant (measured: own-norm "errors" up to 4e-7 in float64 under Ring, noise over noise;
    # every other parameter <= 2e-15). GPT-2 fuses q|k|v into one bias, so it is not listed.
    **{mt: ("*.self_attn.k_proj.bias",) for mt in ("opt", "biogpt")},
    **{mt: ("*.attention.self.key.bias",) for mt in (
        "bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "roberta",
        "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl")},
    # BERT-style self-attention: a key bias adds q.b, one constant per query row, which the softmax cancels
    "megatron-bert": ("*.attention.self.key.bias",),
    "rembert": ("*.attention.self.key.bias",),
}


def structural_zeros(model) -> tuple[str, ...]:
    return STRUCTURAL_ZEROS.get(getattr(getattr(model, "config", None), "model_type", ""), ())


def _sibling_weight(name: str, grads: dict[str, torch.Tensor]) -> torch.Tensor | None:
    return grads.get(name[: -len("bias")] + "weight") if name.endswith("bias") else None


def group_mean_grad_errors(model, reference, group, P: int, zeros: tuple[str, ...] | None = None):
    """Every parameter's error of the CP-group-mean gradient against the reference's:
    ``({name: err}, [names with no CP gradient], whole-gradient error)``.

    Every tensor is measured against its **own** reference norm, ``max|g_cp - g_ref| / max|g_ref|``:
    no floor relative to the model's largest gradient, so a small gradient (A_log, dt_bias) that
    is wrong is reported as wrong.

    The exception is a gradient that is zero in exact arithmetic (``zeros``: fnmatch patterns,
    default :data:`STRUCTURAL_ZEROS` for the model type): both sides hold only rounding noise, so
    it is checked to *be* ~0 on both sides, ``max(max|g_cp|, max|g_ref|)`` over the scale of the
    gradient its module's weight gets (``k_proj.weight`` for ``k_proj.bias``: the same upstream
    ``dL/dk``, summed with the inputs as weights): a real gradient leaking into it reads O(1).
    """
    zeros = structural_zeros(reference) if zeros is None else tuple(zeros)
    names, missing, cp_flat, ref_flat = [], [], [], []
    for (name, p), (_, p_ref) in zip(model.named_parameters(), reference.named_parameters()):
        if p_ref.grad is None:
            continue
        if p.grad is None:
            missing.append(name)
            continue
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        names.append(name)
        cp_flat.append((g / P).reshape(-1))
        ref_flat.append(p_ref.grad.detach().reshape(-1))
    if not names:
        return {}, missing, float("nan")
    ref_by_name = dict(zip(names, ref_flat))
    errs = {}
    for name, a, b in zip(names, cp_flat, ref_flat):
        if any(fnmatch.fnmatchcase(name, pat) for pat in zeros):
            sibling = _sibling_weight(name, ref_by_name)
            if sibling is None:
                raise ValueError(f"{name}: a structurally-zero gradient needs its module's weight for scale")
            noise = max(a.abs().max().item(), b.abs().max().item())
            errs[name] = noise / max(sibling.abs().max().item(), 1e-30)
        else:
            errs[name] = rel_err(a, b)
    return errs, missing, rel_err(torch.cat(cp_flat), torch.cat(ref_flat))


_F32 = (torch.float32, "torch.FloatTensor", "torch.float32")


def _is_f64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


class _KeepFP64(torch.overrides.TorchFunctionMode):
    """See :func:`keep_fp64`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        self_ = args[0] if args else kwargs.get("input")
        if _is_f64(self_):
            if name == "float" and len(args) == 1:
                return self_
            if name == "type" and ((len(args) > 1 and args[1] in _F32) or kwargs.get("dtype") in _F32):
                return self_
            if name == "to":
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:      # .to(dtype=), softmax(dtype=), sum(dtype=), ...
                kwargs["dtype"] = torch.float64
        elif kwargs.get("dtype") is torch.float32 and any(_is_f64(a) for a in args):
            kwargs["dtype"] = torch.float64                # torch.softmax(x, -1, dtype=...) and friends
        return func(*args, **kwargs)


class _KeepFP64Dispatch:
    """See :func:`keep_fp64` (``recompute=True``): the same rule at the aten level, as a dispatch mode."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if kwargs.get("dtype") is torch.float32 and any(_is_f64(a) for a in args):
                    kwargs["dtype"] = torch.float64     # _to_copy(x, dtype=float32), sum(dtype=...), ...
                return func(*args, **kwargs)

        return Mode()


@contextlib.contextmanager
def keep_fp64(recompute: bool = False):
    """While active, a cast of a float64 tensor to float32 is a no-op: ``t.float()``,
    ``t.to(torch.float32, ...)``, ``t.to(dtype=torch.float32)``, ``t.type(torch.float32)``, and
    ``dtype=torch.float32`` in any call on float64 tensors (``softmax(x, dtype=torch.float32)``).

    transformers' pure-torch recurrent kernels (``mamba2_chunk_scan``, ``torch_chunk_gated_delta_rule``,
    the gated RMSNorm, the Mamba2 ``A = -exp(A_log.float())``) cast to float32 inside; with this
    mode an fp64 model stays fp64 end to end. Tensors that are not float64 (integer position ids
    ``.float()``-ed for RoPE, fp32 buffers) are left alone, and factories with no float64 input
    keep their dtype: none of the recurrent kernels makes one (they use ``zeros_like`` or the
    input's dtype). A ``TorchFunctionMode`` is per thread: run the forward and backward in the
    thread that entered it.

    ``recompute=True``: also in activation-checkpointing recomputation. The autograd engine does not
    carry a ``TorchFunctionMode`` into backward, so a checkpointed layer would be recomputed with the
    float32 casts (and torch's checkpoint refuses saved tensors of another dtype); a dispatch mode,
    which the engine does carry, applies the same rule to the aten calls (``_to_copy`` and any op
    given ``dtype=torch.float32`` with a float64 input). Slower (Python per aten call): only for
    checkpointing tests.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_KeepFP64())
        if recompute:
            stack.enter_context(_KeepFP64Dispatch())
        yield


def _plain_forward(model, batch):
    return model(**batch, use_cache=False)


def packed_batch(vocab_size: int, doc_lens: list[int], seed: int = 1, ignore_frac: float = 0.2,
                 pad: int = 0) -> dict[str, torch.Tensor]:
    """One packed row as DataCollatorWithFlattening makes it: position_ids restart per document and
    the label of each document's first token is -100. ``pad`` appends padding (label -100) as
    a last document of its own."""
    g = torch.Generator().manual_seed(seed)
    S = sum(doc_lens) + pad
    input_ids = torch.randint(0, vocab_size, (1, S), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(1, S, generator=g) < ignore_frac] = -100
    position_ids = torch.cat([torch.arange(n) for n in doc_lens] + ([torch.arange(pad)] if pad else []))[None]
    labels[position_ids == 0] = -100
    if pad:
        labels[:, S - pad:] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def padded_rows(vocab: int, S: int, left: int = 3, real: int = 41) -> dict[str, torch.Tensor]:
    """B=2: row 0 one full document, row 1 ``left`` padding tokens, ``real`` tokens, padding
    (labels -100 on the padding and on row 1's first real token, whose predecessor is padding)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, :left] = 0
    mask[1, left + real:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[1, left] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def per_row_forward(model, batch):
    """Each row's real tokens (``attention_mask`` == 1, one contiguous run) run alone at their global
    positions, losses weighted by the global token count; padding logits stay 0 (compare only the
    real positions)."""
    from types import SimpleNamespace

    from ringmaster.sharding.batch import global_num_items, shift_labels

    total = global_num_items(batch)
    loss, logits = 0.0, None
    for row in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][row].nonzero().squeeze(-1)
        a, b = int(real[0]), int(real[-1]) + 1
        lab = batch["labels"][row:row + 1, a:b]
        out = model(input_ids=batch["input_ids"][row:row + 1, a:b], labels=lab, shift_labels=shift_labels(lab),
                    position_ids=torch.arange(a, b)[None], num_items_in_batch=total, use_cache=False)
        if logits is None:
            logits = out.logits.new_zeros(*batch["input_ids"].shape, out.logits.shape[-1])
        logits[row, a:b] = out.logits[0]
        loss = loss + out.loss
    return SimpleNamespace(loss=loss, logits=logits)


def per_document_forward(model, batch):
    """Reference for a packed row: every document run alone (positions from 0), losses weighted by
    the global token count, logits concatenated back into the row."""
    from types import SimpleNamespace

    from ringmaster.sharding.documents import doc_ids_from_positions
    from ringmaster.sharding.batch import global_num_items, shift_labels

    docs = doc_ids_from_positions(batch["position_ids"])[0]
    total = global_num_items(batch)
    loss, logits = 0.0, []
    for d in docs.unique().tolist():
        idx = (docs == d).nonzero().squeeze(-1)
        ids, labels = batch["input_ids"][:, idx], batch["labels"][:, idx]
        out = model(input_ids=ids, shift_labels=shift_labels(labels), labels=labels, num_items_in_batch=total,
                    use_cache=False)
        loss = loss + out.loss
        logits.append(out.logits)
    return SimpleNamespace(loss=loss, logits=torch.cat(logits, dim=1))


def compare(model_type: str, cfg, seq_len: int = 64, batch_size: int = 1, device_mesh=None,
            attn_implementation: str = "sdpa", seed: int = 0, via: str = "region", prepare=None,
            batch=None, reference_forward=None, build=None, fp64: bool = False, reference=None,
            compiled: bool = False, **overrides) -> dict[str, Any]:
    """Run the reference and the CP model on this rank; return errors and what CP cost.

    ``via="region"`` shards with ``context_parallel_region`` (raw PyTorch); ``via="hooks"``
    passes the full batch to a model hooked by ``ContextParallelContextManager`` (trainers).
    ``prepare(model)`` (optional) edits the fresh model before it is copied for the reference.
    ``batch`` replaces the random unpacked batch; ``reference_forward(model, batch)`` replaces
    the plain forward of the reference (e.g. each packed document alone) and returns an object
    with ``.loss`` and ``.logits`` over the whole batch. ``build`` replaces ``tiny_model``
    (same arguments), e.g. ``tiny_vlm``; ``batch`` may then be a callable ``batch(model)``.
    The result has every parameter's error (``grad_errs``, each against its own norm, see
    :func:`group_mean_grad_errors`) and the whole gradient's (``grad_err_total``: all parameters
    concatenated, same relative max-norm).
    ``reference=(model, output)``: a reference already run forward and backward on ``batch`` (the same
    built model, gradients populated), reused instead of running it again (the zoo scores four CP
    cases against one reference).
    ``fp64=True``: the model is built in float64 (``dtype=torch.float64`` to ``build``) and the
    reference and the CP model both run under :func:`keep_fp64`, so the per-parameter errors
    measure CP, not fp32 cancellation.
    ``compiled=True``: the CP model wired as for torch.compile (``rm.wire(compile=True)``: what a compiled runtime's
    batches carry, e.g. the documents parts' spare tokens), run eagerly.
    """
    if fp64:
        with keep_fp64():
            return compare(model_type, cfg, seq_len, batch_size, device_mesh, attn_implementation, seed, via,
                           prepare, batch, reference_forward, build, reference=reference, compiled=compiled,
                           dtype=torch.float64, **overrides)
    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region

    model = (build or tiny_model)(model_type, attn_implementation, seed, **overrides)
    if prepare is not None:
        prepare(model)
    if callable(batch):
        batch = batch(model)
    if batch is None:
        batch = tiny_batch(model.config.vocab_size, seq_len, batch_size, seed=seed + 1)
    ref_saved = None
    if reference is not None:
        reference, ref_out = reference
    else:
        reference = copy.deepcopy(model)
        with rm.profile_memory() as ref_mem:
            ref_out = (reference_forward or _plain_forward)(reference, batch)
            ref_out.loss.backward()
        ref_saved = ref_mem.peak_saved_bytes

    runtime = rm.wire(model, cfg, device_mesh=device_mesh, compile=compiled)
    group = runtime.cp_group
    P = runtime.cp_size
    try:
        with rm.profile_comms() as comms, rm.profile_memory() as mem:
            assignment = None
            if via == "region":
                with context_parallel_region(batch) as shard:
                    assignment = shard["ringmaster_batch"].assignment   # load_balance="documents" (else None)
                    out = model(**shard)
            elif via == "hooks":
                manager = rm.ContextParallelContextManager([model], group, load_balance=runtime.shard_load_balance)
                handles = manager.install()
                try:
                    out = model(**batch)
                    assignment = manager.assignment_of(model)
                finally:
                    for handle in handles:
                        handle.remove()
            else:
                raise ValueError(f"via={via!r}: use 'region' or 'hooks'")
            out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        loss = loss / P
        # a fused head and loss (Liger's fused linear cross entropy) returns no logits in training
        logits = None if out.logits is None else rm.gather_sequence(out.logits.detach(), dim=1, assignment=assignment)
        # a MoE model's router loss (output_router_logits=True): the group mean of the ranks' aux_loss
        aux, ref_aux = getattr(out, "aux_loss", None), getattr(ref_out, "aux_loss", None)
        aux_err = None
        if isinstance(aux, torch.Tensor) and isinstance(ref_aux, torch.Tensor):
            aux = aux.detach().float().clone()
            dist.all_reduce(aux, group=group)
            aux_err = abs(aux.item() / P - ref_aux.item()) / max(abs(ref_aux.item()), 1e-12)
        grad_errs, missing, grad_err_total = group_mean_grad_errors(model, reference, group, P)
    finally:
        rm.unwire(model)
        rm.teardown()
    worst = max(grad_errs, key=grad_errs.get)
    return {
        "cp_size": P,
        "backend": runtime.config.backend.value,
        "layout": runtime.shard_load_balance,
        "split_fraction": assignment.split_fraction if assignment is not None else 1.0,
        "loss_ref": ref_out.loss.item(),
        "loss_cp": loss.item(),
        "loss_err": abs(loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item()),
        "aux_err": aux_err,
        "logits_err": None if logits is None else
        rel_err(logits, ref_out.logits) if logits.shape == ref_out.logits.shape else float("inf"),
        "grad_err": grad_errs[worst],
        "worst_param": worst,
        "grad_errs": grad_errs,
        "grad_err_total": grad_err_total,
        "recurrent_layers": len(runtime.report.recurrent),
        "recurrent_kinds": sorted({kind for _, kind in runtime.report.recurrent}),
        "n_grads": len(grad_errs),
        "n_params": sum(1 for _ in reference.parameters()),
        "missing_grads": missing,
        "attention_layers": len(runtime.report.attention),
        "bytes_sent": comms.total_bytes(),
        "bytes_fwd": comms.total_bytes(phase="forward"),
        "bytes_bwd": comms.total_bytes(phase="backward"),
        "a2a_bytes": comms.total_bytes("all_to_all"),
        "saved_bytes": mem.peak_saved_bytes,
        "ref_saved_bytes": ref_saved,
        "peak_rss": mem.peak_rss_bytes,
    }


VLM_TINY: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=160, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, fullatt_block_indexes=[1], window_size=8)),
    "qwen3_vl": dict(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=160, head_dim=16, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])),
    "qwen3_5": dict(
        text_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=160, head_dim=16, max_position_embeddings=1024,
                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5, "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=2, num_position_embeddings=64)),
    "llava": dict(
        text_config=dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=160, max_position_embeddings=1024),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2),
        vision_feature_layer=-1, image_seq_length=16),
}
VLM_TINY["qwen3_5_moe"] = dict(
    text_config=dict(VLM_TINY["qwen3_5"]["text_config"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32),
    vision_config=dict(VLM_TINY["qwen3_5"]["vision_config"]))
IMAGE_TOKEN, VISION_START = 151, 150


def vlm_config(model_type: str, **overrides):
    """The tiny VLM config of ``model_type`` (:data:`VLM_TINY`, then ``overrides``; the image / vision-start
    tokens inside the tiny vocabulary unless given)."""
    from transformers import AutoConfig

    kwargs = {**VLM_TINY[model_type], **overrides}
    kwargs.setdefault("image_token_id" if model_type != "llava" else "image_token_index", IMAGE_TOKEN)
    if model_type != "llava":
        kwargs.setdefault("vision_start_token_id", VISION_START)
    kwargs["text_config"] = {**kwargs["text_config"], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                             "tie_word_embeddings": False, "use_cache": False}
    return AutoConfig.for_model(model_type, **kwargs)


def vlm_from_config(config, attn_implementation: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random VLM of ``config`` (image-text-to-text head), identical for a given seed; ``dtype`` as in
    :func:`tiny_model`."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation,
                                                    dtype=torch.float32, **extra)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.train()


def tiny_vlm(model_type: str, attn_implementation: str = "sdpa", seed: int = 0,
             dtype: torch.dtype = torch.float32, **overrides):
    """A random tiny VLM of ``model_type``; ``dtype`` as in :func:`tiny_model`."""
    return vlm_from_config(vlm_config(model_type, **overrides), attn_implementation, seed, dtype)


def vlm_image_tokens(config, grid=(1, 4, 8)) -> int:
    """How many tokens :func:`vlm_batch`'s one image takes in the text sequence."""
    vc = config.vision_config
    if config.model_type == "llava":
        return (vc.image_size // vc.patch_size) ** 2
    t, h, w = grid
    return t * h * w // vc.spatial_merge_size ** 2


def vlm_batch(model, seq_len: int, image_at: int, grid=(1, 4, 8), seed: int = 1) -> dict[str, torch.Tensor]:
    """One row with one image whose tokens start at ``image_at`` (so they can straddle a shard edge)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    vocab = cfg.get_text_config().vocab_size
    input_ids = torch.randint(3, VISION_START, (1, seq_len), generator=g)
    vc = cfg.vision_config
    n_img = vlm_image_tokens(cfg, grid)
    if cfg.model_type == "llava":
        pixel = {"pixel_values": torch.randn(1, 3, vc.image_size, vc.image_size, generator=g)}
    else:
        t, h, w = grid
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        pixel = {"pixel_values": torch.randn(t * h * w, dim, generator=g),
                 "image_grid_thw": torch.tensor([list(grid)])}
    input_ids[0, image_at - 1] = VISION_START
    input_ids[0, image_at:image_at + n_img] = IMAGE_TOKEN
    labels = input_ids.clone()
    labels[input_ids >= VISION_START] = -100
    labels[torch.rand(1, seq_len, generator=g) < 0.2] = -100
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids), **pixel}
    if cfg.model_type != "llava":
        batch["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN).int()
    assert vocab > IMAGE_TOKEN
    return batch
