"""Pure-torch reference math behind the kernel stand-ins (:mod:`standins.kernels`).

Written from the published recurrences, token by token (no chunking: the real kernels' results do not
depend on their chunk size), in fp32 or fp64 (``float64`` in, ``float64`` inside). Each function keeps
the real package function's signature and return convention; the packages under ``site/`` re-export them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__ringmaster_standin__ = True


def wide(*tensors) -> torch.dtype:
    """fp64 when any input is fp64, else fp32 (the real kernels accumulate in fp32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


class _LastStateGradDropped(torch.autograd.Function):
    """mamba-ssm's ``selective_scan_fn`` returns its last state from an autograd Function whose backward
    ignores that output's gradient ("the gradient of the last state is not considered in the backward
    pass"): the value is right, a gradient flowing into it is silently lost. The stand-in does the same."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


# --------------------------------------------------------------------------- causal-conv1d


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal-conv1d 1.x: ``x [b, dim, l]``, ``weight [dim, width]``; ``seq_idx [b, l]``: no tap crosses a
    change of sequence index; ``initial_states [b, dim, width-1]``: the inputs before ``x``."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    dim, width = weight.shape
    if not 2 <= width <= 4:
        raise RuntimeError(f"causal_conv1d only supports width between 2 and 4, got {width}")
    if seq_idx is not None and initial_states is not None:
        raise NotImplementedError("stand-in: seq_idx together with initial_states is not emulated")
    dtype = wide(x, weight)
    b, _, l = x.shape
    pad = (initial_states.to(dtype) if initial_states is not None
           else x.new_zeros(b, dim, width - 1, dtype=dtype))
    xp = torch.cat([pad, x.to(dtype)], dim=-1)                        # [b, dim, l + width - 1]
    win = xp.unfold(-1, width, 1)                                     # [b, dim, l, width]
    if seq_idx is not None:
        sp = torch.cat([seq_idx.new_full((b, width - 1), -1), seq_idx], dim=-1).unfold(-1, width, 1)
        win = win * (sp == seq_idx[..., None])[:, None].to(dtype)
    out = (win * weight.to(dtype)[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.to(dtype)[None, :, None]
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = xp[..., xp.shape[-1] - (width - 1):].to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


# --------------------------------------------------------------------------- mamba-ssm


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """mamba-ssm's Mamba1 scan: ``u, delta, z [b, d, l]``, ``A [d, n]``, ``B, C [b, n, l]`` or grouped
    ``[b, g, n, l]``. No initial state in this API; the last state's gradient is dropped (as upstream)."""
    if A.is_complex():
        raise NotImplementedError("stand-in: complex A is not emulated")
    dtype = wide(u, delta, A, B, C)
    b, d, l = u.shape
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)

    def per_channel(m):
        m = m.to(dtype)
        return m[:, None] if m.dim() == 3 else m.repeat_interleave(d // m.shape[1], dim=1)   # [b, d|1, n, l]

    Bc, Cc, A_ = per_channel(B), per_channel(C), A.to(dtype)
    uu = u.to(dtype)
    h = uu.new_zeros(b, d, A.shape[-1])
    ys = []
    for t in range(l):
        h = torch.exp(dt[..., t, None] * A_) * h + (dt[..., t] * uu[..., t])[..., None] * Bc[..., t]
        ys.append((h * Cc[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else uu.new_zeros(b, d, 0)
    if D is not None:
        y = y + uu * D.to(dtype)[:, None]
    if z is not None:
        y = y * F.silu(z.to(dtype))
    out = y.to(u.dtype)
    return (out, _LastStateGradDropped.apply(h)) if return_last_state else out


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, state_dtype=None):
    """mamba-ssm's Mamba2 SSD scan: ``x [b, l, h, p]``, ``dt [b, l, h]``, ``A [h]``, ``B, C [b, l, g, n]``,
    ``initial_states [b, h, p, n]``; ``seq_idx [b, l]``: the state restarts from zero where it changes;
    ``cu_seqlens`` only with ``return_varlen_states`` (each sequence's final state, batch 1)."""
    if return_varlen_states and cu_seqlens is None:
        raise AssertionError("cu_seqlens must be provided if return_varlen_states is True")
    dtype = wide(x, dt, B, C)
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dtv = dt.to(dtype)
    if dt_bias is not None:
        dtv = dtv + dt_bias.to(dtype)
    if dt_softplus:
        dtv = F.softplus(dtv)
    if tuple(dt_limit) != (0.0, float("inf")):
        dtv = dtv.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = B.to(dtype).repeat_interleave(h // g, dim=2)                  # [b, l, h, n]
    Ch = C.to(dtype).repeat_interleave(h // g, dim=2)
    xx, A_ = x.to(dtype), A.to(dtype)
    S = initial_states.to(dtype) if initial_states is not None else xx.new_zeros(b, h, p, n)
    ys, states = [], []
    for t in range(l):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(dtype)
            S = S * keep[:, None, None, None]
        S = torch.exp(dtv[:, t] * A_)[..., None, None] * S \
            + (dtv[:, t, :, None] * xx[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
        states.append(S)
    y = torch.stack(ys, dim=1)
    if D is not None:
        Dv = D.to(dtype)
        y = y + xx * (Dv[:, None] if Dv.dim() == 1 else Dv)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    out = y.to(x.dtype)
    final = S if state_dtype is None else S.to(state_dtype)
    if not return_varlen_states:
        return (out, final) if return_final_states else out
    ends = [int(e) - 1 for e in cu_seqlens[1:].tolist()]
    varlen = torch.stack([states[e][0] for e in ends], dim=0)
    return (out, final, varlen) if return_final_states else (out, varlen)
