"""The transformers model zoo: every decoder-only causal-LM family of the installed transformers,
shrunk to a tiny random config, run through CP parity and classified.

Why a zoo: the registry (and, once it lands, the generic path) claims "exact or refused" for any
HF decoder; the only way to keep that claim true as transformers adds families is to run all of
them. The family list comes from ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (nothing hand-listed), each
default config is shrunk generically by :func:`tiny_config` (per-family overrides are data:
:data:`parity.TINY` and :data:`FAMILY_OVERRIDES`), and every family gets one of:

- ``exact``: loss, gathered logits and every parameter gradient (each against its own norm) match
  the same model without CP (float64, tolerance :data:`TOL`);
- ``refused``: ringmaster raised a clean error (from its own code, before the CP step completed)
  whose message is the reason;
- ``WRONG``: CP ran and differs (the defect the zoo exists to catch);
- ``crash``: CP raised something that is not a clean refusal (an error from inside a model);
- ``hang``: the pool timed out (found by :func:`sweep`).

Families whose tiny model cannot even run without CP are not scored (``excluded`` with the error),
nor are encoder-decoder families (``ForCausalLM`` heads of seq2seq models).
"""

from __future__ import annotations

import copy
import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch

# float64 parity: fp32 cancellation in small gradients must not read as WRONG (nor hide a real error)
TOL = 1e-6

# generic shrink: applied to every config key that exists in the family's default config
SHRINK: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, ffn_hidden_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32, shared_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_topk=2, top_k=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    sliding_window=16, attention_chunk_size=16, max_position_embeddings=1024, max_window_layers=1,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=12,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=12,
    mamba_d_ssm=128, state_size=16, time_step_rank=8, expand=2, conv_kernel=4,
    tie_word_embeddings=False, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    router_jitter_noise=0.0,
)

# a tiny model bigger than this is a config the generic shrink missed (blt's hash embeddings)
MAX_PARAMS = 3_000_000

# per-family fixes where the generic shrink is not a valid config (data, not code)
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "glm4_moe_lite": dict(head_dim=16),
    # Mamba2Config checks hidden_size * expand == num_heads * head_dim (64 * 2 = 8 * 16)
    "mamba2": dict(num_heads=8, head_dim=16),
    # Zamba/Zamba2 store sizes derived from hidden_size (2 * hidden for the shared attention block); the
    # shrink copies the defaults' values, so give the tiny ones
    "zamba": dict(attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=4),
    "zamba2": dict(attention_hidden_size=128, attention_head_dim=32, mamba_headdim=16, kv_channels=16,
                   num_query_groups=4),   # hybrid_layer_ids: parity.TINY (its layers_block_type)
    # the default KDA width (32 heads x 128 channels) alone is 4.5M parameters
    "kimi_linear": dict(linear_head_dim=8, linear_num_heads=4),
    # the default RG-LRU width (2560) is 6.6M parameters; 3 layers reach the first attention block
    "recurrent_gemma": dict(lru_width=64, num_hidden_layers=3),
    # the default config pins attention_hidden_size to 4096
    "rwkv": dict(attention_hidden_size=64),
    # xLSTM keeps embedding_dim (4096) and num_blocks (32) beside hidden_size / num_hidden_layers
    "xlstm": dict(embedding_dim=64, num_blocks=2),
    "nemotron": dict(num_key_value_heads=2),  # its default is None, which NemotronAttention cannot build
}

# families run on a (2, 2) mesh at P=2 and on (1, 4) at P=4
CASES: tuple[tuple[str, int], ...] = (("ulysses", 2), ("ring", 2), ("ulysses", 4), ("ring", 4))


