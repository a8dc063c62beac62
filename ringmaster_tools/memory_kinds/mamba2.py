"""Mamba2 mixer (Nemotron-H, Mamba2, Bamba, Falcon-H1, Zamba2, GraniteMoeHybrid): in_proj, causal conv1d,
SSD chunk scan, gated RMSNorm, out_proj.

Sizes (``dims``): hidden ``H``, in_proj width ``proj = 2·d + 2·g·n + h``, inner width ``d = h·p`` (``h`` heads
of ``p`` channels), ``g`` B/C groups of state ``n``, conv width ``conv = d + 2·g·n`` with ``K`` taps, scan
chunk ``Q``, ``G`` groups of the gated norm. ``b``: activation bytes; the scan runs in fp32 (4 bytes).

Kernel "torch": transformers' module-level fallbacks ``causal_conv1d_fn`` (``F.conv1d`` + SiLU) and
``mamba2_chunk_scan`` (the SSD einsums with ``segment_sum``), shared by every family (``modeling_nemotron_h``
and the others, copied by ``# Copied from``/modular). Per token, what autograd saves:

==========================================  ===========================  ====================================
tensor                                      bytes per token              saved by
==========================================  ===========================  ====================================
mixer input (the norm's output)             ``b·H``                      in_proj (mm)
in_proj output (whole storage; P=1 or fp32) ``b·proj``                   conv1d's input (a view) / SiLU(gate)
conv input ``[halo | x]`` (CP only)         ``b·conv`` (+ ``K-1`` cols)  conv1d (ringmaster's halo cat)
conv output (padded)                        ``b·conv`` (+ pad cols)      SiLU
scan x in fp32                              fp32: ``4·conv``; else ``4d`` mul by dt (SiLU's output / .float())
dt                                          fp32: ``12h``; else ``2bh+8h``  softplus, clamp, two muls
D residual (padded x copy)                  ``4d``                       mul by D
discretised x, two einsum layouts           ``8d``                       bmm (states, Y_diag)
B, C (repeat_interleave + einsum copies)    ``20·h·n``                   mul (B_decay), 4 bmm operands
decay_states, exp(A_cumsum)                 ``8h``                       mul
L = exp(segsum), G = C·Bᵀ, M = G∘L          ``12·h·Q``                   exp / mul / bmm
chunk states (C·states, inter-chunk)        ``8·h·p·n / Q``              bmm (+ one state per call: fixed)
C·states                                    ``4d``                       mul by exp(A_cumsum)
gated RMSNorm (fp32)                        ``16d + 4G`` (+ ``4d``: bf16 gate copy)  mul, pow, rsqrt
out_proj input                              ``b·d``                      out_proj (mm)
==========================================  ===========================  ====================================

Fixed per layer: the conv's ``K-1`` padded columns (``b·conv·(K-1)`` per padded tensor), ``A = -exp(A_log)``
(``8h``), per scan call the two ``Q x Q`` masks of ``segment_sum`` (``2Q²``) and the extra state of the
inter-chunk einsum (``4·h·p·n``). Not modelled: the inter-chunk ``decay_chunk [h, c+1, c+1]`` and its masks
(``(c+1)²·(4h+2)`` bytes for ``c`` chunks of the call: quadratic in ``S/Q``, under 0.5% of the layer for
``S/Q <= Q``), and the copies ``einsum`` skips when a call holds a single chunk with batch 1 (model at
``S/Q >= 2`` per call).

Under CP (P > 1) ringmaster intercepts the conv and the scan (``ringmaster/recurrent/mamba2.py``,
``conv.py``, ``scan.py``): the conv runs on ``[halo | chunk]`` (a new tensor: in_proj's output is then saved only
through SiLU(gate) in fp32), one call per chunk of the layout (``head_tail`` under Ring: 2 chunks a rank, their
outputs concatenated); the scan runs once per chunk; ``sequential`` state passing (the default at P <= 2)
saves nothing more; ``scan`` (the default at P > 2) recomputes dt for the chunk map (``12h``) and, on every
rank but the first, finishes with the incoming state (``C`` in fp32 ``4hn``, ``exp(cumsum)`` ``4h``, the
correction ``4d`` per token; the all-gathered maps ``4·h·(p·n+1)·P·chunks`` and the composed prefix states
``4·h·p·n`` each, fixed): rank 0 by default (what the benchmark measures), ``worst=True`` a middle rank.

Kernel "fast" (mamba-ssm + causal-conv1d on GPU; cannot run here: read from their source, ``_fast``):

* P = 1 (training, no cache): transformers calls ``mamba_split_conv1d_scan_combined``
  (``mamba_ssm/ops/triton/ssd_combined.py``, ``MambaSplitConv1dScanCombinedFn.forward``:
  ``save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states, seq_idx,
  rmsnorm_weight, rstd, outproj_weight, outproj_bias)``): in_proj's output ``zxbcdt`` (``b·proj``), the scan
  output ``out_x`` (``b·d``), the norm's ``rstd`` (fp32 ``4G``); the conv output, the norm output and the chunk
  states are recomputed in backward. With in_proj's input (``b·H``) and ``A`` (``8h`` fixed).
* P > 1: ringmaster routes around the fused kernel (it takes no incoming state), so the mixer runs
  ``causal_conv1d_fn`` (``causal_conv1d/causal_conv1d_interface.py``, ``CausalConv1dFn.forward`` saves its
  input: ringmaster's ``[halo | chunk]``, ``b·conv``; SiLU fused, no output saved) and
  ``mamba_chunk_scan_combined`` (``MambaChunkScanCombinedFn.forward``: ``save_for_backward(out, x, dt,
  dA_cumsum, A, B, C, D, z, dt_bias, initial_states, seq_idx)``: ``out`` ``b·d``; ``x``, ``B``, ``C`` are views of
  the conv output (``b·conv``); ``dt`` a view of in_proj's output (``b·proj`` stays alive); ``dA_cumsum`` fp32
  ``4h``; the incoming state fp32 ``4·h·p·n`` a call), then the gated norm in torch on the kernel's
  ``b``-dtype output (``y.float()`` and ``gate.float()`` copies in bf16, SiLU(gate), the product, rsqrt, the
  normalised value cast back: ``b·d``) and out_proj (``b·d``).
* ``backward`` (estimate): ``b·(proj + 2·conv + 2·d)`` (dzxbcdt, the recomputed conv output and its gradient,
  the recomputed norm output and dout) ``+ 4·g·Q`` (CB in fp32) ``+ 8·h·p·n/Q`` (chunk states and their
  gradient) ``+ 12h``.
"""

