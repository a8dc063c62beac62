"""Memory planner: bytes per rank of one training step under CP, and the longest sequence that fits.

``ringmaster plan --config ...`` prints this. The model is built on the meta device and its decoder
layers read with ``rm.wire``'s classifier (``memory_kinds.layers.describe``); each part's saved bytes
come from its kind's formula (``ringmaster_tools.memory_kinds``: attention, MLP, MoE, each recurrent
kind; ``--kernel fast`` for the GPU packages, ``torch`` for transformers' fallbacks). docs/planner.md
derives each term; ``benchmarks/memory_plan.py`` compares the prediction with the peak of live tensor
bytes measured on CPU (``profiling.track_tensor_memory``).

Where the bytes come from (per rank, S_l = S / P local tokens, b = activation dtype bytes):

* **static**: parameters, gradients, fp32 master weights (mixed precision), AdamW's two fp32
  states; FSDP2 shards all of them over the ``gpus`` ranks and adds the unsharded working copy of
  the layer being computed and the one being prefetched.
* **activations**: what each layer's parts save for backward, times S_l (plus per-layer fixed
  terms). Full checkpointing keeps only each layer's input (plus one layer recomputed during its
  backward); offload moves those inputs to host memory.
* **attention temporaries** (one layer at a time, so counted once): Ulysses' all-to-all buffers,
  Ring's K/V blocks in flight, fp32 merge/gradient accumulators and LSE, all-gathered K/V.
* **logits/loss**: full-vocabulary logits and log-softmax for the shard, or ``chunk`` tokens at a
  time with ``sharding.loss.chunked_nll``.

The peak is the static part plus the largest of the step's moments: the end of the forward, the
loss's and the LM head's backward, each layer's backward (the backward runs the layers, and each
layer's parts, last to first: what the earlier ones keep plus this part's saved tensors and its
backward peak), and the optimizer step.

Not yet run on a GPU: the torch kernels' terms are checked on CPU in fp32 and bf16
(benchmarks/memory_plan.py, docs/benchmarks.md); the fast kernels' are read from their code;
offload and FSDP2 are not measured.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field, replace
from typing import Any

from .memory_kinds import KERNELS, kind_model, norm_bytes
from .memory_kinds.attention import kv_after_replication

GiB = 2 ** 30
MiB = 2 ** 20

BACKENDS = ("ulysses", "ring", "ring-allgather", "usp")
CHECKPOINTING = ("none", "full", "offload")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# families whose attention applies an RMSNorm to q and k per head (Qwen3, Qwen3.5, OLMo2-style)
_QK_NORM_PREFIXES = ("qwen3", "olmo2", "olmo3", "gemma3", "chameleon")


def parse_bytes(text: str | float | int) -> float:
    """``"80GiB"``, ``"80GB"``, ``"141G"``, ``"512MiB"`` or a number of bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().replace(" ", "")
    units = {"tib": 2 ** 40, "gib": GiB, "mib": MiB, "kib": 2 ** 10, "tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3,
             "t": 2 ** 40, "g": GiB, "m": MiB, "k": 2 ** 10, "b": 1}
    low = s.lower()
    for unit in sorted(units, key=len, reverse=True):
        if low.endswith(unit) and low[:-len(unit)]:
            try:
                return float(low[:-len(unit)]) * units[unit]
            except ValueError:
                break
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"--gpu-mem {text!r}: give a size such as 80GiB, 80GB or 141G") from None


# ---------------------------------------------------------------------------------------------
# the model


