"""RWKV (v4): the time-mixing block (``RwkvSelfAttention``, kind ``rwkv``) and the channel-mixing block
(``RwkvFeedForward``, kind ``rwkv_channel_mix``). ``dims`` records which of the two it read (``block``).

Notation: ``h`` hidden size, ``a`` ``attention_hidden_size``, ``i`` ``intermediate_size``, ``b`` activation
bytes, ``L = S/P`` local tokens, ``n`` chunks a rank stores (1; 2 under Ring's ``head_tail`` layout).
Fixed terms are per sequence of the micro-batch (batch 1).

Time mixing, kernel "torch" (transformers' ``RwkvSelfAttention.forward`` / ``extract_key_value`` and the
token loop ``rwkv_linear_attention_cpu``, what runs on CPU and under CP):

=================================================  ================  ==========================================
tensor                                             bytes             saved by
=================================================  ================  ==========================================
block input (ln1's output), its shift              2 b h / token     ``hidden * mix``, ``shifted * (1 - mix)``
``1 - time_mix_{key,value,receptance}``            3 b h fixed       the three ``shifted *`` muls
the mixed key / value / receptance inputs          3 b h / token     ``key``, ``value``, ``receptance``
``sigmoid(receptance)``                            b a / token       sigmoid, ``receptance * wkv``
``-exp(time_decay)``                               b a fixed         exp (once per kernel call: per chunk)
key (fp32: the whole key; bf16: each step's fp32)  b a | 4 a / token ``maximum``
value                                              b a / token       ``e2 * v``
per step (fp32 ``[b, a]`` each): ``max_state``,    44 a / token      ``maximum`` (x2: state, k + u), exp (x4),
``k + u``, ``e1``, ``e2`` (output, update),                          ``e1 * num`` / ``e1 * den``, the divide (x2),
``num``, ``den``, numerator, denominator,                            ``maximum(max + w, k)``
``max + w``
WKV output                                         b a / token       ``receptance * wkv``
``receptance * wkv``                               b a / token       ``output``
=================================================  ================  ==========================================

= ``5 b h + 5 b a + 44 a`` per token in fp32, ``5 b h + 4 b a + 48 a`` in bf16 (the key is cast per
step); ``3 b h + b a`` fixed. Channel mixing: block input and its shift (``2 b h``), the two mixed
inputs (``2 b h``), ``relu(key)`` (``b i``, relu and square), its square (``b i``, ``value``),
``sigmoid(receptance)`` and the ``value`` output (``2 b h``, the final mul): ``6 b h + 2 b i`` per
token, ``2 b h`` fixed (``1 - time_mix_{key,receptance}``).

Under CP (ringmaster's ``recurrent.rwkv``): the token shift runs as a width-2 conv on ``[halo | chunk]``
(``recurrent.conv.cp_causal_conv1d``): with one chunk the saved shift is a slice of an ``L + 1`` row
output (``b h`` fixed), with two the chunks' shifts are concatenated anew (nothing fixed). The WKV
``sequential`` (the default at P <= 2) runs the torch loop per chunk from the received state: the same
per-token terms, ``-exp(time_decay)`` once per chunk. ``scan`` (the default at P > 2) runs every chunk
but the sequence's first twice (``WkvSegment.local_map`` from zeros, ``finish`` from the composed
state): the loop's per-token terms twice (the worst rank), plus ``-exp(time_decay)`` once more.

Kernel "fast" (transformers' CUDA WKV, ``modeling_rwkv.RwkvLinearAttention.forward``:
``ctx.save_for_backward(time_decay, time_first, key, value, output)`` with ``time_decay = -exp(time_decay.float())``
(``4 a`` fixed), ``time_first`` the parameter, ``key`` / ``value`` the projections' outputs (contiguous already:
the same storages, ``b a`` each; fp16 alone is cast to fp32) and the kernel's output (``b a``, also saved by
``receptance * wkv``)): at P=1 the loop's per-step terms vanish: ``5 b h + 5 b a`` per token, ``3 b h + 4 a``
fixed. Under CP or with packed rows ringmaster always runs the torch loop (the CUDA kernel returns no gradient
for an incoming state): "fast" = "torch" there. The channel mixing has no kernel: "fast" = "torch". Not run
here (no GPU): read from the source.
"""

from __future__ import annotations

from . import Bytes, stored_chunks

NAME = "rwkv"
CASES = [("rwkv", dict(hidden_size=32, attention_hidden_size=32, intermediate_size=64, num_hidden_layers=2))]

_SOURCE = "transformers RwkvSelfAttention.forward / rwkv_linear_attention_cpu (torch loop)"
_SOURCE_FFN = "transformers RwkvFeedForward.forward"
_SOURCE_FAST = "transformers RwkvLinearAttention.forward (CUDA WKV: save_for_backward(w, u, k, v, output))"


def dims(module) -> dict:
    h = int(module.receptance.in_features)
    if hasattr(module, "time_decay"):
        return {"block": "time_mix", "hidden": h, "attention": int(module.key.out_features)}
    return {"block": "channel_mix", "hidden": h, "intermediate": int(module.key.out_features)}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    n = stored_chunks(P, backend)
    h = d["hidden"]
    shift_fixed = b * h if n == 1 else 0            # one chunk: the shift is a slice of its [halo | chunk] output
    if d["block"] == "channel_mix":
        i = d["intermediate"]
        return Bytes(6 * b * h + 2 * b * i, 2 * b * h + shift_fixed, _BACKWARD["channel_mix"] * b * h, _SOURCE_FFN)
    a = d["attention"]
    strategy = strategy or ("sequential" if P <= 2 else "scan")
    calls = max(n, 1) + (1 if P > 2 and strategy == "scan" else 0)
    if kernel == "fast" and P == 1:
        # fused WKV: k, v (the linear outputs), the kernel's output; no per-step states
        return Bytes(5 * b * h + 5 * b * a, 3 * b * h + 4 * a, _BACKWARD["time_mix"] * b * a, _SOURCE_FAST)
    loop = 44 * a if b == 4 else 48 * a          # bf16: each step's fp32 key cast instead of the key
    keys = 2 * b * a if b == 4 else b * a
    if P > 2 and strategy == "scan":
        loop *= 2
    per = 5 * b * h + 3 * b * a + keys + loop
    return Bytes(per, 3 * b * h + calls * b * a + shift_fixed, _BACKWARD["time_mix"] * b * a, _SOURCE)


# per token, in units of b a / b h: memory_probe.step_peak at P=1, fp32, S = 64 / 128 on the CASES model
# (h = a = 32, i = 64): time mixing 576 B/token measured (4.5 b a), channel mixing 448 B/token (3.5 b h).
# "fast" (the CUDA WKV): the same figure, an estimate (its backward allocates gw, gu, gk, gv: fp32 [b, L, a])
_BACKWARD = {"time_mix": 4.5, "channel_mix": 3.5}
