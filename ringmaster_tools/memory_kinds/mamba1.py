"""Mamba1 mixer (Mamba, FalconMamba, Jamba, Zamba): in_proj, causal conv1d, x_proj / dt_proj, selective scan.

Sizes (``dims``): hidden ``H``, inner width ``d`` (in_proj gives ``2d``: x and the gate z), state ``n``, dt rank
``R`` (x_proj gives ``R + 2n``), conv taps ``K``; ``norm``: FalconMamba / Jamba normalise dt, B and C
(RMSNorm without / with weights). ``b``: activation bytes (the scan runs in fp32).

Kernel "torch": transformers' ``causal_conv1d_fn`` (``F.conv1d`` + SiLU) and ``mamba_selective_scan``
(``modeling_mamba.py``: ``discrete_A = exp(A·dt)``, ``deltaB_u``, then a Python loop over the tokens, each
step ``state = dA_t ⊙ state + dBu_t`` and ``y_t = state·C_t``). Per token, what autograd saves:

=====================================  ==============================  ==================================
tensor                                 bytes per token                 saved by
=====================================  ==============================  ==================================
mixer input (the norm's output)        ``b·H``                         in_proj (mm)
in_proj output ``[2d]``                ``2b·d``                        conv's input (a view), SiLU(z)
conv output (K-1 padded columns)       ``b·d``                         SiLU
x = SiLU(conv)                         ``b·d``                         x_proj (mm), x·D
x_proj output ``[R + 2n]``             ``b·(R + 2n)``                  dt_proj (mm), y_t = state·C_t (C)
dt_proj output + bias, dt              ``2b·d``                        softplus; A·dt, dt·B
x.float(), B.float() (bf16 only)       ``4d + 4n``                     deltaB_u, discrete_B
discrete_A, discrete_B                 ``8·d·n``                       each step's mul; deltaB_u
the state of every step                fp32: ``4·d·n``; else ``(4+b)·d·n``  the next step's mul; the bmm (cast)
y + x·D (fp32), SiLU(z)                ``4d + b·d``                    the gate's mul
out_proj input                         ``b·d``                         out_proj (mm)
dt / B / C norms (FalconMamba, Jamba)  see ``_bc_norm``                RMSNorm
=====================================  ==============================  ==================================

Fixed per layer: the conv's padded columns ``b·d·(K-1)``, ``A = -exp(A_log)`` (``8·d·n``), the initial
zero state (fp32 ``4·d·n``; bf16: ``b·d·n`` less the last step's fp32 state), ``D.float()`` (bf16: ``4d``).

Under CP (P > 1) ringmaster intercepts the conv and the scan (``ringmaster/recurrent/mamba1.py``, ``conv.py``):
the conv runs on ``[halo | chunk]`` (a new tensor, ``b·d`` + ``K-1`` columns a call), the kernel runs per chunk
of the layout (``head_tail`` under Ring: 2 a rank) from a zero state with ``z=None`` (the gate moves outside: the
same bytes), and ``Mamba1Segment`` adds, per token, the chunk map (softplus' fp32 input, ``cumsum(dt)``: ``8d``),
the end state from zero for *every* chunk (``decayed_state``: dt, suffix sums, dt·u ``12d``; ``exp`` and the
product ``8·d·n``; bf16: u and B in fp32 ``4d + 4n``; packed for backward even on the last chunk, whose
unused map is then freed) and, on chunks that take a state in, the correction (``decayed_readout``:
``8·d·n``, bf16 C in fp32 ``4n``); fixed: each chunk's total decay ``4dn``, the incoming state and the packed
map ``12dn``. Rank 0 by default (``worst=True``: a middle rank); chunks longer than ``TILE`` tokens
(``tokens=``) checkpoint the ``8·d·n`` terms in tiles. Zamba's per-head mixer is read by ``dims`` but runs a
different forward (within 4% at P=1).

Kernel "fast" (mamba-ssm + causal-conv1d; cannot run here, see ``_fast``): P = 1 trains through
``mamba_inner_fn`` (``MambaInnerFn.forward``, ``checkpoint_lvl=1``): ``xz`` ``2b·d``, ``x_dbl`` ``b·(R+2n)``, B and C
copies ``2b·n``, ``out`` ``b·d``, the fp32 chunk states ``8·d·n`` per 2048 tokens, with in_proj's input ``b·H``.
Under CP: ``CausalConv1dFn`` (its input), ``SelectiveScanFn`` per chunk (u and delta ``2b·d``, B and C
contiguous ``2b·n``, the chunk states), ringmaster's segment terms as above, the gate and out_proj in torch.
"""