@dataclass
class ModelShape:
    """What the formulas need from a model. ``layers`` holds each decoder layer's parts as
    ``(kind, dims)``: its norms, its token mixers as ``rm.wire``'s classifier names them
    (``attention`` or a recurrent kind), its MLP (``mlp``/``moe``), each with the sizes its formula
    in ``ringmaster_tools.memory_kinds`` reads; ``layer_kinds`` labels each layer (``attention``,
    ``gated_deltanet``, ``mlp only``, ...)."""

    model_type: str
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_kinds: list[str]
    tied: bool = False
    layers: list[list[tuple[str, dict]]] = field(default_factory=list)
    final_norm: dict | None = None    # the norm before the LM head (dims as norm parts)
    rope_width: int = 0               # channels of RoPE's cos + sin (saved once per forward)
    n_params: int = 0                 # exact, from the model built on the meta device when possible
    largest_param: int = 0            # elements of the largest single parameter tensor
    embed_params: int = 0             # input embedding (+ LM head when untied)
    params_source: str = "closed form"
    layers_source: str = "config (attention + dense MLP)"
    model: Any = field(default=None, repr=False, compare=False)   # built on the meta device, when it could be

    def __post_init__(self):
        if not self.layers:   # no model to read: every layer an attention + dense MLP layer with RMSNorms
            norm = {"width": self.hidden, 4: (norm_bytes(self.hidden, 4), 0), 2: (norm_bytes(self.hidden, 2), 0)}
            attn = {"hidden": self.hidden, "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                    "qk_norm": self.model_type.startswith(_QK_NORM_PREFIXES), "gate": False}
            mlp = {"hidden": self.hidden, "intermediate": self.intermediate, "gated": True, "act": "SiLUActivation"}
            self.layers = [[("norm", norm), ("attention", attn), ("norm", norm), ("mlp", mlp)]
                           for _ in self.layer_kinds]
            self.final_norm = self.final_norm or norm

    @property
    def layers_count(self) -> int:
        return len(self.layer_kinds)

    @property
    def moe(self) -> dict | None:
        """The dims of the first MoE block, None without one."""
        return next((d for layer in self.layers for k, d in layer if k == "moe"), None)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (the mean; the unit FSDP2 gathers at once)."""
        return max((self.n_params - self.embed_params) // max(self.layers_count, 1), 1)

    @classmethod
    def from_config(cls, config, count_params: bool = True) -> "ModelShape":
        """Sizes from the config; parameters and every layer's parts from the model built on the
        meta device (no memory) and classified as ``rm.wire`` classifies it. ``count_params=False``
        or a model that cannot be built: the closed form over attention + dense MLP layers."""
        text = getattr(config, "get_text_config", lambda: config)()
        g = lambda *names, default=0: next((getattr(text, n) for n in names  # noqa: E731
                                            if getattr(text, n, None) is not None), default)
        hidden = g("hidden_size", "d_model", "n_embd", "embedding_dim")
        heads = g("num_attention_heads", "n_head", "num_heads", default=1)
        head_dim = g("head_dim", default=hidden // max(heads, 1))
        n_layers = g("num_hidden_layers", "n_layer", "num_blocks")
        mt = getattr(config, "model_type", "") or getattr(text, "model_type", "")
        shape = cls(
            model_type=mt, hidden=hidden, intermediate=g("intermediate_size", "ffn_dim", default=4 * hidden),
            vocab=g("vocab_size"), heads=heads, kv_heads=g("num_key_value_heads", default=heads), head_dim=head_dim,
            layer_kinds=["attention"] * n_layers, tied=bool(getattr(config, "tie_word_embeddings", False)),
        )
        shape.n_params, shape.largest_param, shape.embed_params = shape._closed_form_params()
        model = _meta_model(config) if count_params else None
        if model is not None:
            shape.n_params, shape.largest_param, shape.embed_params = _param_count(model)
            shape.params_source = "counted on the meta device"
            shape.read_layers(model)
            shape.model = model
        return shape

    def read_layers(self, model) -> None:
        """Every decoder layer's parts from ``model`` (real or on the meta device)."""
        from .memory_kinds.attention import rope_width
        from .memory_kinds.layers import describe, final_norm

        layers = describe(model)
        self.layers = [[(p.kind, p.dims) for p in layer.parts] for layer in layers]
        self.layer_kinds = [layer.label for layer in layers]
        self.final_norm = final_norm(model)
        self.rope_width = rope_width(model)
        self.layers_source = "classified as rm.wire does, on the meta device"

    def _closed_form_params(self) -> tuple[int, int, int]:
        h, v = self.hidden, self.vocab
        embed = v * h * (1 if self.tied else 2)
        attn = h * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * h
        total = embed + len(self.layer_kinds) * (attn + 3 * h * self.intermediate + 2 * h)
        return total, v * h, embed


def _meta_model(config):
    """The causal LM built on the meta device (no memory), or None when this family cannot be built."""
    import contextlib
    import io

    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # any family-specific build failure: fall back to the closed form
        return None


def _param_count(model) -> tuple[int, int, int]:
    """(parameters, largest tensor, embedding + head) of a model (exact; tied weights once)."""
    seen, total, largest = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        largest = max(largest, p.numel())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        embed += head.weight.numel()
    return total, largest, embed


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class PlanOptions:
    seq: int
    gpus: int = 8                      # CP degree; FSDP2 (when on) shards over the same ranks
    gpu_mem: float = 80 * GiB
    dtype: str = "bf16"                # activation/parameter compute dtype
    master_weights: bool | None = None  # fp32 master copy; default: on for 16-bit dtypes
    checkpointing: str = "none"        # none | full | offload
    fsdp: str = "none"                 # none | full
    backend: str = "ulysses"           # ulysses | ring | ring-allgather | usp
    ulysses: int | None = None         # USP split (default: the largest divisor of gpus dividing kv heads)
    loss: str = "full"                 # full | chunked
    chunk: int = 1024
    batch: int = 1
    optimizer: str = "foreach"         # AdamW implementation: foreach (torch's GPU default), fused, forloop (CPU)
    reserve: float = 0.0               # bytes kept free (allocator fragmentation, CUDA context)
    kernel: str = "fast"               # fast: flash-attn / FLA / mamba-ssm / causal-conv1d (GPU); torch: the fallbacks

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def mixed(self) -> bool:
        return self.master_weights if self.master_weights is not None else self.b < 4


@dataclass
class Plan:
    shape: ModelShape
    opts: PlanOptions
    parts: dict[str, float] = field(default_factory=dict)      # name -> bytes per rank
    activations: dict[str, float] = field(default_factory=dict)  # layer kind -> saved bytes, all layers
    moments: dict[str, float] = field(default_factory=dict)    # forward-end / backward-end / optimizer
    host_bytes: float = 0.0                                    # offloaded activations in host memory
    static: float = 0.0
    total: float = 0.0

    @property
    def fits(self) -> bool:
        return self.total + self.opts.reserve <= self.opts.gpu_mem


def _usp_split(shape: ModelShape, gpus: int, ulysses: int | None) -> tuple[int, int]:
    if ulysses:
        return ulysses, gpus // ulysses
    best = 1
    for u in range(1, gpus + 1):
        if gpus % u == 0 and shape.heads % u == 0 and (shape.kv_heads % u == 0 or u % shape.kv_heads == 0):
            best = u
    best = best if best < gpus else max((d for d in range(1, gpus) if gpus % d == 0 and shape.heads % d == 0),
                                        default=1)
    return best, gpus // best


def _heads_indivisible(shape: ModelShape, u: int) -> bool:
    return shape.heads % u != 0


def split_of(shape: ModelShape, opts: PlanOptions) -> tuple[int, int]:
    """(ulysses size, ring size) of the backend."""
    P = opts.gpus
    if opts.backend == "ulysses" and not any(k == "attention" for layer in shape.layers for k, _ in layer):
        return P, 1   # no attention layer: nothing to split by heads
    if opts.backend == "ulysses":
        if _heads_indivisible(shape, P):
            raise ValueError(f"{shape.heads} heads do not split over ulysses {P}; use ring or usp")
        return P, 1
    if opts.backend in ("ring", "ring-allgather"):
        return 1, P
    if opts.backend == "usp":
        return _usp_split(shape, P, opts.ulysses)
    raise ValueError(f"--backend {opts.backend!r}: use one of {', '.join(BACKENDS)}")


# ---------------------------------------------------------------------------------------------
# activations: what each layer's parts save for backward (ringmaster_tools.memory_kinds)


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer's parts in forward order (pre-norm: a norm, the mixers, the other norms, the
    MLP): ``(saved, backward, is attention)`` each, in bytes."""
    parts: tuple[tuple[float, float, bool], ...]

    @property
    def saved(self) -> float:
        return sum(p[0] for p in self.parts)

    def backward_peak(self, attention_temporaries: float = 0.0) -> float:
        """The largest the layer's own tensors get during its backward, which runs the parts last to first:
        at part p, what the parts before it saved, p's saved tensors and p's backward peak beyond them (an
        attention part also holds the backend's backward buffers). This is also the recomputed layer's
        under checkpointing: non-reentrant checkpointing recomputes the layer whole, and each recomputed
        tensor is freed once its op's backward used it."""
        before, peak = 0.0, 0.0
        for saved, backward, attention in self.parts:
            peak = max(peak, before + saved + backward + (attention_temporaries if attention else 0.0))
            before += saved
        return peak


@functools.lru_cache(maxsize=None)
def _saved_parameters(kind: str) -> frozenset[str]:
    """The keyword arguments ``kind``'s ``saved`` takes (read once: ``max_seq`` plans hundreds of times)."""
    return frozenset(inspect.signature(kind_model(kind).saved).parameters)


def _forward_order(parts: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    norms = [p for p in parts if p[0] == "norm"]
    mixers = [p for p in parts if p[0] not in ("norm", "mlp", "moe")]
    mlps = [p for p in parts if p[0] in ("mlp", "moe")]
    return norms[:1] + mixers + norms[1:] + mlps


def layer_bytes(parts: list[tuple[str, dict]], b: int, tokens: int, kernel: str, P: int, backend: str,
                ulysses: int = 1) -> LayerBytes:
    """One decoder layer at ``tokens`` local tokens: each part's ``saved`` and ``backward``
    (``memory_kinds.<kind>.saved``; norms traced on one or two tokens)."""
    out = []
    for kind, d in _forward_order(parts):
        if kind == "norm":
            per_token, fixed = d[b] if b in d else d[2 if b < 4 else 4]
            out.append((per_token * tokens + fixed, 0.0, False))
            continue
        model = kind_model(kind)
        accepts = _saved_parameters(kind)
        kwargs = {"ulysses": ulysses} if kind == "attention" else {}
        if "tokens" in accepts:   # Mamba1 under CP: chunks longer than a tile keep their decays out of the graph
            kwargs["tokens"] = tokens
        if "worst" in accepts:    # the rank that holds the most (every chunk takes a state in and passes one on)
            kwargs["worst"] = True
        est = model.saved(d, b, kernel, P, backend, **kwargs)
        out.append((est.at(tokens), est.backward * tokens, kind == "attention"))
    return LayerBytes(tuple(out))


def kernel_sources(shape: ModelShape, kernel: str) -> dict[str, str]:
    """Layer kind -> the function its formula is read from, for ``kernel``."""
    out = {}
    for layer in shape.layers:
        for kind, d in layer:
            if kind != "norm" and kind not in out:
                out[kind] = kind_model(kind).saved(d, 2, kernel).source
    return out


# ---------------------------------------------------------------------------------------------
# attention temporaries per backend (one layer at a time)


def attention_temporaries(s: ModelShape, opts: PlanOptions) -> dict[str, float]:
    """Bytes per rank that one attention layer holds only while it runs, forward and backward (what
    the backend saves beyond the plain kernel is in ``memory_kinds.attention.saved``)."""
    b, S_l = opts.b, opts.seq // opts.gpus * opts.batch
    u, r = split_of(s, opts)
    qd = s.heads * s.head_dim
    kv_u = kv_after_replication(s.kv_heads, u)
    kvd = kv_u * s.head_dim                    # per-token K or V width after replication
    a2a = b * (qd + 2 * kvd) if u > 1 else 0.0
    # Ulysses: the contiguous send copy and the receive buffer of q, k, v (forward), of dq, dk, dv
    # (backward); the output's all-to-all moves qd per token in each direction
    fwd = 2 * a2a + (2 * b * qd if u > 1 else 0)
    bwd = 2 * a2a + (2 * b * qd if u > 1 else 0)
    if r > 1:
        kv_block = 2 * b * kvd                 # one K/V block per local token
        if opts.backend == "ring-allgather":
            fwd += kv_block * (r + 1) + 2 * 4 * qd + 8 * s.heads
            bwd += 4 * 2 * kvd * r + 4 * qd + kv_block
        else:
            # the packed K/V, the block in use and the one in flight; fp32 merge (running and new output)
            fwd += 3 * kv_block + 2 * 4 * qd + b * qd + 8 * s.heads
            # dq accumulator (fp32), dK/dV accumulator sent and received (fp32), K/V blocks, block grads
            bwd += 4 * qd + 2 * (4 * 2 * kvd) + 3 * kv_block + b * (qd + 2 * kvd)
    return {"forward": fwd * S_l, "backward": bwd * S_l,
            "split": f"ulysses {u} x ring {r}" + (" (allgather)" if opts.backend == "ring-allgather" else ""),
            "kv_heads": kv_u}


# ---------------------------------------------------------------------------------------------
# logits and loss


def loss_bytes(s: ModelShape, opts: PlanOptions) -> dict[str, float]:
    """Logits and loss per rank. Full (HF's loss): the logits [S_l, V] (b), their fp32 upcast (16-bit
    only) and the fp32 log-softmax exist together in the forward; only the log-softmax is saved. Its
    backward holds the log-softmax, the incoming gradient and the logits' gradient (fp32, 12 V per
    token); then the LM head's backward holds the logits' gradient in b and the head's weight
    gradient. Chunked (``chunked_nll``): nothing saved; the same, ``chunk`` tokens at a time, with
    the forward recomputed in the backward."""
    b, V = opts.b, s.vocab
    S_l = opts.seq // opts.gpus * opts.batch
    up = 4 if b < 4 else 0
    tokens = min(opts.chunk, S_l) if opts.loss == "chunked" else S_l
    return {"forward": tokens * V * (b + up + 4),
            "backward": tokens * V * max(12, b + up + 4),
            "grad_logits": tokens * V * (b + (4 if b < 4 else 0)),
            "saved": 0.0 if opts.loss == "chunked" else S_l * V * 4,
            "tokens": tokens}


# ---------------------------------------------------------------------------------------------
# the plan


def _static(s: ModelShape, opts: PlanOptions) -> dict[str, float]:
    N, G, b = s.n_params, opts.gpus, opts.b
    if opts.fsdp == "full":
        p_bytes = 4 if opts.mixed else b
        return {
            "parameters (sharded; fp32 = the master copy)" if opts.mixed else "parameters (sharded)": N * p_bytes / G,
            "gradients (sharded)": N * p_bytes / G,
            "optimizer state (AdamW m, v fp32, sharded)": 8 * N / G,
            # FSDP2 all-gathers the layer being computed and prefetches the next (compute dtype)
            "unsharded layers in flight (2 x one layer)": 2 * b * s.layer_params,
        }
    parts = {"parameters": N * b, "gradients": N * b, "optimizer state (AdamW m, v fp32)": 8 * N}
    if opts.mixed:
        parts["master weights (fp32)"] = 4 * N
    return parts


def _optimizer_temporaries(s: ModelShape, opts: PlanOptions) -> float:
    """AdamW's step: foreach computes sqrt(v) for every (local) parameter at once (one fp32 copy of
    them all); the for-loop version two fp32 temporaries of one parameter (the largest); fused none."""
    if opts.optimizer == "fused":
        return 0.0
    if opts.optimizer == "forloop":
        return 2 * 4 * s.largest_param
    if opts.optimizer == "foreach":
        return 4 * s.n_params / (opts.gpus if opts.fsdp == "full" else 1)
    raise ValueError(f"--optimizer {opts.optimizer!r}: use foreach, fused or forloop")


def plan(shape: ModelShape, opts: PlanOptions) -> Plan:
    """Bytes per rank of one training step (see the module docstring for the accounting)."""
    if opts.checkpointing not in CHECKPOINTING:
        raise ValueError(f"--checkpointing {opts.checkpointing!r}: use one of {', '.join(CHECKPOINTING)}")
    if opts.fsdp not in ("none", "full"):
        raise ValueError(f"--fsdp {opts.fsdp!r}: use none or full")
    if opts.loss not in ("full", "chunked"):
        raise ValueError(f"--loss {opts.loss!r}: use full or chunked")
    if opts.kernel not in KERNELS:
        raise ValueError(f"--kernel {opts.kernel!r}: use one of {', '.join(KERNELS)}")
    s, b, P = shape, opts.b, opts.gpus
    S_l = opts.seq // P * opts.batch
    u, r = split_of(s, opts)
    out = Plan(s, opts)
    statics = _static(s, opts)
    grads = next(v for k, v in statics.items() if k.startswith("gradients"))
    out.static = sum(v for k, v in statics.items() if not k.startswith("gradients"))
    fsdp = opts.fsdp == "full"
    gb = 4 if (fsdp and opts.mixed) else b        # gradient bytes per parameter

    has_attention = any(kind == "attention" for layer in s.layers for kind, _ in layer)
    temps = attention_temporaries(s, opts)
    loss = loss_bytes(s, opts)
    per_label: dict[str, float] = {}
    layers = []    # per layer, in forward order: (kept for backward, its LayerBytes)
    for label, parts in zip(s.layer_kinds, s.layers):
        lb = layer_bytes(parts, b, S_l, opts.kernel, P, opts.backend, ulysses=u)
        if opts.checkpointing == "none":
            kept = lb.saved
        elif opts.checkpointing == "full":
            kept = b * s.hidden * S_l      # the layer input, the checkpoint's only saved tensor
        else:
            kept = 0.0                      # offloaded to host memory
            out.host_bytes += b * s.hidden * S_l
        per_label[label] = per_label.get(label, 0.0) + kept
        layers.append((kept, lb))
    for label, v in per_label.items():
        out.activations[f"{label} layers (x{s.layer_kinds.count(label)})"] = v
    act = sum(per_label.values())
    ckpt = opts.checkpointing != "none"
    # outside the layers: RoPE's cos/sin (saved once, by the first attention layer), the final norm and
    # its output (the LM head's input), the token ids
    final = s.final_norm or {b: (norm_bytes(s.hidden, b), 0)}
    fn_tok, fn_fixed = final[b] if b in final else final[2 if b < 4 else 4]
    head = (s.rope_width * b + fn_tok + b * s.hidden + 8) * S_l + fn_fixed

    head_grad = s.vocab * s.hidden * gb / (P if fsdp else 1)
    attn_fwd = temps["forward"] if has_attention else 0.0
    attn_bwd = temps["backward"] if has_attention else 0.0
    # layer i's backward (the backward runs the layers last to first, so what layers i+1.. saved is freed
    # and the head's tensors are gone): what layers 0..i-1 keep, the head's weight gradient, its weight
    # gradients (unsharded under FSDP2 until the reduce-scatter) and its own tensors at their backward peak
    # with the incoming and produced gradients (LayerBytes.backward_peak: the
    # same walk over its parts, the attention's backward buffers with its attention part); checkpointing:
    # the layer recomputed whole (the same walk) beside its kept input and output; offload keeps ~2 layer
    # inputs on the GPU in flight
    layer_grads = s.layer_params * (b + (4 if fsdp and opts.mixed else 0))
    kept_before, layer_moment, recompute = 0.0, 0.0, 0.0
    for kept, lb in layers:
        own = lb.backward_peak(attn_bwd)   # each part's backward counts its incoming and produced gradients
        if ckpt:
            own += kept + b * s.hidden * S_l + (2 * b * s.hidden * S_l if opts.checkpointing == "offload" else 0)
            recompute = max(recompute, lb.saved)
        layer_moment = max(layer_moment, kept_before + own + layer_grads)
        kept_before += kept
    out.moments = {
        # the loss's forward terms include the log-softmax it saves
        "forward end": act + head + max(loss["forward"], loss["saved"] + attn_fwd),
        "loss backward": act + head + loss["backward"],
        "LM head backward": act + head + loss["grad_logits"] + head_grad + b * s.hidden * S_l,
        "layer backward": head_grad + layer_moment,
        "optimizer step": grads + _optimizer_temporaries(s, opts),
    }
    out.parts = dict(statics)
    out.parts["activations (saved for backward)"] = act + head
    if recompute:
        out.parts["recomputed layer (during its backward)"] = recompute
    out.parts[f"attention temporaries ({opts.backend}: {temps['split']})"] = max(attn_fwd, attn_bwd)
    out.parts[f"logits/loss ({'chunked ' + str(loss['tokens']) if opts.loss == 'chunked' else 'full'})"] = (
        max(loss["forward"], loss["backward"]) + loss["saved"])
    out.total = out.static + max(out.moments.values())
    return out


def max_seq(shape: ModelShape, opts: PlanOptions, multiple: int | None = None, limit: int = 1 << 27) -> int:
    """The longest sequence (a multiple of ``multiple``, default 2 x gpus: head_tail layout) whose
    plan fits in ``gpu_mem - reserve``; 0 when not even the smallest does. Bisection: the total grows
    with S."""
    m = multiple or 2 * opts.gpus
    fits = lambda S: plan(shape, replace(opts, seq=S)).fits  # noqa: E731
    if not fits(m):
        return 0
    lo, hi = 1, 2
    while hi * m <= limit and fits(hi * m):
        lo, hi = hi, hi * 2
    if hi * m > limit:
        return lo * m
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * m) else (lo, mid)
    return lo * m


# ---------------------------------------------------------------------------------------------
# loading and printing


def load_config(target: str, tool: str = "plan", flag: str = "--config "):
    """A config from a ``config.json`` path, a model directory holding one, or a ``model_type``
    (transformers' defaults for that type), read by the family's own config class (transformers'
    JSON has its own encoding of inf). Never downloads. ``tool``/``flag`` name the command in errors
    (``ringmaster check`` shares this loader)."""
    import json

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if os.path.isdir(target):
        target = os.path.join(target, "config.json")
    if os.path.isfile(target):
        with open(target) as f:
            model_type = json.load(f).get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise SystemExit(f"ringmaster {tool}: {target} has model_type {model_type!r}, which transformers does "
                             "not know; pass a config.json of a known model_type")
        return CONFIG_MAPPING[model_type].from_json_file(target)
    if target.endswith(".json"):
        raise SystemExit(f"ringmaster {tool}: {flag}{target}: no such file")
    try:
        return AutoConfig.for_model(target)
    except ValueError:
        raise SystemExit(f"ringmaster {tool}: {flag}{target!r} is neither a file, a directory nor a model_type "
                         "transformers knows (the known ones: transformers.CONFIG_MAPPING.keys())") from None


def _fmt(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if abs(n) >= GiB / 10 else f"{n / MiB:8.1f} MiB"


def _fmt_seq(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f}M"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.0f}K"
    return str(n)


def report(shape: ModelShape, opts: PlanOptions, name: str = "") -> str:
    """What ``ringmaster plan --config`` prints: the breakdown at ``opts.seq`` and the longest
    sequence that fits per backend and checkpointing mode."""
    p = plan(shape, opts)
    kinds = ", ".join(f"{shape.layer_kinds.count(k)} {k}" for k in dict.fromkeys(shape.layer_kinds))
    lines = [
        f"model: {name or shape.model_type} ({shape.model_type}): {shape.n_params / 1e9:.2f}B parameters "
        f"({shape.params_source}), {shape.layers_count} layers ({kinds}), hidden {shape.hidden}, "
        f"{shape.heads} heads / {shape.kv_heads} KV heads x {shape.head_dim}, vocab {shape.vocab}"
        + (f", MoE {shape.moe.get('experts', '?')} experts top-{shape.moe.get('top_k', '?')}" if shape.moe else "")
        + f"; layers {shape.layers_source}",
        f"kernels ({opts.kernel}): " + "; ".join(f"{k}: {v}" for k, v in kernel_sources(shape, opts.kernel).items()),
        f"run: seq {opts.seq} on {opts.gpus} GPUs x {opts.gpu_mem / GiB:.0f} GiB (CP {opts.gpus}, "
        f"{opts.seq // opts.gpus} tokens per rank), {opts.dtype}{' + fp32 master weights' if opts.mixed else ''}, "
        f"AdamW ({opts.optimizer}), FSDP2 {opts.fsdp}, checkpointing {opts.checkpointing}, loss {opts.loss}, "
        f"backend {opts.backend}",
        "",
        f"per rank at seq {opts.seq}:",
    ]
    for k, v in p.parts.items():
        if k.startswith("activations"):
            lines.append(f"  {k:<58} {_fmt(v)}")
            for kk, vv in p.activations.items():
                lines.append(f"    {kk:<56} {_fmt(vv)}")
        elif v or not k.startswith("master"):
            lines.append(f"  {k:<58} {_fmt(v)}")
    if p.host_bytes:
        lines.append(f"  {'offloaded layer inputs (host memory, not GPU)':<58} {_fmt(p.host_bytes)}")
    worst = max(p.moments, key=p.moments.get)
    lines.append(f"  {'peak (static + largest moment: ' + worst + ')':<58} {_fmt(p.total)}"
                 f"   {'fits' if p.fits else 'does NOT fit'} in {opts.gpu_mem / GiB:.0f} GiB")
    lines += ["", f"longest sequence that fits in {opts.gpu_mem / GiB:.0f} GiB per GPU "
              f"(x{opts.gpus} GPUs, loss {opts.loss}, FSDP2 {opts.fsdp}):",
              f"  {'backend':<16}" + "".join(f"{'ckpt ' + c:>16}" for c in CHECKPOINTING)]
    longest = 0
    for backend in BACKENDS:
        if backend == "usp" and opts.gpus < 4:
            continue
        o = replace(opts, backend=backend)
        try:
            split = attention_temporaries(shape, o)["split"]
            seqs = [max_seq(shape, replace(o, checkpointing=c)) for c in CHECKPOINTING]
        except (ValueError, ZeroDivisionError) as e:
            lines.append(f"  {backend:<16} invalid: {e}")
            continue
        longest = max(longest, *seqs)
        lines.append(f"  {backend:<16}" + "".join(f"{_fmt_seq(c):>16}" for c in seqs) + f"   ({split})")
    if not longest:
        lines += fit_hints(shape, opts, p)
    lines += recurrent_choice(shape, opts)
    lines.append("(per-kind formulas, docs/planner.md: the torch kernels' within 0.94-1.08 of measured CPU peaks on "
                 "llama, gated-DeltaNet, Mamba2, Mamba1 and MoE models; the fast kernels' read from their "
                 "save_for_backward, not measured; not yet run on a GPU: leave headroom for the CUDA context and the "
                 "allocator)")
    return "\n".join(lines)


def recurrent_choice(shape: ModelShape, opts: PlanOptions) -> list[str]:
    """What ``recurrent="auto"`` picks for each recurrent layer at CP ``opts.gpus`` and ``opts.seq``, from the same
    byte counts ``rm.wire``'s probe records (:func:`ringmaster.recurrent.wiring.layer_costs`, run on the meta
    model): heads where it sends no more than the state passing, with both sides' bytes per layer and row."""
    if shape.model is None or opts.gpus <= 1:
        return []
    import copy

    import torch

    from ringmaster.recurrent.scan import auto_strategy
    from ringmaster.recurrent.wiring import check_recurrent_layers, layer_costs

    kinds = {path: kind for path, _, kind in check_recurrent_layers(shape.model)}
    if not kinds:
        return []
    P, S = opts.gpus, opts.seq
    fallback = auto_strategy(P)
    rows: dict[tuple, int] = {}
    # the activations in the run's dtype (the meta model: no memory to copy or cast)
    model = copy.deepcopy(shape.model).to({"bf16": torch.bfloat16, "fp16": torch.float16}.get(opts.dtype, torch.float32))
    for path, cost in layer_costs(model, P).items():
        if isinstance(cost, str):
            key = (kinds[path], f"{fallback} (not estimated: {cost})", "")
        else:
            heads = cost.sent("heads", S)
            at = (f"at seq {S}: {cost.pick(S, fallback)} (heads {_fmt(heads).strip() if heads is not None else '-'}"
                  f", {fallback} {_fmt(cost.sent(fallback, S)).strip()} per row)")
            key = (kinds[path], cost.describe(fallback), at)
        rows[key] = rows.get(key, 0) + 1
    lines = ["", f'recurrent="auto" at CP {P}, per layer (bytes one rank sends per row, forward; rm.wire reports the '
             "same in runtime.report.recurrent_choice):"]
    lines += [f"  {n} x {kind}: {what}" + (f"; {at}" if at else "") for (kind, what, at), n in rows.items()]
    return lines


def _seqs(shape: ModelShape, opts: PlanOptions) -> list[int]:
    """The longest sequence that fits under ``opts`` per checkpointing mode (:data:`CHECKPOINTING`); 0 where the
    options are invalid for this model."""
    try:
        return [max_seq(shape, replace(opts, checkpointing=c)) for c in CHECKPOINTING]
    except (ValueError, ZeroDivisionError):
        return [0] * len(CHECKPOINTING)


def fit_hints(shape: ModelShape, opts: PlanOptions, p: Plan | None = None) -> list[str]:
    """When no sequence fits under ``opts`` with any backend or checkpointing mode: what takes the memory and the
    flags that would make something fit, each with the longest sequence it gives per checkpointing mode
    (``opts.backend``): the changes alone, together, then together with twice the GPUs."""
    p = p or plan(shape, opts)
    lines = ["", f"nothing fits in {opts.gpu_mem / GiB:.0f} GiB per GPU: parameters, gradients, optimizer state"
             + (" and master weights" if opts.mixed else "") + f" alone take {_fmt(p.static).strip()} per rank"
             + (" (FSDP2 off: every rank holds all of them)" if opts.fsdp != "full" else "")
             + "; checkpointing (the columns above) shrinks only the activations. With these flags "
             f"({opts.backend}):",
             f"  {'flags':<56}" + "".join(f"{'ckpt ' + c:>16}" for c in CHECKPOINTING)]
    changes = []
    if opts.fsdp != "full":
        changes.append(("--fsdp full", dict(fsdp="full")))
    if opts.loss != "chunked":
        changes.append(("--loss chunked", dict(loss="chunked")))
    if opts.optimizer == "foreach":
        changes.append(("--optimizer fused", dict(optimizer="fused")))
    together = {k: v for _, c in changes for k, v in c.items()}
    tries = list(changes)
    if len(changes) > 1:
        tries.append((" ".join(f for f, _ in changes), together))
    tries.append((" ".join([f for f, _ in changes] + [f"--gpus {2 * opts.gpus}"]), {**together, "gpus": 2 * opts.gpus}))
    seqs = []
    for flags, change in tries:
        seqs = _seqs(shape, replace(opts, **change))
        lines.append(f"  {flags:<56}" + "".join(f"{_fmt_seq(n):>16}" for n in seqs))
    if not any(seqs):
        lines.append("  still nothing: more GPUs (--gpus), more memory per GPU (--gpu-mem), or a smaller model")
    return lines


def add_arguments(parser) -> None:
    """``ringmaster plan``'s memory-planner flags (cli.py calls this)."""
    parser.add_argument("--config", default=None,
                        help="memory plan for this model: config.json, a model directory or a model_type")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs = CP degree (memory plan; default --world or 8)")
    parser.add_argument("--gpu-mem", default="80GiB", help="memory per GPU (default 80GiB)")
    parser.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                        help="activation checkpointing: none, full (every layer), offload (layer inputs to host)")
    parser.add_argument("--offload", choices=["none", "activations"], default="none",
                        help="'activations' = --checkpointing offload")
    parser.add_argument("--fsdp", choices=["none", "full"], default="none", help="FSDP2 sharding over the GPUs")
    parser.add_argument("--backend", choices=BACKENDS, default="ulysses", help="CP backend for the breakdown")
    parser.add_argument("--loss", choices=["full", "chunked"], default="full",
                        help="full-vocabulary logits, or sharding.loss.chunked_nll (--loss-chunk tokens at a time)")
    parser.add_argument("--loss-chunk", type=int, default=1024)
    parser.add_argument("--optimizer", choices=["foreach", "fused", "forloop"], default="foreach",
                        help="AdamW implementation (its step's temporaries): foreach (torch's GPU default), fused, "
                             "forloop")
    parser.add_argument("--no-master-weights", action="store_true", help="no fp32 master copy for 16-bit dtypes")
    parser.add_argument("--kernel", choices=KERNELS, default="fast",
                        help="the kernels the activations are counted for: fast (flash-attn, flash-linear-attention, "
                             "mamba-ssm, causal-conv1d: a GPU run with them installed; default) or torch (transformers' "
                             "pure-torch fallbacks: CPU, or a GPU without those packages)")


def run_from_args(args) -> int:
    config = load_config(args.config)
    shape = ModelShape.from_config(config)
    gpus = args.gpus or getattr(args, "world", None) or 8
    checkpointing = "offload" if args.offload == "activations" else args.checkpointing
    opts = PlanOptions(seq=args.seq, gpus=gpus, gpu_mem=parse_bytes(args.gpu_mem), dtype=args.dtype,
                       master_weights=False if args.no_master_weights else None, checkpointing=checkpointing,
                       fsdp=args.fsdp, backend=args.backend, loss=args.loss, chunk=args.loss_chunk,
                       optimizer=args.optimizer, kernel=args.kernel,
                       batch=getattr(args, "batch", 1) or 1)
    if opts.seq % gpus:
        raise SystemExit(f"ringmaster plan: --seq {opts.seq} is not divisible by --gpus {gpus}")
    name = os.path.basename(os.path.dirname(args.config)) if args.config.endswith("config.json") else args.config
    try:
        print(report(shape, opts, name=name))
    except ValueError as e:
        raise SystemExit(f"ringmaster plan: {e}") from None
    return 0


__all__ = ["ModelShape", "PlanOptions", "Plan", "plan", "max_seq", "report", "parse_bytes", "load_config",
           "attention_temporaries", "loss_bytes", "layer_bytes", "kernel_sources", "norm_bytes"]
