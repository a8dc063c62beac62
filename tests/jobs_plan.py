"""Measured peak memory of one training step, for the memory planner's checks (tests/test_plan.py,
benchmarks/memory_plan.py). Runs in one process (P=1) or on every rank of the pool (P>1)."""

from __future__ import annotations

import torch

import ringmaster as rm

# models the planner is checked on: name -> (model_type, config overrides); random, fixed seed
_HYBRID = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=256)
MODELS = {
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=1024)),
    # layers dominate (vocab small): checks the per-layer and per-backend terms
    "deep": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=256)),
    "100m": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                           num_key_value_heads=4, vocab_size=32000)),
    # 3 gated-DeltaNet layers : 1 attention layer (Qwen3.5's pattern)
    "gdn": ("qwen3_5_text", dict(_HYBRID, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                                 linear_value_head_dim=16)),
    # Nemotron-H: Mamba2, attention, MLP-only, Mamba2
    "mamba2": ("nemotron_h", dict(_HYBRID, hybrid_override_pattern="M*-M", mamba_num_heads=8, mamba_head_dim=16,
                                  n_groups=2, ssm_state_size=16, chunk_size=64, mlp_hidden_act="relu2")),
    "mamba1": ("falcon_mamba", dict(hidden_size=128, num_hidden_layers=4, vocab_size=256, state_size=16,
                                    expand=2, conv_kernel=4, time_step_rank=8)),
    # every layer an MoE block: 8 experts, top-2
    "moe": ("qwen3_moe", dict(_HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                              decoder_sparse_step=1, mlp_only_layers=[])),
}


def build_config(model_type: str, overrides: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, use_cache=False, tie_word_embeddings=False, attention_dropout=0.0,
                                max_position_embeddings=1 << 16, **overrides)


def build(model_type: str, overrides: dict, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_config(model_type, overrides)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    except ValueError:   # a family without attention (Mamba) has no SDPA path
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).train()


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def measure_step(model_type: str, overrides: dict, seqs, P: int = 1, backend: str = "ulysses", mesh=None,
                 loss: str = "full", chunk: int = 1024, checkpointing: str = "none",
                 dtype: torch.dtype = torch.float32) -> list[dict]:
    """Per S: bytes alive before the step (parameters + AdamW state, after one warm-up step) and the
    peak of tensor bytes created and alive at once during forward + backward + optimizer step
    (``track_tensor_memory``), with grads set to None before, as a training loop leaves them."""
    from ringmaster_tools.profiling import track_tensor_memory
    from ringmaster.sharding.loss import chunked_nll
    from ringmaster_tools.parity import tiny_batch

    model = build(model_type, overrides).to(dtype)   # bf16: parameters and AdamW state in bf16 too
    if checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if P > 1:
        rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    vocab = model.config.vocab_size

    def step(batch):
        if P > 1:
            from ringmaster.adapters.raw import context_parallel_region

            with context_parallel_region(batch) as shard:
                if loss == "chunked":
                    labels = shard.pop("shift_labels", None)
                    shard.pop("labels", None)
                    n = shard.pop("num_items_in_batch", None)
                    hidden = model.model(**{k: v for k, v in shard.items() if k != "use_cache"}).last_hidden_state
                    value = chunked_nll(hidden, model.lm_head.weight, labels, n if n is not None else 1, chunk)
                else:
                    value = model(**shard).loss
        elif loss == "chunked":
            hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
            labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            value = chunked_nll(hidden, model.lm_head.weight, labels, 1, chunk)
        else:
            value = model(**batch).loss
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows = []
    try:
        step(tiny_batch(vocab, seqs[0]))
        for S in seqs:
            batch = tiny_batch(vocab, S)
            static = _storage_bytes(list(model.parameters()) +
                                    [v for st in opt.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor) and v.numel() > 1])
            with track_tensor_memory(skip_aliases=True) as mem:
                step(batch)
            rows.append({"S": S, "static": static, "peak_dynamic": mem.peak_bytes, "peak_op": mem.peak_op,
                         "total": static + mem.peak_bytes})
    finally:
        if P > 1:
            rm.unwire(model)
            rm.teardown()
    return rows


def measure_job(ctx, model_type, overrides, seqs, P, backend="ulysses", loss="full", checkpointing="none",
                dtype=torch.float32):
    return measure_step(model_type, overrides, seqs, P, backend, ctx.mesh(P) if P > 1 else None, loss,
                        checkpointing=checkpointing, dtype=dtype)