def causal_lm_families() -> list[str]:
    """Every ``model_type`` of the installed transformers with a causal-LM head, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_indices(d: dict[str, Any], n_layers: int) -> list[int]:
    """Which layers of the default config to keep: the first layer of each distinct combination of the
    per-layer lists (``layer_types``, ``mlp_layer_types``, hybrid pattern strings), at least two, at most 4."""
    per_layer = [v for k, v in d.items() if isinstance(v, (list, str)) and len(v) == n_layers and n_layers > 1
                 and k not in ("architectures",)]
    if not per_layer:
        return [0, 1]
    first: dict[tuple, int] = {}
    for i in range(n_layers):
        first.setdefault(tuple(str(v[i]) for v in per_layer), i)
    keep = sorted(first.values())[:4]
    if len(keep) < 2:
        keep = [keep[0], keep[0] + 1]
    return keep


def _shrink_dict(d: dict[str, Any], attribute_map: dict[str, str] | None = None) -> dict[str, Any]:
    """The generic shrink of one (sub)config dict: known size keys (also under the family's own
    names, ``attribute_map``: gpt2's ``n_embd``), every dropout to 0, per-layer lists cut to one layer
    of each kind, and nested sub-configs shrunk the same way."""
    out: dict[str, Any] = {}
    alias = {v: k for k, v in (attribute_map or {}).items()}
    for key, value in d.items():
        generic = alias.get(key, key)
        if generic in SHRINK and not isinstance(value, (dict, list)):
            if value is None and generic != "head_dim":  # None is "off" (no sliding window, no q LoRA)
                continue
            out[key] = SHRINK[generic]
        elif isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop") or key.endswith("_prob")):
            out[key] = 0.0
        elif isinstance(value, dict) and ("model_type" in value or "hidden_size" in value):
            out[key] = {**value, **_shrink_dict(value)}
        elif isinstance(value, int) and not isinstance(value, bool) and value > 4096 and "vocab" in key:
            out[key] = 128
    layer_key = next((k for k in d if alias.get(k, k) == "num_hidden_layers"), "num_hidden_layers")
    n_layers = d.get(layer_key)
    if isinstance(n_layers, int):
        keep = _layer_indices(d, n_layers)
        for key, value in d.items():
            if isinstance(value, list) and len(value) == n_layers and n_layers > 1:
                out[key] = [value[i] for i in keep]
            elif isinstance(value, str) and len(value) == n_layers and n_layers > 1:
                out[key] = "".join(value[i] for i in keep)
        out[layer_key] = len(keep)
    if "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: head_dim is the rotary part
        out["head_dim"] = SHRINK["qk_rope_head_dim"]
    return out


def tiny_config(model_type: str, base=None, **overrides):
    """A tiny config of ``model_type`` (or of ``base``, a config loaded from a checkpoint): the
    generic shrink, then :data:`parity.TINY` / :data:`FAMILY_OVERRIDES`, then ``overrides``."""
    from transformers import AutoConfig

    from .parity import TINY

    if base is None:
        base = AutoConfig.for_model(model_type)
    model_type = base.model_type
    d = base.to_dict()
    kwargs = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")
              and not k.startswith("_")}
    kwargs.update(_shrink_dict(d, getattr(base, "attribute_map", None)))
    kwargs.update(TINY.get(model_type, {}))
    kwargs.update(FAMILY_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    if "is_decoder" in d:
        kwargs["is_decoder"] = True
    return AutoConfig.for_model(model_type, **kwargs)


def vlm_parent(config) -> str | None:
    """The VLM family ``ringmaster check`` runs ``config`` as, with an image in the batch: its own model_type when
    it is a VLM with a tiny recipe (:data:`parity.VLM_TINY`), or the VLM whose text config it is when that text
    model has no causal-LM class of its own (``qwen2_5_vl_text``: the decoder of ``qwen2_5_vl``); else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .parity import VLM_TINY

    model_type = getattr(config, "model_type", None)
    if model_type in VLM_TINY:
        return model_type
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    for vlm in VLM_TINY:
        text = getattr(CONFIG_MAPPING[vlm], "sub_configs", {}).get("text_config")
        if getattr(text, "model_type", None) == model_type:
            return vlm
    return None


def tiny_vlm_config(base):
    """The tiny VLM config ``ringmaster check`` builds from ``base`` (a VLM's config, or the text config of one,
    :func:`vlm_parent`): the generic shrink of its text and vision configs, then :data:`parity.VLM_TINY`'s sizes
    (the vision tower's output width is the text hidden size, the rotary sections fit the head dim), the image and
    vision-start tokens inside the tiny vocabulary."""
    from .parity import VLM_TINY, vlm_config

    vlm = vlm_parent(base)
    d = base.to_dict()
    if vlm != base.model_type:    # a text config: the decoder of its VLM
        d = {"text_config": d}
    drop = ("model_type", "transformers_version", "architectures")

    def sub(key: str) -> dict:
        part = d.get(key) or {}
        return {**{k: v for k, v in part.items() if k not in drop and not k.startswith("_")}, **_shrink_dict(part),
                **VLM_TINY[vlm][key]}

    top = {k: v for k, v in d.items() if k not in drop and k not in ("text_config", "vision_config")
           and not k.startswith("_") and "token" not in k}
    for key in ("text_config", "vision_config"):
        if key in VLM_TINY[vlm]:
            top[key] = sub(key)
    top.update({k: v for k, v in VLM_TINY[vlm].items() if k not in ("text_config", "vision_config")})
    return vlm_config(vlm, **top)


def vlm_image_at(config, seq_len: int) -> int:
    """Where ``ringmaster check`` puts the tiny VLM's one image in a row of ``seq_len`` tokens: centred, so that
    it straddles the middle (the P=2 shard edge, and a P=4 one). Raises when the row is too short for it."""
    from .parity import vlm_image_tokens

    n_img = vlm_image_tokens(config)
    if seq_len < n_img + 8:
        raise ValueError(f"{seq_len} tokens are too few for the tiny {config.model_type}'s image ({n_img} tokens) "
                         f"and text on both sides: use --seq {4 * n_img} or more")
    return (seq_len - n_img) // 2


_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "attention_window_size", "window_size")
_SIZE_KEYS = (("hidden_size", "hidden"), ("num_attention_heads", "heads"), ("num_key_value_heads", "KV heads"),
              ("intermediate_size", "MLP"), ("vocab_size", "vocab"))


