"""The math of the CPU stand-ins for mamba-ssm's and causal-conv1d's hub kernels: plain token loops
with the real functions' names, argument order and return values, in float32 (or float64 for a
float64 input; the real kernels accumulate in float32). A test double for tiny models: the scans
are sequential (O(L) Python steps), ``seq_idx`` / ``cu_seqlens`` / varlen states are refused, not
emulated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _wide(*tensors) -> torch.dtype:
    """The accumulation dtype: float64 when any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _act(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in (None, False):
        return x
    if activation in ("silu", "swish", True):
        return F.silu(x)
    raise NotImplementedError(f"stand-in causal_conv1d: activation {activation!r}")


def _refuse(name: str, **given) -> None:
    bad = sorted(k for k, v in given.items() if v is not None and v is not False)
    if bad:
        raise NotImplementedError(f"stand-in {name}: {bad} are not emulated")


# -- causal-conv1d -------------------------------------------------------------------------------


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """``x [b, c, l]``, ``weight [c, k]``: depthwise causal conv (``initial_states [b, c, k-1]``)."""
    _refuse("causal_conv1d_fn", seq_idx=seq_idx, final_states_out=final_states_out)
    b, c, _ = x.shape
    k = weight.shape[-1]
    dtype = _wide(x, weight)
    head = initial_states if initial_states is not None else x.new_zeros(b, c, k - 1)
    xp = torch.cat([head.to(dtype), x.to(dtype)], dim=-1)
    out = F.conv1d(xp, weight.to(dtype)[:, None, :], None if bias is None else bias.to(dtype), groups=c)
    out = _act(out, activation).to(x.dtype)
    if return_final_states:
        return out, xp[..., xp.shape[-1] - (k - 1):].to(x.dtype)
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """One decoding step: ``x [b, c]`` (or ``[b, c, 1]``); ``conv_state [b, c, k]`` is rolled in place."""
    _refuse("causal_conv1d_update", cache_seqlens=cache_seqlens, conv_state_indices=conv_state_indices)
    squeeze = x.dim() == 2
    step = x if squeeze else x[..., 0]
    conv_state.copy_(torch.cat([conv_state[..., 1:], step[..., None].to(conv_state.dtype)], dim=-1))
    dtype = _wide(x, weight)
    out = (conv_state.to(dtype) * weight.to(dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(dtype)
    out = _act(out, activation).to(x.dtype)
    return out if squeeze else out[..., None]


# -- mamba-ssm: Mamba1 ---------------------------------------------------------------------------


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """``u, delta, z [b, d, l]``, ``A [d, n]``, ``B, C [b, n, l]``; returns ``out [b, d, l]`` (and the
    last state ``[b, d, n]``). Starts from a zero state: the real kernel takes no initial state."""
    if B.dim() != 3 or C.dim() != 3:
        raise NotImplementedError("stand-in selective_scan_fn: grouped B/C are not emulated")
    dtype = _wide(u, delta, A, B, C)
    u_, dt = u.to(dtype), delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    A_, B_, C_ = A.to(dtype), B.to(dtype), C.to(dtype)
    state = u_.new_zeros(u.shape[0], u.shape[1], A.shape[-1])
    ys = []
    for t in range(u.shape[-1]):
        state = torch.exp(dt[..., t, None] * A_) * state + (dt[..., t] * u_[..., t])[..., None] * B_[:, None, :, t]
        ys.append((state * C_[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else u_.new_zeros(u.shape)
    if D is not None:
        y = y + u_ * D.to(dtype)[:, None]
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(u.dtype)
    return (y, state.to(u.dtype)) if return_last_state else y


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None,
                   dt_rms_weight=None, b_c_dt_rms_eps=1e-6):
    """The fused Mamba1 block from ``xz [b, 2d, l]``: conv, x_proj, dt_proj, scan, gate, out_proj."""
    _refuse("mamba_inner_fn", B=B, C=C, B_proj_bias=B_proj_bias, C_proj_bias=C_proj_bias,
            b_rms_weight=b_rms_weight, c_rms_weight=c_rms_weight, dt_rms_weight=dt_rms_weight)
    b, _, l = xz.shape
    rank, n = delta_proj_weight.shape[1], A.shape[-1]
    x, z = xz.chunk(2, dim=1)
    x = causal_conv1d_fn(x, conv1d_weight.reshape(conv1d_weight.shape[0], -1), conv1d_bias, activation="silu")
    x_dbl = F.linear(x.transpose(1, 2), x_proj_weight)                       # [b, l, rank + 2n]
    delta = (x_dbl[..., :rank] @ delta_proj_weight.t()).transpose(1, 2)      # [b, d, l]
    B_ = x_dbl[..., rank:rank + n].transpose(1, 2)
    C_ = x_dbl[..., rank + n:].transpose(1, 2)
    y = selective_scan_fn(x, delta, A, B_, C_, D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decoding step, in place on ``state``: Mamba1 (``state [b, d, n]``, ``x [b, d]``) or Mamba2
    (``state [b, h, p, n]``, ``x [b, h, p]``, ``B, C [b, g, n]``)."""
    dtype = _wide(state, x)
    dt_ = dt.to(dtype) + (0 if dt_bias is None else dt_bias.to(dtype))
    if dt_softplus:
        dt_ = F.softplus(dt_)
    B_, C_ = B.to(dtype), C.to(dtype)
    if state.dim() == 4:  # Mamba2: heads share their group's B, C
        h = state.shape[1]
        B_ = B_.repeat_interleave(h // B.shape[1], dim=1)[:, :, None, :]
        C_ = C_.repeat_interleave(h // C.shape[1], dim=1)[:, :, None, :]
    else:
        B_, C_ = B_[:, None, :], C_[:, None, :]
    new = torch.exp(dt_[..., None] * A.to(dtype)) * state.to(dtype) + (dt_ * x.to(dtype))[..., None] * B_
    state.copy_(new.to(state.dtype))
    y = (new * C_).sum(-1)
    if D is not None:
        y = y + x.to(dtype) * D.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(x.dtype)


# -- mamba-ssm: Mamba2 (SSD) ---------------------------------------------------------------------


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """``x [b, l, h, p]``, ``dt [b, l, h]``, ``A [h]``, ``B, C [b, l, g, n]``, ``D [h]`` or ``[h, p]``,
    ``initial_states [b, h, p, n]``; returns ``y [b, l, h, p]`` (and the final state). ``chunk_size``
    only tiles the real kernel: the result does not depend on it."""
    _refuse("mamba_chunk_scan_combined", seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            return_varlen_states=return_varlen_states)
    b, l, h, p = x.shape
    dtype = _wide(x, dt, B, C)
    dt_ = dt.to(dtype)
    if dt_bias is not None:
        dt_ = dt_ + dt_bias.to(dtype)
    if dt_softplus:
        dt_ = F.softplus(dt_)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt_ = dt_.clamp(min=lo, max=hi)
    rep = h // B.shape[2]
    B_ = B.to(dtype).repeat_interleave(rep, dim=2)
    C_ = C.to(dtype).repeat_interleave(rep, dim=2)
    A_ = A.to(dtype)
    x_ = x.to(dtype)
    state = (initial_states.to(dtype) if initial_states is not None else x_.new_zeros(b, h, p, B.shape[-1]))
    ys = []
    for t in range(l):
        decay = torch.exp(dt_[:, t] * A_)[..., None, None]                       # [b, h, 1, 1]
        state = decay * state + (dt_[:, t, :, None] * x_[:, t])[..., None] * B_[:, t, :, None, :]
        ys.append((state * C_[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else x_.new_zeros(x.shape)
    if D is not None:
        D_ = D.to(dtype)
        y = y + x_ * (D_[:, None] if D_.dim() == 1 else D_)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(x.dtype)
    return (y, state.to(x.dtype)) if return_final_states else y


def _gated_rmsnorm(y, z, weight, eps, group_size, norm_before_gate):
    dtype = y.dtype
    if z is not None and not norm_before_gate:
        y = y * F.silu(z)
    g = y.reshape(*y.shape[:-1], -1, group_size)
    y = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).reshape(y.shape) * weight.to(dtype)
    if z is not None and norm_before_gate:
        y = y * F.silu(z)
    return y


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """The fused Mamba2 block from ``zxbcdt [b, l, 2*d_mlp + d + (d + 2*g*n) + h]``: conv over xBC, SSD
    scan, gated RMSNorm (grouped by ``ngroups``), out_proj."""
    _refuse("mamba_split_conv1d_scan_combined", seq_idx=seq_idx, initial_states=initial_states)
    if return_final_states:
        raise NotImplementedError("stand-in mamba_split_conv1d_scan_combined: return_final_states is not emulated")
    h = A.shape[0]
    p = headdim if headdim is not None else D.shape[-1]
    d = h * p
    n = (conv1d_weight.shape[0] - d) // ngroups // 2
    d_mlp = (zxbcdt.shape[-1] - 2 * d - 2 * ngroups * n - h) // 2
    z0, x0, z, xbc, dt = torch.split(zxbcdt, [d_mlp, d_mlp, d, d + 2 * ngroups * n, h], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation=activation).transpose(1, 2)
    x, B, C = torch.split(xbc, [d, ngroups * n, ngroups * n], dim=-1)
    b, l = x.shape[:2]
    y = mamba_chunk_scan_combined(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, ngroups, n),
                                  C.reshape(b, l, ngroups, n), chunk_size, D=D,
                                  z=None if rmsnorm_weight is not None else z.reshape(b, l, h, p),
                                  dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit).reshape(b, l, d)
    if rmsnorm_weight is not None:
        y = _gated_rmsnorm(y, z, rmsnorm_weight, rmsnorm_eps, d // ngroups, norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return y if outproj_weight is None else F.linear(y, outproj_weight, outproj_bias)