from __future__ import annotations

from . import Bytes, receiving_share, ring_chunks

NAME = "mamba1"
TILE = 256   # ringmaster.recurrent.mamba1.TILE: a chunk longer than this is corrected in checkpointed tiles
CASES = [("mamba", dict()), ("falcon_mamba", dict())]


def dims(module) -> dict:
    """Sizes of a Mamba1 mixer (``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``, ``ZambaMambaMixer``),
    from its attributes and weight shapes (works on the meta device)."""
    d = int(module.conv1d.weight.shape[0])
    n = int(module.A_log.shape[-1])
    if hasattr(module, "dt_proj"):
        R = int(module.dt_proj.in_features)
    else:                                        # Zamba: per-head x_proj_weight [heads, R + 2n, d / heads]
        R = int(module.dt_proj_weight.shape[-1])
    heads = int(getattr(module, "n_mamba_heads", 1) or 1)
    norm = "none"
    if hasattr(module, "b_layernorm"):
        w = getattr(module.b_layernorm, "weight", None)   # FalconMamba's is a dummy buffer, never used
        norm = "weighted" if w is not None and "Weightless" not in type(module.b_layernorm).__name__ else "weightless"
    return {"hidden": int(module.in_proj.in_features), "intermediate": d, "state": n, "dt_rank": R,
            "conv_kernel": int(module.conv1d.weight.shape[-1]), "heads": heads, "norm": norm}








def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          recurrent: str | None = None, worst: bool = False, tokens: int | None = None) -> Bytes:
    """``worst``: a middle rank (every chunk takes a state in) instead of rank 0; ``tokens``: the rank's local
    tokens, when known (chunks longer than ``TILE`` keep ringmaster's ``[d, n]``-per-token decays out of the
    saved set: checkpointed tiles)."""
    if kernel == "fast":
        return _fast(d, b, P, backend, recurrent, worst, tokens)
    H, di, n, R, K = d["hidden"], d["intermediate"], d["state"], d["dt_rank"], d["conv_kernel"]
    fp32 = b == 4
    out = b * H                                  # in_proj's input
    out += 2 * b * di                            # in_proj's output: conv's input (view), SiLU(z)'s input
    out += b * di                                # SiLU's input: the conv output (K-1 padded columns)
    fixed = b * di * (K - 1)
    out += b * di                                # x = SiLU(conv): x_proj's input, x·D
    out += b * (R + 2 * n)                       # x_proj's output: dt_proj's input, C of every step
    out += 2 * b * di                            # softplus' input (dt_proj + bias), dt (A·dt, dt·B)
    if not fp32:
        out += 4 * di + 4 * n                    # x.float(), B.float()
        fixed += 4 * di                          # D.float()
    out += 8 * di * n                            # discrete_A, discrete_B
    calls = ring_chunks(P, backend)            # kernel calls on this rank
    if fp32:
        out += 4 * di * n                        # the state after every step
        fixed += 4 * di * n * calls              # the zero initial state
    else:
        out += (4 + b) * di * n                  # every step's fp32 state and its cast for the bmm
        fixed += (b * di * n - 4 * di * n) * calls   # the zero initial state (b), the last fp32 state unsaved
    fixed += 8 * di * n                          # A = -exp(A_log)
    out += 4 * di + b * di                       # y + x·D (fp32), SiLU(z): the gate's mul
    out += b * di                                # out_proj's input
    out += _bc_norm(d, b)
    if P > 1:
        out += b * di                            # conv's input [halo | chunk] (a new tensor per call)
        fixed += b * di * (K - 1) * calls + b * di * (K - 1) * (2 * calls - 1)   # its halo, SiLU's 2(K-1) cols
        if calls == 1:
            fixed += b * di * (K - 1)            # x: SiLU's output keeps the halo's columns
        out += 8 * di                            # the chunk map: softplus' input (fp32), cumsum(dt)
        out += _cp_scan(d, b, P, backend, recurrent, worst, tokens)
        fixed += _cp_fixed(d, P, backend, recurrent, worst)
    # the backward's [d, n]-per-token gradients exist for one kernel call at a time: under Ring's head_tail
    # layout a rank makes two calls of half its tokens each
    return Bytes(out, fixed, backward=_backward_torch(d, b) / calls, source="transformers causal_conv1d_fn + mamba_selective_scan (torch); ringmaster "
                                    "cp_causal_conv1d, cp_selective_scan (Mamba1Segment)")


