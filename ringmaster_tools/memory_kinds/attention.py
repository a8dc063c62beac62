"""Softmax attention (sdpa / flash kernels: no S x S tensor), and what each CP backend adds.

Source: transformers' ``<Family>Attention.forward`` with ``sdpa_attention_forward`` (CPU) or
``flash_attention_forward`` (GPU); both save q, k, v and the output with its fp32 log-sum-exp
(``aten._scaled_dot_product_flash_attention_for_cpu`` / ``_flash_attention_forward``)."""

from __future__ import annotations

from . import Bytes

NAME = "attention"
CASES = [("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)),
         ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16))]


def _out_features(module) -> int | None:
    if module is None:
        return None
    n = getattr(module, "out_features", None)
    weight = getattr(module, "weight", None)
    if n is None and weight is not None:
        n = weight.shape[0]
    return int(n) if n is not None else None


def dims(module) -> dict:
    """Heads and widths from the module (its projections' weights) and its config."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = int(getattr(module, "head_dim", 0) or getattr(text, "head_dim", 0)
                   or text.hidden_size // text.num_attention_heads)
    heads = int(getattr(module, "num_heads", 0) or getattr(text, "num_attention_heads", 0))
    q_out = _out_features(getattr(module, "q_proj", None)) or heads * head_dim
    kv_out = _out_features(getattr(module, "k_proj", None))
    kv = kv_out // head_dim if kv_out else int(getattr(text, "num_key_value_heads", 0) or heads)
    return {"hidden": int(getattr(text, "hidden_size", 0) or heads * head_dim), "heads": heads, "kv_heads": kv,
            "head_dim": head_dim, "qk_norm": hasattr(module, "q_norm"), "gate": q_out == 2 * heads * head_dim}


def split(heads: int, kv_heads: int, P: int, backend: str, ulysses: int | None = None) -> tuple[int, int]:
    """(Ulysses size, ring size) of ``backend`` over ``P`` ranks (usp: ``ulysses`` or the largest
    divisor of P that divides the heads)."""
    if P <= 1:
        return 1, 1
    if backend == "ulysses":
        return P, 1
    if backend in ("ring", "ring-allgather"):
        return 1, P
    u = ulysses or max(d for d in range(1, P) if P % d == 0 and heads % d == 0)
    return u, P // u


def kv_after_replication(kv: int, u: int) -> int:
    """KV heads on the whole group after Ulysses replicates them (kv < u: each rank needs one)."""
    return kv if u <= 1 or kv % u == 0 else max(u, kv)


def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          ulysses: int | None = None) -> Bytes:
    h, hd = d["hidden"], d["head_dim"]
    qd, kvd = d["heads"] * hd, d["kv_heads"] * hd
    u, r = split(d["heads"], d["kv_heads"], P, backend, ulysses)
    kvd_k = kv_after_replication(d["kv_heads"], u) * hd
    out = b * h                                # the input (the norm's output), saved by q/k/v projections
    if d["qk_norm"]:                           # per-head RMSNorm on q and k (one rsqrt per head and token)
        out += (4 + b) * (qd + kvd) + 4 * (d["heads"] + d["kv_heads"])
    out += b * (qd + 2 * kvd_k)                # the kernel's q, k, v (after RoPE; replicated K/V under Ulysses)
    # the kernel's output (already [S, heads, d]: HF's transpose + contiguous is a no-op and o_proj saves
    # the same storage) and its fp32 log-sum-exp; Ring keeps its merged output in fp32
    out += (4 if r > 1 else b) * qd + 4 * d["heads"]
    if d["gate"]:                              # sigmoid(gate) and the gated output (a new tensor for o_proj)
        out += 2 * b * qd
    if u > 1 or r > 1:                         # the output laid out anew (all-to-all back / Ring's [heads, S])
        out += b * qd
    if backend == "ring-allgather" and r > 1:
        out += 2 * b * kvd_k * r               # the gathered K/V is saved for the backward
    # its backward beyond the saved tensors: the incoming gradient and the one it produces (the kernel's
    # dq/dk/dv replace q/k/v as they are freed; the backend's buffers are attention_temporaries)
    return Bytes(out, backward=2 * b * h, source="transformers sdpa_attention_forward / flash_attention_forward")


def rope_width(model) -> int:
    """Channels of RoPE's cos and sin tables (0 without a rotary embedding): computed once per forward
    and saved by the first attention layer's multiplies (the others share the same tensors)."""
    for _, module in model.named_modules():
        inv = getattr(module, "inv_freq", None)
        if inv is not None and "Rotary" in type(module).__name__:
            return 2 * 2 * inv.shape[-1]      # cos and sin, each [S, 2 x inv_freq]
    return 0