def _dropouts(d: dict, prefix: str = "") -> dict[str, float]:
    """Every dropout-like float field of a config dict (nested sub-configs as ``text_config.attention_dropout``)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_dropouts(value, f"{prefix}{key}."))
        elif isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop") or key.endswith("_prob")):
            out[prefix + key] = value
    return out


def _per_layer_kinds(cfg) -> list[str]:
    """The distinct per-layer kinds a config lists (``layer_types``, hybrid pattern strings)."""
    d = cfg.to_dict()
    n = getattr(cfg, "num_hidden_layers", None)
    kinds: list[str] = []
    for key, value in d.items():
        if isinstance(n, int) and n > 1 and isinstance(value, (list, str)) and len(value) == n \
                and key not in ("architectures",) and ("type" in key or "pattern" in key):
            kinds += [f"{key}={v}" for v in dict.fromkeys(str(x) for x in value)]
    return kinds


def check_changes(base, config, seq_len: int) -> list[str]:
    """What ``ringmaster check`` changed from the user's config ``base`` to build its tiny ``config``: layers kept
    (one of each kind), sizes, dropout switched off, windows shrunk below the sequence, and for a VLM the vision
    tower. One line each, for the report."""
    lines = []
    bt, tt = base.get_text_config(), config.get_text_config()
    n_base, n_tiny = getattr(bt, "num_hidden_layers", None), getattr(tt, "num_hidden_layers", None)
    if n_base and n_tiny and n_base != n_tiny:
        kinds = _per_layer_kinds(tt)
        lines.append(f"layers {n_base} -> {n_tiny}" + (f", one of each kind ({', '.join(kinds)})" if len(kinds) > 1
                                                         else ""))
    sizes = [f"{label} {getattr(bt, k)} -> {getattr(tt, k)}" for k, label in _SIZE_KEYS
             if getattr(bt, k, None) is not None and getattr(bt, k, None) != getattr(tt, k, None)]
    if sizes:
        lines.append("sizes " + ", ".join(sizes))
    before, after = _dropouts(base.to_dict()), _dropouts(config.to_dict())
    zeroed = [f"{k} {v:g}" for k, v in before.items() if v and not after.get(k)]
    if zeroed:
        lines.append(f"dropout set to 0 ({', '.join(zeroed)}): 'exact' is with dropout off; in training rm.wire runs "
                     "the model's dropout under a random state forked per CP rank (masks independent across shards), "
                     "or refuses what it cannot make exact, e.g. attention dropout under Ring (docs/reliability.md)")
    for key in _WINDOW_KEYS:
        b, t = getattr(bt, key, None), getattr(tt, key, None)
        if isinstance(b, int) and isinstance(t, int) and b != t:
            lines.append(f"{key} {b} -> {t} of {seq_len} tokens (so the window is cut by the shard edges)")
    if hasattr(config, "vision_config") and hasattr(base, "vision_config"):
        bv, tv = base.vision_config, config.vision_config
        depth = next((k for k in ("depth", "num_hidden_layers") if hasattr(tv, k)), None)
        lines.append("vision tower " + ", ".join(
            f"{label} {getattr(bv, k)} -> {getattr(tv, k)}" for k, label in ((depth, "depth"), ("hidden_size", "hidden"))
            if k and getattr(bv, k, None) is not None))
    return lines


def check_exercised(config, case: dict, image_at: int | None, seq_len: int) -> list[str]:
    """What a ``ringmaster check`` case ran through CP: the attention layers and their masks (global causal,
    sliding-window, chunked), the recurrent kinds (from the wired model's report, ``case``), and for a VLM the
    image through the vision tower; or that a multimodal config ran without an image."""
    tt = config.get_text_config()
    kinds = _per_layer_kinds(tt)
    masks = []
    window = getattr(tt, "sliding_window", None)
    if isinstance(window, int):
        local = [k for k in kinds if "sliding" in k or "local" in k]
        masks.append(f"sliding-window {window}" + (" + global causal (per layer_types)" if local and len(kinds) > 1
                                                   else ""))
    chunk = getattr(tt, "attention_chunk_size", None)
    if isinstance(chunk, int):
        masks.append(f"chunked {chunk}")
    lines = []
    n_attn = case.get("attention_layers")
    if n_attn is not None:
        lines.append(f"{n_attn} attention layers ({', '.join(masks) or 'global causal'})"
                     + (f"; layer kinds {', '.join(kinds)}" if len(kinds) > 1 else ""))
    if case.get("recurrent_layers"):
        lines.append(f"{case['recurrent_layers']} recurrent layers ({', '.join(case.get('recurrent_kinds') or [])}): "
                     "conv halo and state passed across the shards")
    if image_at is not None:
        from .parity import vlm_image_tokens

        n_img = vlm_image_tokens(config)
        lines.append(f"one image: {n_img} tokens at positions {image_at}-{image_at + n_img - 1} of {seq_len}, across "
                     f"the shard edge at {seq_len // 2}; the vision tower runs on the whole batch on every rank, the "
                     "decoder on the shard after it")
    elif hasattr(config, "vision_config") or hasattr(config, "audio_config"):
        from .parity import VLM_TINY

        lines.append("text only: no image in the batch, so the vision / audio tower did not run (check builds an image "
                     f"for {', '.join(VLM_TINY)} and their text configs)")
    return lines


def is_encoder_decoder(model_type: str) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.for_model(model_type), "is_encoder_decoder", False))


def build_tiny(model_type: str, config=None, seed: int = 0, dtype: torch.dtype = torch.float64, vlm: bool = False):
    """The tiny random causal LM (fp32 init, then cast): SDPA where the family has it, else eager. ``vlm``: the
    image-text-to-text model of ``config`` (:func:`tiny_vlm_config`) instead."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    config = config if config is not None else tiny_config(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in auto.from_config(copy.deepcopy(config)).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {n / 1e6:.1f}M parameters (limit {MAX_PARAMS / 1e6:.0f}M): "
                         f"add a per-family override to FAMILY_OVERRIDES")
    last = None
    for attn in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            model = auto.from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32)
        except ValueError as e:  # the family has no SDPA path
            last = e
            continue
        try:
            model.set_experts_implementation("eager")  # grouped_mm has no float64
        except Exception:  # noqa: BLE001 - a model without experts has nothing to set
            pass
        return model.to(dtype).train()
    raise last


