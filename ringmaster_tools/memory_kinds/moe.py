"""Mixture-of-experts MLP blocks: router, dispatch of the routed token copies, experts, combine, and the
shared expert(s) where the family has them.

Families (transformers 5.24): ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``Qwen3NextSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock`` (softmax top-k
router; Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE add a gated shared expert ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)``) and ``NemotronHMoE`` (the "E" layers: fp32 sigmoid router with group-limited top-k
and score correction bias, non-gated relu2 experts, an ungated relu2 shared expert, optional latent
projections).

Experts run through ``config._experts_implementation`` (``transformers.integrations.moe``,
``@use_experts_implementation``). transformers' default is ``"grouped_mm"``
(``PreTrainedModel.get_correct_experts_implementation``) on CPU and GPU alike: with torch >= 2.10
``_grouped_mm`` calls ``torch.nn.functional.grouped_mm`` on CPU (any dtype, aligned weights) and on CUDA
(SM80+), whose autograd formula saves the same tensors on both devices (its input and offsets; the
weight is a parameter). So the default CPU kernel (kernel="torch") and the GPU training default
(kernel="fast") are one formula; ``dims()["impl"]`` records the implementation the model is set to and
``saved`` models ``grouped_mm``, ``eager`` (the family's own loop) and ``batched_mm``. ``deepgemm`` /
``sonicmoe`` (opt-in fused GPU kernels) are estimated as ``grouped_mm``.

Per local token, ``k`` = top-k, ``E`` experts, ``h`` the experts' input width (hidden, or the latent
width), ``I`` the expert intermediate size, ``b`` the activation bytes, ``w`` the routing weights' bytes
(``b`` when the router casts them to the logits' dtype: Qwen families; 4 when it leaves them fp32:
Mixtral, Nemotron-H):

========================  =========================================  ==========================================
term                      bytes per token                            saved by
========================  =========================================  ==========================================
block input x             ``b*hidden``                               router ``F.linear`` (or the shared expert /
                                                                     latent projection when the router casts)
router input in fp32      ``4*hidden`` (b != 4, fp32 routers)        Nemotron-H ``F.linear(x.float(), W.float())``
softmax router            ``4*E`` probs + ``8*k`` top-k indices      ``softmax(dtype=float)``, ``topk``
  top-k renormalisation   ``4*k + 4``                                in-place ``/=`` (values, fp32 sum)
sigmoid group router      ``4*E`` scores + ``8*2*G`` group top-2     ``sigmoid``, ``topk`` (x2), ``masked_fill``,
                          + ``8*topk_group`` + ``E`` (bool mask)     ``gather``, ``/=``
                          + ``8*k`` + ``4*k + 4`` (renormalised)
grouped_mm dispatch       ``3*8*k`` (perm // k, perm, inv_perm)      the three index ops
                          + ``w*k`` sorted routing weights           the combine's ``mul``
grouped_mm experts        ``k*b*(h + 4I + h)`` gated                 up ``grouped_mm`` (the gathered copies),
                          ``k*b*(h + 2I + h)`` non-gated (relu2)     act / mul (gate_up output, act, product:
                                                                     as the dense MLP), the combine's ``mul``
                                                                     (the down output)
eager experts             ``k*(b*(h + 4I|2I + h) + f*h + w + 16)``   per expert: gather, linear, act, mul,
                                                                     ``index_add_`` (its source, in the output
                                                                     buffer's dtype f: b, fp32 for Nemotron-H),
                                                                     ``torch.where``'s int64 pairs
batched_mm experts        ``k*(b*(3I|2I)*h + b*(h + 4I|2I + h) + w)``  ``bmm`` saves each copy's gathered
                                                                     expert weights ``W[expert_ids]``
shared expert             dense MLP less its input (``mlp.saved``)   ``<Family>MLP``
  sigmoid gate            ``b`` + ``b*hidden``                       ``sigmoid``, ``mul`` (shared output)
latent (Nemotron-H)       ``b*latent``                               ``fc2_latent_proj``
fixed                     ``4*E`` int32 offsets (grouped_mm)         ``grouped_mm``
                          + ``4*E*hidden`` (b != 4, fp32 routers)    the router weight's fp32 copy
========================  =========================================  ==========================================

Every routed copy is computed (no capacity drop), so the copies are exactly ``k`` per token at any S.
The MLP is per token: under Ulysses or Ring (P=2) the block sees S/P local tokens and saves the same per
token (checked: ``benchmarks/memory_kinds.py --kinds moe --P 1,2``).

Counted as the probe counts them (every storage packed for backward): the Nemotron-H router's group
top-k indices (``8*(2G + topk_group)``) and the ``masked_fill`` mask (``E``) belong to graph nodes whose
outputs feed no differentiable path, so they are freed when the router returns (about 1% of the block).

``backward`` (kernel "torch"): the peak of the block's backward above its forward's end, per token, the
stage maximum of ``_backward`` (grouped_mm: the combine's ``index_put`` or the routing-weight ``mul``
when k*h is large, the activation's products when I is large, Nemotron-H's shared expert first). Checked
with ``memory_probe.step_peak`` on the block alone, P=1, (peak - forward_end) differenced over S=1024 and
2048 (at small S the experts' fixed weight gradients can move the peak to another stage): exact on
qwen2_moe / qwen3_moe / mixtral / nemotron_h / qwen3_next, I < h and I > h, fp32 and bf16. For "fast"
(CUDA ``grouped_mm``) the same ops run with the same autograd formula (torch
``tools/autograd/derivatives.yaml``: ``_grouped_mm`` saves self, mat2, offs), so the same value; not
run on a GPU here. Under ``torch.autocast`` with fp32 expert weights, ``_grouped_mm`` is not
autocast-enabled (transformers casts its input to the weight dtype): the expert terms are then fp32.

Families outside the cases are read with the same attributes (``gate`` / ``router``, ``experts``,
config sizes) and estimated by the nearest pattern (softmax or sigmoid router, gated or not); a block
without ``experts`` whose class name only says MoE (a dense ``...MoeMLP``) is counted as the dense MLP.
"""