def _cp_scan(d: dict, b: int, P: int, backend: str, recurrent: str | None, worst: bool,
             tokens: int | None = None) -> float:
    """Per token, ringmaster's Mamba1Segment beyond the kernel: every chunk's end state from zero
    (``decayed_state``: dt, the suffix sums, dt·u, ``exp`` and the product ``[d, n]`` each token; bf16: u and B
    in fp32) and, where the chunk takes a state in, the correction ``decayed_readout`` (``exp`` and the
    product, C in fp32 for bf16). Tiles of ``TILE`` = 256 tokens are recomputed in backward (checkpointed)
    when a chunk is longer: then only the tiles' inputs stay (not modelled)."""
    di, n = d["intermediate"], d["state"]
    recv = receiving_share(P, backend, worst)
    tiled = tokens is not None and tokens / ring_chunks(P, backend) > TILE
    big = 0 if tiled else 8 * di * n             # exp(·A) and its product, unless checkpointed in tiles
    out = 12 * di + big + (0 if b == 4 else 4 * di + 4 * n)
    out += recv * (big + (0 if b == 4 else 4 * n))
    return out


def _cp_fixed(d: dict, P: int, backend: str, recurrent: str | None, worst: bool) -> float:
    """Per layer: each chunk's total decay ``exp(Σdt·A)`` (fp32 ``4dn``); where a state comes in, the state
    (``4dn``) and the chunk's packed map ``[d, 2n]`` (``8dn``, saved by ``combine``)."""
    di, n = d["intermediate"], d["state"]
    calls = ring_chunks(P, backend)
    recv = receiving_share(P, backend, worst)
    return 4 * di * n * calls + 12 * di * n * calls * recv


def _backward_torch(d: dict, b: int) -> float:
    """Per token, the torch backward's peak beyond the saved tensors and the output (P=1): the gradients of
    discrete_A and discrete_B (fp32 ``[d, n]`` a token each, 8dn) and of the stacked steps while the
    forward's are still held: ``16·d·n``, plus ``2d`` (fp32) / ``-d`` (bf16). Measured on tiny mamba models
    (d 128-256, n 8-16) within 1%."""
    di, n = d["intermediate"], d["state"]
    return 16 * di * n + (2 * di if b == 4 else -di)


def _bc_norm(d: dict, b: int) -> float:
    """FalconMamba's weightless RMSNorms on dt (``R``), B and C (``n`` each), Jamba's weighted ones: the input
    in fp32 (fp32: x_proj's output itself; else a copy) for pow and mul, rsqrt (one fp32 per token each), the
    normalised outputs (saved by dt_proj, by the steps' bmm (C) and, fp32 only, by dt·B (bf16: B.float()));
    Jamba's weight multiply saves the normalised value before the weight as well."""
    if d["norm"] == "none":
        return 0.0
    R, n = d["dt_rank"], d["state"]
    out = 4 * (R + 2 * n) + 3 * 4
    if b != 4:                                   # x_proj's output no longer saved; B normalised is saved as B.float()
        out -= b * n
    if d["norm"] == "weighted":
        out += b * (R + 2 * n)
    return out


