"""Kimi Delta Attention (``KimiLinearDeltaAttention``, kimi_linear): what one KDA layer saves.

Notation: ``H`` hidden, ``h`` heads, ``d`` head dim (keys and values), ``Q = h d``, ``k`` the conv width,
``C = 64`` the chunk, ``b`` the activation bytes (the kernel computes in fp32: 4).

**torch** (transformers' ``KimiLinearDeltaAttention.forward`` with ``causal_conv1d_fn`` and
``chunk_kimi_delta_attention``, measured on CPU, every term matched; bytes per local token):

=================================================  ===================================  ============================
tensor                                             bytes per token                      saved by
=================================================  ===================================  ============================
layer input                                        ``b H``                              q/k/v, f_a, b, g_a projections
f_a_proj, g_a_proj outputs (rank ``d``)            ``2 b d``                            f_b_proj, g_b_proj
forget gate (fp32): exp(g), 1 + exp(g), softplus   ``3 * 4 Q + Q`` (+ ``8 h`` fixed)    exp, log, mul; where (bool)
beta = sigmoid                                     ``b h``                              sigmoid
conv input, silu input                             ``2 * 3 b Q`` (+ ``3 b Q (k-1)``)    F.conv1d, SiLU
l2norm: q, k and their norms (fp32)                ``2 (4 Q + 4 h)``                    mul, div
v, beta padded; q scaled, k padded, k_beta         ``4 Q + 4 h + 3 * 4 Q``              the beta muls, matmuls
exp(g); k_beta * exp(g); v_beta; k_cumdecay        ``4 * 4 Q``                          mul, matmul
decay mask ``[h, C, C, d]``, k_beta * k product    ``2 * 4 h C d``                      exp, mul
forward substitution (64 steps): row, sub clones   ``4 h (C-1)/2 + 4 h (C-1)(2C-1)/6``  mul (each step)
attn + I                                           ``4 h C``                            matmuls
chunk loop: exp(g_i), q_i exp(g_i)                 ``2 * 4 Q`` (``- 4 Q C`` per call     mul, matmul (only when the
                                                   from a zero state)                   state needs a gradient)
  states ``[h, d, d]``, one per chunk              ``4 h d^2 / C``                      matmuls
  q_i k_i decay product ``[h, C, C, d]``, attn     ``4 h C d + 4 h C``                  mul, matmul
  v_new; exp(g_last); exp(g_last - g_i), k_i * it  ``4 Q + 4 Q / C + 2 * 4 Q``          matmul, mul
three bool ``[C, C]`` masks                        ``3 C^2`` fixed per call             masked_fill
gated norm: input fp32, rsqrt, normed, sigmoid,    ``4 * 4 Q + 4 h + b Q``              pow/mul/sigmoid/o_proj
weighted; o_proj input (bf16: weight cast fixed)   (+ ``4 d`` fixed in bf16)
=================================================  ===================================  ============================

The ``[h, C, C, d]`` tensors (three of them, ``12 h C d``) dominate: the torch fallback is not what one
would train with. Under CP the layer is gated DeltaNet's wiring (``ringmaster/recurrent/kda.py``):
conv halo (``b 3Q (k-1)`` fixed becomes ``3 * 3 b Q (k-1) n``), one rule call per chunk of the rank
(``n``), the sequential state passing (every rank but the first receives a state in every call: counted
for those ranks) and scan (values ``[v | 0]``, ``d -> 2d`` in the value terms and states; ``w`` and the
prefix terms as gated DeltaNet's). Exact at P=1 and P=2 (Ulysses, Ring, sequential and scan) in fp32
and bf16 for the rank that saves most, when each call spans at least two chunks.

``backward`` (torch, ``step_peak`` slope S = 256 -> 512): 25124 / 24970 B per token (fp32 / bf16) at
h 4, d 8; 49776 / 49704 at h 8; 49744 / 49696 at d 16: ``12 h C d + 8 Q`` (the gradients of the
``[h, C, C, d]`` products).

**fast** (not run here: no GPU): flash-linear-attention ``fla/ops/kda/chunk.py``
``ChunkKDAFunction.forward`` (``disable_recompute=False``, transformers computes the gate itself)
``ctx.save_for_backward``: q, k l2-normed (input dtype) with fp32 rstd (``2 b Q + 8 h``), v (``b Q``),
``g_cumsum`` (``chunk_local_cumsum``, fp32) and ``g_input`` (the layer's g, fp32): ``8 Q``, beta (the
sigmoid, counted), ``Aqk, Akk`` (``chunk_kda_fwd_intra``: ``[T, h, C]`` in k's dtype, ``2 b h C``) and
``initial_state`` (fp32, one per call under CP); ``w, u, qg, kg, v_new, h`` are dropped and recomputed.
The conv is causal-conv1d's ``CausalConv1dFn`` (its input only); the projections, forget gate and
gated norm are the torch ones. ``backward`` estimate from ``chunk_kda_bwd`` (``fla/ops/kda/chunk_bwd.py``):
recomputed ``w, u, qg, kg, v_new`` and ``h``, then ``dAqk, dv, dh, dq, dk, db, dg, dAkk``:
``9 b Q + 2 b h d^2 / C + 4 Q + 8 h C``.
"""

from __future__ import annotations

from . import Bytes, cp_layout

NAME = "kda"
CHUNK = 64          # chunk_kimi_delta_attention's default chunk_size (the layer passes none); FLA chunk_kda's BT
CASES = [("kimi_linear", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              mlp_layer_types=["dense", "dense"]))]
# the P=2 check's length: every kernel call of a Ring rank (two head_tail chunks) spans two 64-token chunks
CP_SEQ = 512