from __future__ import annotations

import inspect

from . import Bytes

NAME = "moe"
CASES = [("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=1)),
         ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                          num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)),
         ("nemotron_h", dict(hybrid_override_pattern="*E", num_hidden_layers=2))]


def _source(obj) -> str:
    try:
        return inspect.getsource(type(obj).forward)
    except (OSError, TypeError, AttributeError):   # no module there (GraniteMoeHybrid has no router module)
        return ""


def _impl(module) -> str:
    for m in (getattr(module, "experts", None), module):
        config = getattr(m, "config", None)
        impl = getattr(config, "_experts_implementation", None) if config is not None else None
        if impl:
            return impl
    return "grouped_mm"


def _first(*values):
    return next((v for v in values if v), 0)


def _config(module):
    for m in (getattr(module, "experts", None), module):
        config = getattr(m, "config", None)
        if config is not None:
            return config
    return None


def dims(module) -> dict:
    """Sizes of a MoE block (works on the meta device). A block without ``experts`` that is a dense
    MLP (a class matched by name only) is returned as one: ``{"dense": mlp.dims(module)}``."""
    experts = getattr(module, "experts", None)
    router = getattr(module, "gate", None) or getattr(module, "router", None)
    if experts is None or router is None:
        from . import mlp
        try:
            return {"dense": mlp.dims(module)}
        except (AttributeError, ValueError):
            pass
    config = _config(module)
    cfg = (lambda *names: _first(*(getattr(config, n, 0) for n in names))) if config is not None else (lambda *n: 0)
    parallel = getattr(module, "input_linear", None)   # JetMoE: ParallelExperts in / out, a GLU
    has_gate = bool(getattr(experts, "has_gate", hasattr(experts, "gate_up_proj"))) or parallel is not None
    num_experts = int(_first(getattr(experts, "num_experts", 0), getattr(module, "num_experts", 0),
                             getattr(parallel, "num_experts", 0),
                             len(experts) if hasattr(experts, "__len__") else 0,
                             cfg("num_experts", "num_local_experts", "n_routed_experts")))
    up = getattr(experts, "gate_up_proj", None) if has_gate else getattr(experts, "up_proj", None)
    transposed = bool(getattr(experts, "is_transposed", False))
    inter = int(_first(getattr(experts, "intermediate_dim", 0), getattr(experts, "expert_dim", 0),
                       (up.shape[-1 if transposed else -2] // (2 if has_gate else 1))
                       if up is not None and up.dim() == 3 else 0,
                       getattr(module, "ffn_dim", 0), getattr(parallel, "output_size", 0) // 2,
                       cfg("moe_intermediate_size", "intermediate_size")))
    w = getattr(router, "weight", None)
    hidden = int(_first(getattr(router, "hidden_dim", 0), w.shape[-1] if w is not None else 0,
                        getattr(module, "hidden_dim", 0), getattr(parallel, "input_size", 0), cfg("hidden_size")))
    latent = module.fc1_latent_proj.out_features if hasattr(getattr(module, "fc1_latent_proj", None),
                                                             "out_features") else 0
    top_k = int(_first(getattr(router, "top_k", 0), getattr(module, "top_k", 0), cfg("num_experts_per_tok")))
    rsrc, esrc = _source(router), _source(experts) if experts is not None else ""
    sigmoid = "sigmoid" in rsrc
    norm_topk = getattr(router, "norm_topk_prob", None)
    if norm_topk is None:
        norm_topk = "/=" in rsrc
    shared = getattr(module, "shared_expert", None) or getattr(module, "shared_experts", None)
    shared_dims = None
    if shared is not None:
        from . import mlp
        try:
            shared_dims = mlp.dims(shared)
        except (AttributeError, ValueError):
            shared_dims = None
    act = getattr(experts, "act_fn", None)
    return {
        "hidden": hidden, "expert_in": latent or hidden, "latent": latent, "intermediate": inter,
        "experts": max(num_experts, 1), "top_k": top_k, "gated": has_gate,
        "act": type(act).__name__ if act is not None else "",
        # @use_experts_implementation classes dispatch on the config; others run their own loop (eager-like)
        "impl": _impl(module) if hasattr(experts, "has_gate") else "eager",
        "router": "sigmoid" if sigmoid else "softmax",
        "router_fp32_input": "type(torch.float32)" in rsrc or "hidden_states.float()" in rsrc,
        "norm_topk": bool(norm_topk),
        # routing weights cast to the logits' dtype (Qwen) or left fp32 (Mixtral, Nemotron-H)
        "weights_fp32": ".to(router_logits.dtype)" not in rsrc,
        "n_group": int(getattr(router, "num_group", 0) or 0), "topk_group": int(getattr(router, "topk_group", 0) or 0),
        # the eager loop's output buffer: fp32 when built in the routing weights' dtype (Nemotron-H)
        "eager_fp32_buffer": "dtype=top_k_weights.dtype" in esrc,
        "shared": shared_dims, "shared_gate": hasattr(module, "shared_expert_gate"),
    }


def _router(d: dict, b: int) -> tuple[float, float]:
    """(per token, fixed) of the router, the block input excluded."""
    E, k = d["experts"], d["top_k"]
    per, fixed = 0.0, 0.0
    if d["router_fp32_input"] and b != 4:
        per += 4 * d["hidden"]                  # x.float(), saved by the fp32 linear
        fixed += 4 * E * d["hidden"]            # the router weight's fp32 copy
    per += 4 * E                                # softmax probabilities / sigmoid scores (fp32)
    per += 8 * k                                # top-k indices (int64)
    if d["router"] == "sigmoid":
        G = max(d["n_group"], 1)
        per += 8 * 2 * G + 8 * max(d["topk_group"], 1) + E   # group top-2 / group top-k indices, bool mask
    if d["norm_topk"]:
        per += 4 * k + 4                        # in-place renormalisation: the fp32 values and their sum
    return per, fixed


def _experts(d: dict, b: int) -> tuple[float, float]:
    """(per token, fixed) of dispatch, experts and combine."""
    k, E, h, i = d["top_k"], d["experts"], d["expert_in"], d["intermediate"]
    w = 4 if d["weights_fp32"] else b
    act = 4 * i if d["gated"] else 2 * i        # gate_up output (2I), act, product / relu out, square
    impl = d["impl"]
    if impl == "eager":
        f = 4 if d["eager_fp32_buffer"] else b
        return k * (b * (h + act + h) + f * h + w + 16), 0.0
    if impl == "batched_mm":
        weights = (3 if d["gated"] else 2) * i * h   # W_up[ids] (2I x h or I x h) and W_down[ids] (h x I)
        return k * (b * (weights + h + act + h) + w), 0.0
    # grouped_mm (default; deepgemm / sonicmoe estimated the same)
    return k * (b * (h + act + h) + w + 3 * 8), 4.0 * E


def _backward(d: dict, b: int) -> float:
    """Per token: the backward's peak above the forward's end (the saved tensors and the output), the
    expert weights' gradients (fixed) left out. The backward of the grouped_mm path, stage by stage
    (per token; ``c`` the combine's dtype bytes, fp32 when the routing weights are):

    * the output gradient ``g = b*hidden`` (held throughout);
    * shared expert: Qwen's gated one (its gate runs after the experts): ``g*sig``, ``g*shared``,
      the gate's input gradient (peak ``2*b*hidden + b``), leaving ``b*hidden - b`` (its output and
      the sigmoid freed); Nemotron-H's ungated one (run last, so backward first): a dense MLP's
      backward (peak ``3*b*I_shared``), leaving its input gradient less what it saved;
    * combine (``weighted[inv_perm]``): the expanded gradient made contiguous, ``new_zeros`` and the
      out-of-place ``index_put``: ``3*k*h*c``;
    * routing-weight ``mul``: its two products (``3*k*h*c`` with the index_put's, ``inv_perm`` freed)
      and, when ``c != b``, the proxy gradient cast back to ``b`` (``k*h*b``);
    * down ``grouped_mm``: its input gradient ``k*I*b`` (the combine's tensors freed);
    * activation: gated ``act(gate)*up``: two products ``2*k*I*b``; relu2 (``square``): ``3*k*I*b``.
    The up ``grouped_mm``, the gather's ``index_put`` and the router's backward come after the
    experts' saved tensors are freed and never set the peak.

    Other implementations, estimates (within ~20% on the tiny cases): ``eager`` runs the backward
    one expert at a time, so the routed part is the grouped one over ``E`` (balanced routing; the
    measured peak follows the busiest expert); ``batched_mm`` adds each copy's gathered-weight
    gradient of the down ``bmm`` (``k*I*h*b``)."""
    k, h, i, hidden = d["top_k"], d["expert_in"], d["intermediate"], d["hidden"]
    w = 4 if d["weights_fp32"] else b
    c = max(b, w)
    base = b * hidden
    stages = [base]
    if d["shared"]:
        from . import mlp
        s_saved = mlp.saved(d["shared"], b).per_token - b * d["shared"]["hidden"]
        if d["shared_gate"]:
            stages.append(base + 2 * b * hidden + b)
            base += b * hidden - b
        else:
            stages.append(base + 3 * b * d["shared"]["intermediate"])
            base += b * hidden - s_saved
    stages.append(base + 3 * k * h * c)                                   # combine's index backward
    if c != b:
        stages.append(base - 8 * k + 3 * k * h * c + k * h * b)           # routing-weight mul
    base_d = base - 8 * k - k * w + k * c          # inv_perm and the sorted weights freed, their gradient kept
    stages.append(base_d + k * i * b)                                     # down grouped_mm
    act = 2 if d["gated"] else (3 if "ReLUSquared" in d["act"] else 1)
    stages.append(base_d - k * h * b + act * k * i * b)                   # activation
    if d["impl"] == "eager":
        shared_stages = stages[:2] if d["shared"] else stages[:1]
        return max(shared_stages + [base + (max(stages) - base) / d["experts"]])
    if d["impl"] == "batched_mm":
        return max(stages) + k * i * h * b
    return max(stages)


def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses") -> Bytes:
    if "dense" in d:                            # a dense MLP whose class name says MoE (no experts)
        from . import mlp
        return mlp.saved(d["dense"], b, kernel, P, backend)
    per = b * d["hidden"]                       # the block input (the norm's output)
    r_per, r_fixed = _router(d, b)
    e_per, e_fixed = _experts(d, b)
    per += r_per + e_per
    if d["latent"]:
        per += b * d["latent"]                  # fc2_latent_proj's input (fc1's input is x)
    if d["shared"]:
        from . import mlp
        per += mlp.saved(d["shared"], b).per_token - b * d["shared"]["hidden"]   # its input is x
        if d["shared_gate"]:
            per += b + b * d["hidden"]          # sigmoid(gate) and the shared output (the gating mul)
    fn = "<Family>Experts.forward (eager loop)" if d["impl"] == "eager" else f"{d['impl']}_experts_forward"
    src = f"transformers.integrations.moe {fn} + {d['router']} top-k router"
    return Bytes(per, r_fixed + e_fixed, _backward(d, b), source=src)
