"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-hybrid): what one linear-attention layer saves.

Notation: ``H`` hidden, ``hk``/``hv`` key/value heads, ``dk``/``dv`` their head dims, ``K = hk dk``,
``V = hv dv``, ``D = 2K + V`` the conv channels, ``k`` the conv width, ``C = 64`` the chunk, ``b`` the
activation bytes (fp32 intermediates: 4). Bytes per local token, at a sequence a multiple of ``C``.

**torch** (transformers' ``Qwen3_5GatedDeltaNet.forward`` with ``causal_conv1d_fn`` and
``torch_chunk_gated_delta_rule``, measured on CPU; every term matched tensor by tensor):

============================================  =============================  =============================
tensor                                        bytes per token                saved by
============================================  =============================  =============================
layer input (the norm's output)               ``b H``                        in_proj_qkv / z / b / a
conv input, silu input (conv output)          ``2 b D`` (+ ``b D (k-1)`` fixed) F.conv1d, SiLU
beta = sigmoid(b)                             ``b hv``                       sigmoid (its output)
softplus input and output (``g``), fp32       ``8 hv`` (+ ``8 hv`` fixed)    softplus, mul (-exp(A_log))
intra-chunk ``[hv, C, C]`` tensors, fp32      ``5 * 4 hv C``                 the decay map (exp), the two
                                                                             products (k_beta kᵀ, q kᵀ) before
                                                                             the decay mask, the UT system
                                                                             (solve_triangular), intra attn
``[hv, dk]`` tensors, fp32                    ``8 * 4 hv dk``                l2norm inputs q, k; q, k padded;
                                                                             k_beta; k_cumdecay (solve); the
                                                                             decayed q and k of the scan
  fp32 activations only                       ``+ 4 * 4 hv dk``              the 5-D matmuls copy q, k,
                                                                             k_beta, k (their inputs are
                                                                             transposed views: ``.to(fp32)``
                                                                             is a no-op), when a call spans
                                                                             two chunks or more
  fp32 activations and ``hk == hv``           ``+ 4 D - 2 * 4 hv dk``         l2norm's inputs are views of the
                                                                             silu output (no repeat_interleave
                                                                             copy): that storage, not q and k
``[hv, dv]`` tensors, fp32                    ``3 * 4 hv dv``                v padded (v * beta), new_values
                                                                             (solve), v_new (each chunk)
per-head scalars, fp32                        ``6 * 4 hv``                   q/k inverse norms, beta padded,
                                                                             three exp(cum_decay)
states ``[hv, dk, dv]`` fp32, one per chunk   ``4 hv dk dv / C``             the scan's matmuls
chunk decay                                   ``4 hv / C``                   exp
causal mask ``[C, C]`` bool                   ``C^2`` fixed, per call        masked_fill
gated RMSNorm: input fp32, rsqrt, normed,     ``3 * 4 V + 4 hv + 3 b V``     pow / mul / weight mul / silu
weighted, gate fp32, silu(gate), out_proj in                                 / out_proj
============================================  =============================  =============================

Under CP (``ringmaster/recurrent/gated_deltanet.py`` + ``conv.py`` + ``scan.py``): the conv runs on
``[halo | chunk]`` per chunk the rank holds (``n``: 1 contiguous, 2 head_tail): its input is that
``torch.cat`` (``k-1`` more columns) and its output has ``2(k-1)`` extra columns: ``b D (k-1)`` fixed at
P=1 becomes ``3 b D (k-1) n``. The rule runs once per chunk (the mask is per call). ``sequential``
(the default at P <= 2) saves nothing more: the passed state is the next call's initial state, one of
the states above. ``scan`` (P > 2) runs the kernel on values ``[v | 0]`` from ``[0 | I]`` (``dv -> dv +
dk`` in every ``[hv, dv]`` term and the states), then ``y = y0 + wᵀ S_in`` saves ``w`` (fp32 activations:
the kernel's whole output, ``4 hv (dv + dk)``, as ``w`` is a view of it; bf16: ``w`` cast to fp32, ``4 hv
dk``) and the prefix composition saves the all-gathered maps (``4 P n hv dk (dv + dk)``) and each
composed state past the second chunk (``4 hv dk dv`` each, ``nP - n - 1`` of them on the rank that saves
most); rank 0 under Ulysses (no incoming state) saves none of these.

Exact at P=1 and P=2 (Ulysses, Ring head_tail; sequential) in fp32 and bf16 when every kernel call spans
at least two chunks (local tokens per call ``S/(P n) >= 2C``). A call of one chunk saves less: no 5-D
matmul copies, and the first call of a rank with a zero initial state does not save the decayed q
(``q @ state`` saves q only when the state needs a gradient).

``backward`` (torch): ``step_peak`` on one layer (``(peak - forward_end)`` slope over S = 256 -> 512, P=1):
2864 / 3024 B per token (fp32 / bf16) on the case (hv 4, dk 8, dv 16); 5472 / 5920 at hv 8; 2032 / 2480 at
dv 32; 1655 / 2104 at hv 2, dk = dv = 64; 2550 / 3575 at dk = dv = 128 (the peak, an ``add`` accumulating a
chunk's gradient into the ``[hv, N, C, C]`` tensors, moves with the sizes): modelled as
``4 hv (2C + dk + dv)``, within about 25% of each.

**fast** (not run here: no GPU). flash-linear-attention ``fla/ops/gated_delta_rule/chunk.py``
``ChunkGatedDeltaRuleFunction.forward`` (``use_qk_l2norm_in_kernel=True``) ``ctx.save_for_backward``:
``q, k`` l2-normed (``l2norm_fwd``: input dtype, ``hk`` heads, FLA does the grouped value heads itself)
with their fp32 ``rstd`` (``2 b K + 8 hk``), ``v`` (``input_guard``'s contiguous copy, ``b V``), ``g``
after ``chunk_local_cumsum`` (fp32, ``4 hv``), ``beta`` (the layer's sigmoid output, counted above), ``A``
(``chunk_gated_delta_rule_fwd_intra``: ``[T, hv, C]`` in k's dtype, ``b hv C``) and ``initial_state``
(fp32 ``[hv, dk, dv]``, one per call under CP); ``h`` and ``v_new`` are recomputed in the backward. The
conv is causal-conv1d's ``CausalConv1dFn`` (saves its input ``x``, the activation fused: no silu input).
The layer's projections, sigmoid/softplus and gated norm terms are the torch ones; scan adds the same
``w`` and prefix terms. ``backward`` estimate from ``chunk_gated_delta_rule_bwd`` (every local alive until
it returns): ``w, u`` (``recompute_w_u_fwd``), ``h`` and ``dh`` (``b hv dk dv / C`` each), ``v_new``,
``dv`` (twice), ``dq, dk, dw, dk2`` (``hv`` heads) in b, ``dg, dg2`` fp32, ``db``:
``b hv (5 dk + 4 dv) + 2 b hv dk dv / C + 12 hv``.
"""

from __future__ import annotations

from . import Bytes, cp_layout

NAME = "gated_deltanet"
CHUNK = 64          # torch_chunk_gated_delta_rule's default chunk_size (the layer passes none); FLA's BT = 64
CASES = [("qwen3_5_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                               linear_value_head_dim=16))]
# the P=2 check's length: every kernel call of a Ring rank (two head_tail chunks) spans two 64-token chunks
CP_SEQ = 512


def dims(module) -> dict:
    config = getattr(module, "config", None)

    def read(own: str, config_name: str) -> int:   # the module's attribute, a shared name (Bailing), the config
        return int(getattr(module, own, 0) or getattr(module, {"num_v_heads": "num_heads", "num_k_heads": "num_heads",
                                                                "head_k_dim": "head_dim", "head_v_dim": "head_dim"}[own], 0)
                   or getattr(config, config_name))

    hv, hk = read("num_v_heads", "linear_num_value_heads"), read("num_k_heads", "linear_num_key_heads")
    dk, dv = read("head_k_dim", "linear_key_head_dim"), read("head_v_dim", "linear_value_head_dim")
    conv = getattr(module, "conv1d", None)
    width = int(getattr(module, "conv_kernel_size", 0) or (conv.kernel_size[0] if conv is not None else 4))
    hidden = int(getattr(module, "hidden_size", 0) or module.out_proj.out_features)
    return {"hidden": hidden, "k_heads": hk, "v_heads": hv, "k_dim": dk, "v_dim": dv, "conv_width": width,
            "chunk": CHUNK}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    H, hk, hv, dk, dv = d["hidden"], d["k_heads"], d["v_heads"], d["k_dim"], d["v_dim"]
    k, C = d["conv_width"], d.get("chunk", CHUNK)
    K, V = hk * dk, hv * dv
    D = 2 * K + V
    n, strategy = cp_layout(P, backend, strategy)
    dvw = dv + dk if strategy == "scan" else dv            # scan: values [v | 0], state [0 | I]
    halo = 0 if P <= 1 else 1                               # conv on [halo | chunk]: a cat input

    out = b * H                                             # the layer input, saved by the projections
    out += b * hv + 8 * hv                                  # sigmoid(b); softplus input and g (fp32)
    fixed = 8 * hv                                          # exp(A_log) and -exp(A_log), fp32
    if kernel == "torch":
        out += 2 * b * D                                    # conv input, silu input (the conv's output)
        # the conv output's k-1 extra columns; under CP the conv input is [halo | chunk] (k-1 more) and its
        # output has 2(k-1) extra columns
        fixed += b * D * (k - 1) * (1 + 2 * halo) * n
        out += 5 * 4 * hv * C                               # the [C, C] intra-chunk tensors
        out += (8 + (4 if b >= 4 else 0)) * 4 * hv * dk     # [hv, dk] tensors (+ the 5-D matmuls' copies in fp32)
        if b >= 4 and hk == hv:                             # fp32, no repeat_interleave: l2norm's input is a view of
            out += 4 * D - 2 * 4 * hv * dk                  # the conv's (silu) output: that whole storage, not q, k
        out += 3 * 4 * hv * dvw + 6 * 4 * hv               # [hv, dv] tensors, per-head scalars
        out += 4 * hv * dk * dvw / C + 4 * hv / C           # one state per chunk, the chunk decays
        fixed += C * C * n                                  # the causal mask (bool), per call
        backward = 4 * hv * (2 * C + dk + dv)               # measured, see the module docstring
        source = "transformers torch_chunk_gated_delta_rule + causal_conv1d_fn (Qwen3_5GatedDeltaNet.forward)"
    else:
        out += b * D                                        # causal-conv1d saves its input only (fused silu)
        fixed += b * D * (k - 1) * halo * n                 # ... which is [halo | chunk] under CP
        out += 2 * b * K + 4 * 2 * hk                       # q, k l2-normed (hk heads: FLA does GVA), rstd fp32
        out += b * hv * dvw                                 # v (a contiguous copy; [v | 0] under scan)
        out += 4 * hv + b * hv * C                          # g chunk-cumsum (fp32), A [T, hv, C] (beta: above)
        if strategy in ("sequential", "scan"):
            fixed += 4 * hv * dk * dvw * n                  # initial_state, fp32, one per call
        backward = (b * hv * (5 * dk + 4 * dv) + 2 * b * hv * dk * dv / C + 12 * hv)   # estimate, docstring
        source = ("fla.ops.gated_delta_rule.chunk ChunkGatedDeltaRuleFunction.forward (ctx.save_for_backward) + "
                  "causal_conv1d CausalConv1dFn")
    if strategy == "scan":
        # y = y0 + w^T S_in saves w: in fp32 the kernel's whole [v | w] output (hi(w) is a view of it), else w
        # cast to fp32; and the prefix: the all-gathered maps [P, n, hv, dk, dv + dk] (A @ state saves A, a view
        # of them) and each composed state after the second chunk, up to the rank's last: counted for the rank
        # that saves most (Ulysses: the last, chunk P-1; head_tail: rank 1, chunks 1 and 2P-2, both with an
        # incoming state; rank 0 composes one state more but finishes half its tokens)
        out += 4 * hv * (dvw if b >= 4 else dk)
        fixed += 4 * P * n * hv * dk * dvw + max(0, n * P - n - 1) * 4 * hv * dk * dv
    out += 3 * 4 * V + 4 * hv + 3 * b * V                   # gated RMSNorm and out_proj's input
    return Bytes(out, fixed, backward, source=source)