from __future__ import annotations

from . import Bytes, receiving_share, ring_chunks

NAME = "mamba2"
# a scan chunk of 16: every scan call holds >= 2 chunks at S=128 (Ring's head_tail at P=2: 32 tokens a call)
CASES = [("nemotron_h", dict(hybrid_override_pattern="M*-M", chunk_size=16))]


def _get(module, *names, default=None):
    for n in names:
        v = getattr(module, n, None)
        if v is not None:
            return v
    return default


def dims(module) -> dict:
    """Sizes of a Mamba2 mixer (``NemotronHMamba2Mixer``, ``Mamba2Mixer``, ``BambaMixer``, ``FalconH1Mixer``,
    ``Zamba2MambaMixer``, ``GraniteMoeHybridMambaLayer``): all read from module attributes and weight shapes."""
    h = int(module.dt_bias.shape[0])
    d = int(module.out_proj.in_features)
    conv_w = module.conv1d.weight
    norm = getattr(module, "norm", None)
    if norm is None or getattr(module, "mamba_rms_norm", True) is False:
        groups = 0                              # Falcon-H1 without its gated norm: y · SiLU(gate)
    elif getattr(norm, "group_size", None):
        groups = d // int(norm.group_size)
    else:
        groups = int(getattr(norm, "n_groups", 1) or 1)
    return {"hidden": int(module.in_proj.in_features), "proj": int(module.in_proj.out_features),
            "intermediate": d, "heads": h, "head_dim": int(_get(module, "head_dim", default=d // h)),
            "groups": int(module.n_groups), "state": int(module.ssm_state_size),
            "conv_dim": int(conv_w.shape[0]), "conv_kernel": int(conv_w.shape[-1]),
            "chunk": int(module.chunk_size), "norm_groups": groups}




def strategy(P: int, recurrent: str | None = None) -> str:
    """ringmaster's state passing (``RingmasterConfig.recurrent='auto'``: sequential at P <= 2, else scan)."""
    if recurrent in ("scan", "sequential"):
        return recurrent
    return "sequential" if P <= 2 else "scan"




def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          recurrent: str | None = None, worst: bool = False) -> Bytes:
    """``recurrent``: ringmaster's state passing (default: what ``RingmasterConfig.recurrent='auto'`` picks);
    ``worst``: a middle rank instead of rank 0 (differs only under the ``scan`` strategy)."""
    if kernel == "fast":
        return _fast(d, b, P, backend, recurrent, worst)
    H, proj, di, h, p = d["hidden"], d["proj"], d["intermediate"], d["heads"], d["head_dim"]
    g, n, conv, K, Q = d["groups"], d["state"], d["conv_dim"], d["conv_kernel"], d["chunk"]
    G = d["norm_groups"]
    fp32 = b == 4
    cp = P > 1
    calls = ring_chunks(P, backend)            # conv and scan calls per layer on this rank
    out = b * H                                  # in_proj's input
    fixed = 0.0
    if not cp or fp32 or not G:
        out += b * proj                          # in_proj's output: conv's input view (P=1) / SiLU(gate)
    if cp:                                       # [halo | chunk]: conv's input, a new tensor per call
        out += b * conv
        fixed += b * conv * (K - 1) * calls
    out += b * conv                              # SiLU's input: the conv output, K-1 (CP: 2(K-1)) padded cols
    fixed += b * conv * (K - 1) * (2 * calls if cp else 1)
    if fp32:                                     # the scan's x: SiLU's output storage (x, B, C)
        out += 4 * conv
        if cp and calls == 1:
            fixed += 4 * conv * (K - 1)
    else:
        out += 4 * di                            # x.float()
    # mamba2_chunk_scan
    out += 12 * h if fp32 else 2 * b * h + 8 * h   # dt: softplus / clamp inputs, clamp output (bf16: 2 fp32 copies)
    fixed += 8 * h                               # A = -exp(A_log): exp's output and its negation
    out += 4 * di                                # D residual: the padded copy of x
    out += 8 * di                                # x·dt, in the two layouts of the states / Y_diag einsums
    out += 20 * h * n                            # B (repeated), B_decay, C·Bᵀ's C and B, C·states' C
    out += 8 * h                                 # decay_states, exp(A_cumsum)
    out += 12 * h * Q                            # L = exp(segsum), G, M (the bmm copy)
    out += 8 * h * p * n / Q                     # chunk states: C·states' and the inter-chunk einsum's copies
    out += 4 * di                                # C·states
    fixed += (2 * Q * Q + 4 * h * p * n) * calls  # segment_sum's masks, the initial state of the inter-chunk einsum
    if cp and strategy(P, recurrent) == "scan":  # ringmaster's chunk map and the incoming state's correction
        recv = receiving_share(P, backend, worst)
        out += 12 * h                            # mamba2_dt recomputed in fp32 (softplus, clamp, A·dt)
        out += recv * (4 * h * n + 4 * h + 4 * di)   # C in fp32, exp(cumsum A·dt), the correction C·S_in
        fixed += 4 * h * calls                   # exp of the chunk's total decay
        if recv:
            fixed += 4 * h * (p * n + 1) * P * calls  # the all-gathered maps
            fixed += 4 * h * p * n * max(0, P * calls - 2)   # the composed prefix states
    # gated RMSNorm (fp32) and out_proj
    if G:
        out += 16 * di + 4 * G                   # scan output, SiLU(gate), product, normalised (fp32); rsqrt
        if not fp32:
            out += 4 * di                        # gate.float()
    else:                                        # Falcon-H1 without the norm: y (fp32) · SiLU(gate)
        out += 4 * di + b * di                   # y, SiLU(gate) (the gate itself: in_proj's output)
    out += b * di                                # out_proj's input
    return Bytes(out, fixed, backward=_backward_torch(d, b),
                 source="transformers causal_conv1d_fn + mamba2_chunk_scan (torch); ringmaster cp_causal_conv1d, "
                        "cp_mamba2_chunk_scan")


def _backward_torch(d: dict, b: int) -> float:
    """Per token, the torch backward's peak beyond the saved tensors and the output (``memory_probe``'s
    backward peak minus forward end, P=1), the larger of its two peaks: the gated norm's backward (the output
    gradient ``b·H`` and five fp32 ``[S, d]`` temporaries, out_proj's input and the norm's output freed) and
    the SSD's intra-chunk backward (dM, dG, dL ``12·h·Q`` alive while M's copy is freed: ``8·h·Q``, less the
    norm / C·states / Y_off tensors freed by then). Fitted on nemotron_h tiny models: the SSD peak within 1%
    (Q 64-128, d 64-128, h 8-16, n 16-32), the norm peak within 15% (Q 16-32); an estimate at other sizes."""
    H, di, h, p, n, Q, G = d["hidden"], d["intermediate"], d["heads"], d["head_dim"], d["state"], d["chunk"], \
        d["norm_groups"]
    norm_peak = b * H + 16 * di - b * di - 4 * G
    ssd_peak = 8 * h * Q - (20 * di + 4 * h * n + 8 * h * p * n / Q - 4 * H) - (4 - b) * 3 * di
    return max(norm_peak, ssd_peak)


def _fast(d: dict, b: int, P: int, backend: str, recurrent: str | None, worst: bool = False) -> Bytes:
    """mamba-ssm / causal-conv1d (read from their source; these kernels cannot run on CPU)."""
    H, proj, di, h, p = d["hidden"], d["proj"], d["intermediate"], d["heads"], d["head_dim"]
    g, n, conv, K, Q = d["groups"], d["state"], d["conv_dim"], d["conv_kernel"], d["chunk"]
    G = d["norm_groups"]
    fp32 = b == 4
    calls = ring_chunks(P, backend)
    # the backward (estimate from _mamba_chunk_scan_combined_bwd / MambaSplitConv1dScanCombinedFn.backward):
    # dzxbcdt, the recomputed conv output and its gradient, the recomputed norm output and dout, CB in fp32
    # [c, g, Q, Q], chunk states and their gradient in fp32, ddt / ddA_cumsum
    backward = b * (proj + 2 * conv + 2 * di) + 4 * g * Q + 8 * h * p * n / Q + 12 * h
    fixed = 8 * h                                # A = -exp(A_log) (exp's output; A saved by the kernel)
    if P == 1:
        # MambaSplitConv1dScanCombinedFn.forward: save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A,
        # D, dt_bias, initial_states, seq_idx, rmsnorm_weight, rstd, outproj_weight, outproj_bias)
        out = b * H                              # in_proj's input
        out += b * proj                          # zxbcdt (in_proj's output)
        out += b * di                            # out_x: the scan output before the norm / gate
        if G:
            out += 4 * G                         # rstd of the fused gated RMSNorm
        return Bytes(out, fixed, backward, source="mamba-ssm mamba_ssm/ops/triton/ssd_combined.py "
                                                  "MambaSplitConv1dScanCombinedFn.forward")
    # CP: ringmaster routes around the fused kernel: causal_conv1d_fn + mamba_chunk_scan_combined
    out = b * H                                  # in_proj's input
    out += b * proj                              # in_proj's output: dt (a view) saved by the scan kernel
    out += b * conv                              # CausalConv1dFn saves its input [halo | chunk] (contiguous)
    fixed += b * conv * (K - 1) * calls
    out += b * conv                              # x, B, C: views of the conv output (head_tail: the concatenation)
    if calls == 1:
        fixed += b * conv * (K - 1)
    # MambaChunkScanCombinedFn.forward: save_for_backward(out, x, dt, dA_cumsum, A, B, C, D, z, dt_bias,
    # initial_states, seq_idx)
    out += b * di                                # out (z is None: the mixers gate in the norm)
    out += 4 * h                                 # dA_cumsum [h, c, Q] fp32
    fixed += 4 * h * p * n * calls               # initial_states (the incoming state, fp32)
    if strategy(P, recurrent) == "scan":         # ringmaster's chunk map and correction (torch ops, as above)
        recv = receiving_share(P, backend, worst)
        out += 12 * h + recv * (4 * h * n + 4 * h + 4 * di)
        fixed += 4 * h * calls
        if recv:
            fixed += 4 * h * (p * n + 1) * P * calls + 4 * h * p * n * max(0, P * calls - 2)
    if calls > 1 and fp32:
        out += 4 * di                            # the chunks' outputs concatenated (the norm's input)
    if G:                                        # the gated RMSNorm in torch on the kernel's output (dtype b)
        out += (0 if fp32 else 4 * di)           # y.float() (fp32: the kernel's out itself)
        out += 4 * di                            # SiLU(gate)
        out += 0 if fp32 else 4 * di             # gate.float() (fp32: in_proj's output)
        out += 4 * di + 4 * G                    # y·SiLU(gate) (pow, mul), rsqrt
        out += b * di                            # the normalised value cast back to b (the weight multiply)
    else:
        out += b * di                            # SiLU(gate) (y: the kernel's out)
    out += b * di                                # out_proj's input
    return Bytes(out, fixed, backward,
                 source="causal-conv1d causal_conv1d_interface.py CausalConv1dFn.forward; mamba-ssm "
                        "mamba_ssm/ops/triton/ssd_combined.py MambaChunkScanCombinedFn.forward")