def _fast(d: dict, b: int, P: int, backend: str, recurrent: str | None, worst: bool,
          tokens: int | None = None) -> Bytes:
    """mamba-ssm + causal-conv1d (read from their source; they cannot run on CPU).

    P = 1 (training): transformers calls ``mamba_inner_fn`` (``mamba_ssm/ops/selective_scan_interface.py``,
    ``MambaInnerFn.forward``, ``checkpoint_lvl=1``: the conv output and delta are recomputed in backward):
    ``save_for_backward(xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
    out_proj_weight, conv1d_out=None, delta=None, A, B, C, D, delta_bias, scan_intermediates, ..., out)``.
    Under CP ringmaster routes around it: ``causal_conv1d_fn`` (``CausalConv1dFn.forward`` saves its input
    ``[halo | chunk]``), x_proj / dt_proj in torch, ``selective_scan_fn`` per chunk with ``z=None``
    (``SelectiveScanFn.forward``: ``save_for_backward(u, delta, A, B, C, D, delta_bias, x)``; B and C made
    contiguous, ``x`` the fp32 chunk states ``[d, ceil(L/2048), 2n]``), ringmaster's chunk map and correction in
    torch (as for the torch kernel), the gate ``y · SiLU(z)`` and out_proj in torch."""
    H, di, n, R, K = d["hidden"], d["intermediate"], d["state"], d["dt_rank"], d["conv_kernel"]
    inter = 8 * di * n / 2048                    # scan_intermediates: fp32 [d, 2n] per 2048-token chunk
    fixed = 8 * di * n + 8 * di * n              # A = -exp(A_log) (exp's output, A), one intermediates chunk
    # backward (estimate, selective_scan_cuda.bwd and MambaInnerFn.backward): dxz, the recomputed conv output
    # and delta, their gradients, dx_dbl, dout_y
    backward = b * (2 * di + 4 * di + (R + 2 * n)) + 4 * di
    if P == 1:
        out = b * H                              # in_proj's input
        out += 2 * b * di                        # xz (in_proj's output)
        out += b * (R + 2 * n)                   # x_dbl
        out += 2 * b * n                         # B, C (contiguous [n, L] copies; normalised for FalconMamba)
        out += b * di                            # out (the scan output before the gate)
        out += inter
        fixed += 8 * di                          # D.float(), delta_bias.float()
        return Bytes(out, fixed, backward, source="mamba-ssm mamba_ssm/ops/selective_scan_interface.py "
                                                  "MambaInnerFn.forward")
    calls = ring_chunks(P, backend)
    out = b * H + 2 * b * di                     # in_proj's input; its output (z for SiLU(z))
    out += b * di                                # CausalConv1dFn's input [halo | chunk]
    fixed += b * di * (K - 1) * calls
    out += b * di                                # the conv output (x_proj's input, the scan's u)
    if calls == 1:
        fixed += b * di * (K - 1)
    out += b * (R + 2 * n)                       # x_proj's output (dt_proj's input)
    out += b * di                                # delta (dt_proj's output), saved by the scan
    out += 2 * b * n                             # B, C made contiguous by SelectiveScanFn
    out += inter
    fixed += 8 * di * calls                      # D.float(), delta_bias.float()
    out += 8 * di                                # the chunk map: softplus' input (fp32), cumsum(dt)
    out += _cp_scan(d, b, P, backend, recurrent, worst, tokens)
    fixed += _cp_fixed(d, P, backend, recurrent, worst)
    out += 2 * b * di                            # y · SiLU(z): y, SiLU(z)
    out += b * di                                # out_proj's input
    out += _bc_norm(d, b)
    return Bytes(out, fixed, backward,
                 source="causal-conv1d CausalConv1dFn.forward; mamba-ssm mamba_ssm/ops/selective_scan_interface.py "
                        "SelectiveScanFn.forward; ringmaster cp_selective_scan")
