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

Under CP ringmaster intercepts the conv and the scan (``ringmaster/recurrent/mamba1.py``): see ``saved``.
"""

from __future__ import annotations

from . import Bytes

NAME = "mamba1"
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


def layout_chunks(P: int, backend: str) -> int:
    return 2 if P > 1 and backend in ("ring", "ring-allgather") else 1


def strategy(P: int, recurrent: str | None = None) -> str:
    if recurrent in ("scan", "sequential"):
        return recurrent
    return "sequential" if P <= 2 else "scan"


def _roles(P: int, backend: str, recurrent: str | None, worst: bool) -> tuple[float, float]:
    """(fraction of this rank's tokens whose chunk passes its end state on, fraction whose chunk takes one in).
    Rank 0 (what the benchmark measures): its first chunk passes on only; under Ring's head_tail its second
    (the last chunk) takes in only (sequential) or both (scan: every chunk's map is all-gathered). ``worst``: a
    middle rank, every chunk both."""
    if P <= 1:
        return 0.0, 0.0
    if worst:
        return 1.0, 1.0
    scan = strategy(P, recurrent) == "scan"
    if layout_chunks(P, backend) == 1:
        return 1.0, 0.0
    return (1.0 if scan else 0.5), 0.5


def saved(d: dict, b: int, kernel: str = "torch", P: int = 1, backend: str = "ulysses",
          recurrent: str | None = None, worst: bool = False) -> Bytes:
    if kernel == "fast":
        return _fast(d, b, P, backend, recurrent, worst)
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
    if fp32:
        out += 4 * di * n                        # the state after every step
        fixed += 4 * di * n                      # the zero initial state
    else:
        out += (4 + b) * di * n                  # every step's fp32 state and its cast for the bmm
        fixed += b * di * n - 4 * di * n         # the zero initial state (b), the last fp32 state unsaved
    fixed += 8 * di * n                          # A = -exp(A_log)
    out += 4 * di + b * di                       # y + x·D (fp32), SiLU(z): the gate's mul
    out += b * di                                # out_proj's input
    out += _bc_norm(d, b)
    if P > 1:
        calls = layout_chunks(P, backend)
        out += b * di                            # conv's input [halo | chunk] (a new tensor per call)
        fixed += b * di * (K - 1) * calls + b * di * (K - 1) * (2 * calls - 1)   # its halo, SiLU's 2(K-1) cols
        if calls == 1:
            fixed += b * di * (K - 1)            # x: SiLU's output keeps the halo's columns
        out += 8 * di                            # the chunk map: softplus' input (fp32), cumsum(dt)
        out += _cp_scan(d, b, P, backend, recurrent, worst)
        fixed += _cp_fixed(d, P, backend, recurrent, worst)
    return Bytes(out, fixed, source="transformers causal_conv1d_fn + mamba_selective_scan (torch); ringmaster "
                                    "cp_causal_conv1d, cp_selective_scan (Mamba1Segment)")


def _cp_scan(d: dict, b: int, P: int, backend: str, recurrent: str | None, worst: bool) -> float:
    """Per token, ringmaster's Mamba1Segment beyond the kernel: the end state from zero
    (``decayed_state``: dt, the suffix sums, dt·u, ``exp`` and the product ``[d, n]`` each token; bf16: u and B
    in fp32) where the chunk passes its state on, and the correction ``decayed_readout`` (``exp`` and the
    product, C in fp32 for bf16) where it takes one in. Tiles of ``TILE`` = 256 tokens are recomputed in
    backward (checkpointed) when a chunk is longer: then only the tiles' inputs stay (not modelled)."""
    di, n = d["intermediate"], d["state"]
    send, recv = _roles(P, backend, recurrent, worst)
    out = send * (12 * di + 8 * di * n + (0 if b == 4 else 4 * di + 4 * n))
    out += recv * (8 * di * n + (0 if b == 4 else 4 * n))
    return out


def _cp_fixed(d: dict, P: int, backend: str, recurrent: str | None, worst: bool) -> float:
    """Per layer: each chunk's total decay ``exp(Σdt·A)`` (fp32 ``4dn``) where its map is used, the incoming
    state ``4dn`` where one comes in."""
    di, n = d["intermediate"], d["state"]
    calls = layout_chunks(P, backend)
    send, recv = _roles(P, backend, recurrent, worst)
    return 4 * di * n * calls * (send + recv)


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


def _fast(d: dict, b: int, P: int, backend: str, recurrent: str | None, worst: bool) -> Bytes:
    raise NotImplementedError
