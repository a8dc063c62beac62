"""xLSTM's mLSTM layer (``xLSTMLayer``), kind ``mlstm``.

Notation: ``h`` hidden size, ``H`` heads, ``dk`` / ``dv`` the q-k / v head dims (``qk = H dk``, ``v = H dv``),
``C`` the kernel's ``chunk_size``, ``b`` activation bytes, ``L = S/P`` local tokens (a multiple of ``C``:
``L / C`` kernel chunks), ``n`` chunks a rank stores (1; 2 under Ring's ``head_tail`` layout). Fixed terms
are per sequence of the micro-batch (batch 1).

Kernel "torch" (transformers' native kernels, ``config.mode="inference"``, the default and what
ringmaster runs every CP chunk with: ``wrap_chunkwise_arbitrary_sequence_length`` makes q, k, v and the
gates contiguous and calls ``mlstm_chunkwise_native_autograd`` = ``mlstm_chunkwise_recurrent_fw_C``
(the state at every kernel chunk) + ``mlstm_chunkwise_parallel_fw_H`` (the outputs); there is no GPU
package behind this layer class (the external ``xlstm`` package's kernels are another class, refused
by ringmaster): "fast" = "torch"):

========================================================  ==============================  ====================
tensor                                                    bytes                           saved by
========================================================  ==============================  ====================
layer input (the norm's output)                           b h / token                     q, k, v, o, i, f proj
``tanh`` of the soft-capped i and f gates                 2 b H / token                   tanh
contiguous f, log-sigmoid buffer (CPU: a full tensor)     2 b H / token                   ``logsigmoid``
contiguous q, k, v                                        b (2 qk + v) / token            the matmuls
``recurrent_fw_C`` per kernel chunk: ``exp(a - m)``       b H C  (= b H / token)          the gating mul
  gated k                                                 b H C dk (= b qk / token)       ``k^T @ v``
  ``G + m``, ``exp(G + m - m')``, ``C_k``, ``n_k``        b H (2 + dk dv + dk)            max, muls
  ``max_a`` (the chunk maxima), its int64 indices         (b + 8) H                       max
``parallel_fw_H``: ``max`` indices (int64)                8 H / token                     max
  ``m_inter``, ``m_intra``                                2 b H / token                   ``maximum``
  ``D = exp(..)``, ``S = q k^T``, ``M = S D`` [C x C]     3 b H C / token                 the muls / matmul
  ``exp(m_b - m)``, gated q                               b H + b qk / token              mul, matmul
  the chunk states as a batch (a copy), ``n_k``           b H (dk dv + dk) per chunk      the matmuls
  ``|den|``, ``exp(-m)``, ``|.|``, ``den + eps``          4 b H / token                   abs, maximum, div
  numerator                                               b v / token                     div
  causal mask ``ltr``                                     C^2 fixed (bool)                ``where``
multi-head layer norm (fp32 reductions): its input, the   8 v + 4 H / token               var, mul, rsqrt
  centred value (fp32), ``rsqrt``
norm's output, ``sigmoid(o)``, ``sigmoid(o) * norm``,     4 b v / token                   weight mul, mul,
  the weighted norm                                                                       ``out_proj``
========================================================  ==============================  ====================

= ``b h + 12 b H + 3 b H C + 4 b qk + 6 b v + 8 v + 4 H + 8 H`` per token, ``(b H (2 dk dv + 2 dk + 3)
+ 8 H) / C`` per token more (the per-kernel-chunk terms), ``C^2`` fixed (per kernel call: per stored
chunk under CP).

Under CP (ringmaster's ``recurrent.mlstm``: every stored chunk runs the backend's forward in
``mode="inference"`` from its incoming state): ``sequential`` (the default at P <= 2): the same terms
per chunk, plus ``4 H`` on a chunk that receives a state (its ``C_0`` / ``n_0`` are views of the one
received ``(C, n, m)`` buffer); ``scan`` (the default at P > 2) runs every chunk but the sequence's first
twice (``MlstmSegment.local_map`` from the empty state, ``finish`` from the composed one): the kernel's
terms (all but the layer input, the gates' projections and the norm / output gate) twice (the worst rank).

A call of exactly one kernel chunk (``L / n == C``) saves the whole state buffers instead of their copy
(the batch of one chunk is a view): ``b H (dk dv + dk)`` more per such call, not modelled (keep stored
chunks at least two kernel chunks long, or read it as a ~1/C-per-token error).

bf16: transformers 5.24's ``mode="inference"`` fails in bf16 (``wrap_chunkwise_arbitrary_sequence_length``
starts from fp32 zero states, ``recurrent_fw_C``'s ``k^T @ v`` then mixes fp32 and bf16), at P=1 and
under CP alike: the formula is given with ``b`` as written, not measured there.
"""

from __future__ import annotations

from . import Bytes, stored_chunks

NAME = "mlstm"
CASES = [("xlstm", dict(embedding_dim=32, hidden_size=32, num_blocks=1, num_heads=2, chunk_size=16))]
BF16 = False   # transformers 5.24's mLSTM kernel starts from fp32 zero states and fails in bf16 (k^T @ v dtypes)


def dims(module) -> dict:
    config = module.config
    H = int(config.num_heads)
    return {"hidden": int(config.hidden_size), "heads": H, "qk": int(module.qk_dim), "v": int(module.v_dim),
            "chunk": int(config.chunk_size)}




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          strategy: str | None = None) -> Bytes:
    h, H, qk, v, C = d["hidden"], d["heads"], d["qk"], d["v"], d["chunk"]
    dk, dv = qk // H, v // H
    n = stored_chunks(P, backend)
    outer = b * h + 4 * b * v + 8 * v + 4 * H + 2 * b * H          # input, norm + output gate, tanh(i), tanh(f)
    core = (10 * b * H + 3 * b * H * C + 4 * b * qk + 2 * b * v + 8 * H
            + (b * H * (2 * dk * dv + 2 * dk + 3) + 8 * H) / C)
    calls = max(n, 1)
    fixed = calls * C * C
    strategy = strategy or ("sequential" if P <= 2 else "scan")
    if n >= 2:
        fixed += 4 * H * (n - 1)                                    # rank 0's later chunks receive a state
    if P > 2 and strategy == "scan":
        core *= 2
        fixed *= 2
    return Bytes(outer + core, fixed, _BACKWARD * b * v,
                 "transformers xLSTMLayer.forward / mlstm_chunkwise_native_autograd (mode='inference')")


# per token, in units of b v: memory_probe.step_peak at P=1, fp32, S = 64 / 128 on the CASES model (v = 32):
# 468.5 B/token measured (3.66 b v)
_BACKWARD = 3.66