def dims(module) -> dict:
    config = getattr(module, "config", None)
    h = int(getattr(module, "num_heads", 0) or config.linear_num_heads)
    d = int(getattr(module, "head_dim", 0) or config.linear_head_dim)
    conv = getattr(module, "conv1d", None)
    width = int(getattr(module, "conv_kernel_size", 0) or (conv.kernel_size[0] if conv is not None else 4))
    hidden = int(getattr(module, "hidden_size", 0) or module.o_proj.out_features)
    return {"hidden": hidden, "heads": h, "head_dim": d, "conv_width": width, "chunk": CHUNK}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    H, h, hd, k, C = d["hidden"], d["heads"], d["head_dim"], d["conv_width"], d.get("chunk", CHUNK)
    Q = h * hd
    n, strategy = cp_layout(P, backend, strategy)
    halo = 0 if P <= 1 else 1
    dvw = 2 * hd if strategy == "scan" else hd                 # scan: values [v | 0]
    Qw = h * dvw

    out = b * H                                                # the layer input (q/k/v, f_a, b, g_a projections)
    out += b * hd + b * hd                                     # f_a_proj's and g_a_proj's outputs (low rank)
    out += 4 * Q * 3 + Q                                       # forget gate: exp(g), 1 + exp(g), softplus (fp32),
    fixed = 8 * h                                              # where's condition (bool); exp(A_log), -exp(A_log)
    out += b * h                                               # beta = sigmoid(b_proj(x))
    if kernel == "torch":
        out += 2 * b * 3 * Q                                   # conv input, silu input
        fixed += b * 3 * Q * (k - 1) * (1 + 2 * halo) * n
        # kernel, fp32
        out += 2 * (4 * Q + 4 * h)                             # l2norm: q, k and their norms
        out += 4 * Qw + 4 * h                                  # v padded, beta padded (v * beta, k * beta)
        out += 4 * Q * 3                                       # q scaled, k padded, k_beta
        out += 4 * Q                                           # exp(g) (k_beta * exp(g))
        out += 2 * 4 * h * C * hd                              # decay mask [h, C, C, d] and k_beta * k product
        out += 4 * h * (C - 1) / 2 + 4 * h * (C - 1) * (2 * C - 1) / 6   # forward substitution: row, sub clones
        out += 4 * h * C                                       # attn + I
        out += 4 * Qw + 4 * Q                                  # v_beta, k_beta * exp(g)
        out += 4 * Q                                           # k_cumdecay
        # chunk loop
        # exp(g_i), q_i * exp(g_i): the product is saved (by @ state) only when the state needs a gradient: not
        # in a call's first chunk from a zero state (P=1, scan's [0 | I]); under sequential every rank but the
        # first receives one in every call (counted for those ranks: rank 0 saves 4 Q C less)
        out += 4 * Q * 2
        if strategy != "sequential":
            fixed -= 4 * Q * C * n
        out += 4 * hd * dvw * h / C                            # one state per chunk
        out += 4 * h * C * hd + 4 * h * C                      # q_i k_i decay product [h, C, C, d], attn_intra
        out += 4 * Qw                                          # v_new
        out += 4 * Q / C + 4 * Q * 2                           # exp(g_last), exp(g_last - g_i), k_i * that
        fixed += 3 * C * C * n                                 # three bool masks per call
        backward = 12 * h * C * hd + 8 * Q                     # measured (module docstring)
        source = "transformers chunk_kimi_delta_attention + causal_conv1d_fn (KimiLinearDeltaAttention.forward)"
    else:
        out += b * 3 * Q                                       # causal-conv1d saves its input only (fused silu)
        fixed += b * 3 * Q * (k - 1) * halo * n                # ... [halo | chunk] under CP
        out += 2 * b * Q + 2 * 4 * h                           # q, k l2-normed (l2norm_fwd) and their fp32 rstd
        out += b * Qw                                          # v (input_guard's contiguous copy; [v | 0] for scan)
        out += 4 * Q * 2                                       # g chunk-cumsum (fp32) and g_input (the layer's g)
        out += 2 * b * h * C                                   # Aqk, Akk [T, h, C] in k's dtype
        if strategy in ("sequential", "scan"):
            fixed += 4 * h * hd * dvw * n                      # initial_state, fp32, one per call
        backward = 9 * b * Q + 2 * b * h * hd * hd / C + 4 * Q + 8 * h * C   # estimate (module docstring)
        source = "fla.ops.kda.chunk ChunkKDAFunction.forward (ctx.save_for_backward) + causal_conv1d CausalConv1dFn"
    if strategy == "scan":
        # as gated DeltaNet's scan (ringmaster.recurrent.gated_deltanet.GatedDeltaSegment): y0 + w^T S_in saves w
        # (fp32 activations: the kernel's whole [v | w] output, w a view of it; bf16: w cast to fp32), the
        # all-gathered maps and the composed states past the second chunk (the rank that saves most)
        out += 4 * h * (dvw if b >= 4 else hd)
        fixed += 4 * P * n * h * hd * dvw + max(0, n * P - n - 1) * 4 * h * hd * hd
    # gated output norm: input fp32, rsqrt, normed, sigmoid(gate), weighted; o_proj's input
    out += 4 * Q * 4 + 4 * h + b * Q
    if b < 4:
        fixed += 4 * hd                                         # the norm weight cast to fp32
    return Bytes(out, fixed, backward, source=source)