def zoo_batch(vocab: int, seq_len: int) -> dict[str, torch.Tensor]:
    from .parity import tiny_batch

    return tiny_batch(vocab, seq_len, seed=1)


def reference_step(model, batch):
    """One forward+backward without CP: a family whose tiny model fails here is not scored. Returns
    ``(model, output)``, the reference every CP case of the family is compared with."""
    from .parity import keep_fp64

    with keep_fp64():
        out = model(**batch, use_cache=False)
        if out.loss is None or not torch.isfinite(out.loss):
            raise RuntimeError(f"loss is {out.loss}")
        out.loss.backward()
    return model, out


def _ringmaster_frame(tb) -> bool:
    """Was the exception raised by ringmaster's own code (a clean refusal), not inside a model?"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.endswith("parity.py")]  # keep_fp64's mode
    if not frames:
        return False
    last = os.path.abspath(frames[-1].filename)
    return last.startswith(root + os.sep) and os.sep + "testing" + os.sep not in last[len(root):]


def short(message: str, limit: int = 300) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def classify_error(exc: BaseException) -> tuple[str, str]:
    """``("refused", reason)`` for a clean ringmaster refusal, else ``("crash", type: message)``."""
    from ringmaster.errors import UnsupportedLayerError

    msg = short(str(exc))
    if isinstance(exc, UnsupportedLayerError) or (
            isinstance(exc, (ValueError, NotImplementedError, RuntimeError, TypeError))
            and _ringmaster_frame(exc.__traceback__) and msg):
        return "refused", msg
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith("parity.py")]
    where = f" (raised in {'/'.join(frames[-1].filename.split(os.sep)[-2:])}:{frames[-1].lineno} {frames[-1].name})" \
        if frames else ""
    return "crash", f"{type(exc).__name__}: {short(msg, 200)}{where}"


def parity_case(ctx, model_type: str, base, batch, backend: str, P: int, reference=None) -> dict[str, Any]:
    """One CP parity run of the prebuilt ``base`` model; never raises (the verdict says what happened).
    ``reference``: :func:`reference_step`'s result for ``base`` and ``batch`` (else computed here)."""
    import ringmaster as rm

    from .parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend)
    try:
        r = compare(model_type, cfg, device_mesh=ctx.mesh(P), batch=batch, fp64=True,
                    build=lambda *a, **k: copy.deepcopy(base), reference=reference)
    except Exception as e:  # noqa: BLE001 - every outcome is recorded, none escapes
        verdict, reason = classify_error(e)
        try:
            rm.teardown()
        except Exception:  # noqa: BLE001
            pass
        return {"verdict": verdict, "reason": reason}
    errs = {"loss": r["loss_err"], "logits": r["logits_err"], "grad": r["grad_err"]}
    bad = [k for k, v in errs.items() if not v <= TOL]
    if r["missing_grads"]:
        bad.append(f"missing grads {r['missing_grads'][:3]}")
    reason = "" if not bad else (f"{', '.join(bad)} over {TOL:g}: loss {r['loss_err']:.1e}, logits "
                                 f"{r['logits_err']:.1e}, worst grad {r['grad_err']:.1e} ({r['worst_param']})")
    return {"verdict": "WRONG" if bad else "exact", "reason": reason,
            "errs": errs, "worst_param": r["worst_param"], "attention_layers": r["attention_layers"],
            "recurrent_layers": r["recurrent_layers"], "recurrent_kinds": r["recurrent_kinds"],
            "bytes_sent": r["bytes_sent"]}


