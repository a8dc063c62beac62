"""MiniMax lightning attention (``MiniMaxLightningAttention``, minimax): what one layer saves.

Notation: ``H`` hidden, ``h`` heads, ``d`` head dim, ``Q = h d``, ``Bs`` the block (``config.block_size``),
``b`` the activation bytes. The layer computes in the activation dtype (only its RMSNorm upcasts).

**torch** = **fast**: transformers 5.24 writes the block loop inline in
``MiniMaxLightningAttention.forward`` (no kernel a GPU package replaces; only the RMSNorm may come from
a hub kernel), so both kernels save the same. Measured on CPU, every term matched (bytes per token):

==============================================  ==============================  ===========================
tensor                                          bytes per token                 saved by
==============================================  ==============================  ===========================
layer input                                     ``b H``                         qkv_proj, output_gate
qkv before silu; silu output (q, k, v views)    ``2 * 3 b Q``                   silu; the block matmuls
``(Q Kᵀ) * decay`` per block ``[h, Bs, Bs]``    ``b h Bs``                      @ V (the decay: a buffer)
q * query_decay, k * key_decay                  ``2 b Q`` (- ``b Q Bs`` fixed)  @ state (not the first
                                                                                block from a zero state)
state entering each block; each block's decay   ``b h d^2 / Bs + b h / Bs``     matmul; mul (- ``b h``
                                                                                fixed for the first block)
RMSNorm (width Q): input fp32, rsqrt, normed    ``4 Q + 4 + b Q``               pow / mul / weight mul
sigmoid(gate), norm output, gated product       ``3 b Q``                       mul, out_proj
==============================================  ==============================  ===========================

Under CP ringmaster runs its own forward of the layer (``ringmaster/recurrent/lightning.py``
``lightning_forward`` / ``lightning_blocks``: the same loop, with an incoming state), which computes
each block's decays instead of reading the buffers: the ``[h, Bs, Bs]`` decay and the q and k decays
are saved (``b h Bs + 2 b h``). ``sequential`` (P <= 2): every rank but the first receives a state in
every call, so its first block saves the q decay product and block decay too (the fixed terms vanish;
counted for those ranks, rank 0 saves ``b Q Bs + b h`` less). ``scan`` (P > 2;
``LightningSegment``): local maps from a zero state (the fixed terms per call), then
``y0 + (q S_in) * decay`` saves q in fp32 (bf16 only; fp32: a view of the silu output) and the fp32
decay ``[l, h]`` (``4 h``), with the all-gathered maps ``[P, n, h, d^2 + 1]`` fp32 and the composed
states past the second chunk, for the rank that saves most. Exact at P=1 and P=2 (Ulysses, Ring,
sequential and scan) in fp32 and bf16 for that rank, at S a multiple of ``Bs`` per call.

``backward`` (``step_peak`` slope S = 256 -> 512): 643 / 955.5 B per token (fp32 / bf16) at Q = 64 (Bs 16
and 32 alike), 1152 / 1659 at Q = 128: ``9.5 Q`` (fp32) / ``14 Q`` (bf16: the norm's fp32 gradients are
new tensors beside the bf16 ones).
"""

from __future__ import annotations

from . import Bytes, cp_layout

NAME = "lightning"
CASES = [("minimax", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], block_size=16))]


def dims(module) -> dict:
    config = getattr(module, "config", None)
    h = int(getattr(module, "num_attention_heads", 0) or config.num_attention_heads)
    d = int(getattr(module, "head_dim", 0) or config.head_dim)
    block = int(getattr(module, "block_size", 0) or config.block_size)
    hidden = int(module.qkv_proj.in_features)
    return {"hidden": hidden, "heads": h, "head_dim": d, "block": block}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    H, h, hd, Bs = d["hidden"], d["heads"], d["head_dim"], d["block"]
    Q = h * hd
    n, strategy = cp_layout(P, backend, strategy)

    out = b * H                                   # the layer input (qkv_proj, output_gate)
    out += 2 * b * 3 * Q                          # silu's input; its output (q, k, v are views of it)
    out += b * h * Bs                             # per block: Q K^T * decay (saved by @ V; the decay is a buffer)
    out += b * Q                                  # q * query_decay (saved by @ state: not in a first block)
    out += b * Q                                  # k * key_decay
    out += b * h * hd * hd / Bs + b * h / Bs      # the state entering each block; each block's decay
    if P > 1:
        # ringmaster's forward (ringmaster/recurrent/lightning.py lightning_blocks) computes each block's decays
        # itself (the class forward reads buffers): the [h, Bs, Bs] decay and the q and k decays are saved
        out += b * h * Bs + 2 * b * h
    # a call's first block from a zero state saves neither q * query_decay nor the block decay (their
    # multiplies see no gradient through the state): at P=1 and for each scan call ([0 | I]-free local
    # maps); under sequential every rank but the first receives a state in every call (counted for those)
    fixed = -(b * Q * Bs + b * h) * n if strategy != "sequential" else 0
    if strategy == "scan":
        # y0 + (q S_in) * decay (LightningSegment.finish): q cast to fp32 (bf16; fp32: a view of the silu
        # output), the decay [l, h] fp32; the all-gathered maps [P, n, h, d d + 1] (fp32) and each composed
        # state past the second chunk, for the rank that saves most (as gated DeltaNet's scan)
        out += (4 * Q if b < 4 else 0) + 4 * h
        fixed += 4 * P * n * (h * hd * hd + h) + max(0, n * P - n - 1) * 4 * h * hd * hd
    out += 4 * Q + 4 + b * Q                      # RMSNorm (width Q): input fp32, rsqrt, normed
    out += 3 * b * Q                              # sigmoid(gate), the norm's output, the gated product (out_proj)
    backward = (9.5 if b >= 4 else 14) * Q          # measured (module docstring)
    source = ("transformers MiniMaxLightningAttention.forward (inline block loop; no GPU kernel: fast = torch)"
              if P <= 1 else "ringmaster.recurrent.lightning lightning_forward / lightning_blocks")
    return Bytes(out, fixed, backward, source=source)
