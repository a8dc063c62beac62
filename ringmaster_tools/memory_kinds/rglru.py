"""Griffin's recurrent block (``RecurrentGemmaRecurrentBlock``: conv1d + RG-LRU), kind ``rglru``.

Notation: ``h`` hidden size, ``w`` ``lru_width``, ``K`` ``conv1d_width`` (halo ``K - 1``), ``b`` activation
bytes, ``L = S/P`` local tokens, ``n`` chunks a rank stores (1; 2 under Ring's ``head_tail`` layout).
Fixed terms are per sequence of the micro-batch (batch 1).

Kernel "torch" (transformers' ``RecurrentGemmaRecurrentBlock.forward`` / ``RecurrentGemmaRglru.forward`` /
``_rnn_scan``: a Python loop over tokens; there is no GPU kernel for it in transformers, so "fast" = "torch"):

=================================================  ======================  ==============================
tensor                                             bytes                   saved by
=================================================  ======================  ==============================
layer input (the norm's output)                    b h / token             ``linear_y`` (and ``linear_x``)
``linear_y`` output                                b w / token             GELU
``GELU(y)``                                        b w / token             ``x * y``
``linear_x`` output (transposed)                   b w / token             ``conv_1d``
``conv_1d`` output (``L + K - 1`` columns)         b w / token + (K-1) b w ``baddbmm`` x2, ``x * gate``
sigmoid(input gate), sigmoid(recurrent gate)       2 b w / token           their backward, the muls
``-8 gate``, ``exp(log a)``, ``exp(2 log a)``      3 b w / token           mul, exp, exp
``1 - a^2``                                        b w / token             ``SqrtBoundDerivative``
``~reset``                                         1 / token (bool)        ``~reset * multiplier``
``gated_inputs``, ``multiplier``                   2 b w / token           ``gated * multiplier``
``softplus(recurrent_param)``                      b w fixed               ``-8 gate * softplus``
``_rnn_scan``: ``~reset``                          1 / token (bool)        ``a * ~reset``
  ``a_t`` (fp32: the fp32 ``a``; bf16: each step's fp32 cast) 4 w / token  the step's mul
  ``h_{t-1}`` (fp32, one per step)                 4 w / token             the step's mul
scan output                                        b w / token             ``x * y``
``x * y``                                          b w / token             ``linear_out``
=================================================  ======================  ==============================

= ``b h + 14 b w + 8 w + 2`` per token, ``(K-1) b w + b w`` fixed at P=1; in bf16 the first step's
``a_0`` cast is not saved (the zero initial state needs no gradient): ``- 4 w`` fixed (on the rank holding
the sequence's first chunk; the others receive a state that needs one).

Under CP (ringmaster's ``recurrent.rglru``): the conv runs on ``[halo | chunk]`` per stored chunk
(``recurrent.conv.cp_causal_conv1d``): its saved input gains ``n (K-1)`` columns; with one chunk the
block reads a slice of the ``L + 2(K-1)`` column kernel output (fixed ``3 (K-1) b w``), with two the
chunk outputs are concatenated anew (fixed ``2 (K-1) b w``). The scan: ``sequential`` (the default at
P <= 2) reruns the layer's own ``_rnn_scan`` per chunk from the received state: the same per-token
terms (the received state replaces the zeros). ``scan`` (the default at P > 2,
``recurrent.scan.scan_pass``) adds ``RglruSegment.local_map``'s decay ``cumprod(a * ~reset)`` (input and
output fp32 and the bool ``~reset``: ``8 w + 1`` per token) and ``finish``'s ``decay * state`` (the state,
``4 w`` fixed per chunk); the gathered maps (``P n 2 w`` fp32) are saved by nothing.
"""

from __future__ import annotations

from . import Bytes, stored_chunks

NAME = "rglru"
CASES = [("recurrent_gemma", dict(hidden_size=32, lru_width=32, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, num_hidden_layers=1, intermediate_size=64))]


def dims(module) -> dict:
    lru = module.rg_lru
    return {"hidden": int(module.linear_y.in_features), "width": int(module.linear_y.out_features),
            "conv": int(module.conv_1d.kernel_size[0]), "heads": int(lru.num_attention_heads)}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    h, w, K = d["hidden"], d["width"], d["conv"]
    halo = K - 1
    n = stored_chunks(P, backend)
    per = b * h + 14 * b * w + 8 * w + 2
    fixed = b * w                                    # softplus(recurrent_param), in the parameter dtype
    if n == 0:
        fixed += halo * b * w                        # conv output padding
    elif n == 1:
        fixed += 3 * halo * b * w                    # [halo | chunk] input, its L + 2 halo output
    else:
        fixed += 2 * halo * b * w                    # each chunk's [halo | chunk] input
    if b != 4:
        fixed -= 4 * w                               # bf16: step 0's fp32 a_0 is not saved (the zero state needs no grad)
    strategy = strategy or ("sequential" if P <= 2 else "scan")
    if P > 1 and strategy == "scan":
        per += 8 * w + 1
        fixed += max(n, 1) * 4 * w
    return Bytes(per, fixed, _BACKWARD * b * w,
                 "transformers RecurrentGemmaRecurrentBlock.forward / RecurrentGemmaRglru._rnn_scan (torch loop)")


# per token, in units of b w: memory_probe.step_peak at P=1, fp32, S = 64 / 128 on the CASES model (w = 32):
# 446 B/token measured (3.48 b w); no GPU kernel: "fast" = "torch"
_BACKWARD = 3.5