def zoo_job(ctx, families: list[str], cases=CASES, seq_len: int = 32, configs: dict | None = None,
            share: bool = False, images: dict | None = None):
    """Run on every pool rank: each family's scoring step, then each (backend, P) parity case.
    ``configs`` maps a family to a config to use instead of :func:`tiny_config` (``ringmaster check``).
    ``images`` maps a family whose config is a VLM's (:func:`tiny_vlm_config`) to where its one image starts: the
    image-text-to-text model runs on :func:`parity.vlm_batch` (the vision tower on every rank, the decoder on the
    shard).
    ``share``: when every case has the same CP size P and the pool holds several CP groups of P ranks (the
    mesh's dp dim), each group scores its own share of the families (group g: every ``world/P``-th from g)."""
    sizes = {P for _, P in cases if P <= ctx.world}
    # a solo pool (ringmaster_tools.pool) keeps every rank when the job asks for two CP sizes or shares
    ctx.uses(sizes)
    if share:
        ctx.keep_all_groups()
    split = share and len(sizes) == 1 and ctx.world // next(iter(sizes)) > 1
    if split:
        P = next(iter(sizes))
        families = list(families)[ctx.rank // P::ctx.world // P]
    out = {}
    for model_type in families:
        row: dict[str, Any] = {"family": model_type}
        try:
            if configs is None and is_encoder_decoder(model_type):
                row.update(status="excluded", reason="encoder-decoder family")
                out[model_type] = row
                continue
            config = (configs or {}).get(model_type) or tiny_config(model_type)
            image_at = (images or {}).get(model_type)
            base = build_tiny(model_type, config, vlm=image_at is not None)
            if image_at is not None:
                from .parity import vlm_batch

                batch = vlm_batch(base, seq_len, image_at)
            else:
                batch = zoo_batch(base.config.get_text_config().vocab_size, seq_len)
            reference = reference_step(copy.deepcopy(base), batch)
        except Exception as e:  # noqa: BLE001 - a family whose tiny model does not run is listed, not scored
            row.update(status="excluded", reason=f"tiny model does not run without CP: {type(e).__name__}: "
                                                 f"{short(str(e), 160)}")
            out[model_type] = row
            continue
        row["status"] = "scored"
        row["attn_implementation"] = base.config._attn_implementation
        row["layer_kinds"] = layer_kinds(base)
        for backend, P in cases:
            if P > ctx.world or (not split and ctx.repeats(P)):   # a solo pool: the first CP group of P runs it
                continue
            row[f"{backend}{P}"] = parity_case(ctx, model_type, base, batch, backend, P, reference)
        out[model_type] = row
    return out


def layer_kinds(model) -> list[str]:
    """The module classes that mix tokens or carry positions: what a verdict is about. A class is matched by its
    name less the model's own prefix (``Qwen3_5Moe`` of ``Qwen3_5MoeForConditionalGeneration``), so a family
    named after a kind (MoE, Mamba) does not list its every class."""
    top = type(model).__name__
    prefix = top[:top.index("For")] if "For" in top else ""
    kinds = []
    for _, module in model.named_modules():
        name = type(module).__name__
        if module is model or (prefix and name in (prefix + "Model", prefix + "TextModel")):
            continue
        rest = name[len(prefix):] if prefix and name.startswith(prefix) and len(name) > len(prefix) else name
        if any(s in rest for s in ("Attention", "Mixer", "Mamba", "DeltaNet", "Conv", "Rotary", "Embedding",
                                   "Recurrent", "Lstm", "LSTM", "Moe", "MoE", "Experts", "Router")):
            if name not in kinds and not name.endswith("ForCausalLM"):
                kinds.append(name)
    return kinds


class RestartingPool:
    """A pool that replaces its :class:`LocalPool` after a timeout or a rank failure (the session
    ``pool`` fixture does the same), so one hung family does not lose the rest of the sweep."""

    def __init__(self, world: int = 4, timeout: float = 240.0):
        self.world, self.timeout, self._pool = world, timeout, None

    def run(self, fn, *args, **kwargs):
        from .pool import LocalPool, torch_kernels_only

        if self._pool is None or self._pool.broken:
            self._pool = LocalPool(self.world, timeout=self.timeout, grace=15, init=torch_kernels_only)
        return self._pool.run(fn, *args, **kwargs)

    def close(self):
        if self._pool is not None:
            self._pool.close(force=self._pool.broken)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class SweepResult:
    rows: dict[str, dict[str, Any]]
    seconds: float


def sweep(pool, families: list[str] | None = None, cases=CASES, seq_len: int = 32, batch_size: int = 24,
          progress=None) -> SweepResult:
    """Run the zoo in ``pool`` (4 ranks), ``batch_size`` families per ``pool.run``. A batch that times
    out is rerun family by family; the family that times out alone is a ``hang`` (its case verdicts
    unknown), one that raises on a rank (not caught by the job) a ``crash``."""
    import time

    families = causal_lm_families() if families is None else list(families)
    start = time.monotonic()
    rows: dict[str, dict[str, Any]] = {}
    for i in range(0, len(families), batch_size):
        chunk = families[i:i + batch_size]
        rows.update(_run_chunk(pool, chunk, cases, seq_len))
        if progress:
            progress(i + len(chunk), len(families))
    return SweepResult(rows, time.monotonic() - start)


def _run_chunk(pool, chunk, cases, seq_len):
    try:   # the CP groups of one size share the chunk's families (zoo_job's share)
        return _merge_ranks(pool.run(zoo_job, chunk, cases, seq_len, share=True))
    except Exception as e:  # noqa: BLE001 - find the family that hung or broke the pool
        if len(chunk) > 1:
            out = {}
            for family in chunk:
                out.update(_run_chunk(pool, [family], cases, seq_len))
            return out
        verdict = "hang" if isinstance(e, TimeoutError) else "crash"
        family = chunk[0]
        return {family: {"family": family, "status": "scored", "layer_kinds": [],
                         **{f"{b}{P}": {"verdict": verdict, "reason": "the pool did not finish this family"}
                            for b, P in cases}}}


def _merge_ranks(results: list[dict]) -> dict:
    """Each family's row from the first rank that scored it (the CP groups may share the families); a case whose
    verdict differs across the ranks that ran it is a crash (ranks must agree)."""
    rows: dict = {}
    for result in results:
        for family, row in result.items():
            rows.setdefault(family, row)
    for family, row in rows.items():
        for key, case in row.items():
            if isinstance(case, dict) and "verdict" in case:
                verdicts = {r[family][key]["verdict"] for r in results if key in r.get(family, {})}
                if len(verdicts) > 1:
                    case.update(verdict="crash", reason=f"ranks disagree: {sorted(verdicts)}; {case['reason']}")
    return rows


def summary(rows: dict[str, dict[str, Any]], cases=CASES) -> dict[str, Any]:
    """Counts: scored, excluded, and per case exact / refused / WRONG / crash / hang."""
    scored = [f for f, r in rows.items() if r["status"] == "scored"]
    out: dict[str, Any] = {"families": len(rows), "scored": len(scored),
                           "excluded": len(rows) - len(scored)}
    for b, P in cases:
        key = f"{b}{P}"
        counts: dict[str, int] = {}
        for f in scored:
            v = rows[f].get(key, {}).get("verdict")
            if v:
                counts[v] = counts.get(v, 0) + 1
        out[key] = counts
    return out


def refusal_names_something(row: dict[str, Any], reason: str) -> bool:
    """A refusal must name the layer or feature: the family, one of its module classes, or a config key."""
    words = [row["family"], *row.get("layer_kinds", [])]
    return any(w and w in reason for w in words) or any(
        k in reason for k in ("model_type", "attn_implementation", "layer", "attention", "Attention",
                              "position", "module", "feature"))
