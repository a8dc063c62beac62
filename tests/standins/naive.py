"""Pure-torch, token-by-token references for the recurrent layers ringmaster makes exact under CP.

Slow on purpose: one step per token, no chunking, no kernels, any dtype (the unit tests run
them in float64). They define what "exact" means for the state passing in
:mod:`ringmaster.recurrent.scan`; nothing on the training path calls them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba2_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
              dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """The step size the Mamba2 kernels use: ``clamp(softplus(dt + dt_bias), *dt_limit)``."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def mamba2_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None):
    """Mamba2 SSD, one token at a time.

    ``x [b, l, h, p]``, ``dt [b, l, h]`` (already discretised: see :func:`mamba2_dt`), ``A [h]``
    (negative), ``B, C [b, l, g, n]`` with ``h % g == 0``. State ``[b, h, p, n]``:
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``; ``y_t = S_t C_t + D x_t``.
    Returns ``(y [b, l, h, p], final_state [b, h, p, n])``.
    """
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    B = B.repeat_interleave(h // g, dim=2)
    C = C.repeat_interleave(h // g, dim=2)
    state = x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(x.dtype)
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, C[:, t])
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1), state


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def gated_delta_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True):
    """The gated delta rule, one token at a time (the recurrence gated DeltaNet layers compute).

    ``q, k [b, l, hk, dk]``, ``v [b, l, hv, dv]`` (``hv % hk == 0``: grouped value heads),
    ``g [b, l, hv]`` log decays (<= 0), ``beta [b, l, hv]`` (in [0, 2] allows negative
    eigenvalues). State ``[b, hv, dk, dv]``:
    ``S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(dk)``.
    Returns ``(o [b, l, hv, dv], final_state)``.
    """
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    b, l, h, dk = k.shape
    dv = v.shape[-1]
    state = v.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for t in range(l):
        state = state * torch.exp(g[:, t])[..., None, None]
        kt, vt = k[:, t], v[:, t]
        delta = (vt - torch.einsum("bhkv,bhk->bhv", state, kt)) * beta[:, t, :, None]
        state = state + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv, written as an explicit sum over taps.

    ``x [b, c, l]``, ``weight [c, k]``; ``initial [b, c, k-1]`` are the inputs before ``x``
    (zeros when None). ``out_t = sum_j weight[:, j] * x_{t - (k-1) + j}``.
    """
    kernel = weight.shape[-1]
    pad = x.new_zeros(*x.shape[:-1], kernel - 1) if initial is None else initial.to(x.dtype)
    ext = torch.cat([pad, x], dim=-1)
    length = x.shape[-1]
    out = sum(weight[:, j, None] * ext[..., j:j + length] for j in range(kernel))
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation {activation!r}: the reference knows silu only")
    return out


def mamba2_chunk_scan_ref(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """:func:`mamba2_recurrence` behind the ``mamba2_chunk_scan`` signature (any dtype, e.g. float64),
    so the state passing can be checked against it without the kernels' fp32 rounding."""
    y, final = mamba2_recurrence(hidden_states, mamba2_dt(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D,
                                 initial_states)
    return (y, final) if return_final_states else y


def chunk_gated_delta_rule_ref(query, key, value, g, beta, chunk_size=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """:func:`gated_delta_recurrence` behind the ``chunk_gated_delta_rule`` signature (any dtype)."""
    out, final = gated_delta_recurrence(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, (final if output_final_state else None)


def causal_conv1d_ref(hidden_states, weight, bias=None, activation=None, **kwargs):
    """:func:`causal_conv1d` behind the ``causal_conv1d_fn`` signature."""
    return causal_conv1d(hidden_states, weight, bias, activation)


def mamba1_dt(delta: torch.Tensor, delta_bias: torch.Tensor | None = None, delta_softplus: bool = False) -> torch.Tensor:
    """The step size of a Mamba1 selective scan, ``softplus(delta + delta_bias)`` (``delta [b, d, l]``,
    ``delta_bias [d]``), as transformers' torch fallback and mamba-ssm's ``selective_scan_fn`` compute it."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[..., None]
    return F.softplus(delta) if delta_softplus else delta


def mamba1_recurrence(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                      initial_state: torch.Tensor | None = None):
    """The Mamba1 selective scan, one token at a time (diagonal, per channel and state entry).

    ``u, dt [b, d, l]`` (``dt`` already discretised: :func:`mamba1_dt`), ``A [d, n]`` (negative),
    ``B, C [b, n, l]``. State ``[b, d, n]``: ``S_t = exp(dt_t A) ⊙ S_{t-1} + (dt_t u_t) B_t^T``;
    ``y_t = S_t C_t + D u_t``, then ``y_t * silu(z_t)`` when ``z`` is given.
    Returns ``(y [b, d, l], final_state [b, d, n])``.
    """
    b, d, l = u.shape
    n = A.shape[-1]
    state = u.new_zeros(b, d, n) if initial_state is None else initial_state.to(u.dtype)
    ys = []
    for t in range(l):
        state = torch.exp(dt[:, :, t, None] * A) * state + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        y = torch.einsum("bdn,bn->bd", state, C[:, :, t])
        if D is not None:
            y = y + D * u[:, :, t]
        ys.append(y)
    y = torch.stack(ys, dim=-1)
    if z is not None:
        y = y * F.silu(z)
    return y, state


def mamba1_selective_scan_ref(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False, **kwargs):
    """:func:`mamba1_recurrence` behind the ``selective_scan_fn`` signature (any dtype, e.g. float64)."""
    y, final = mamba1_recurrence(hidden_states, mamba1_dt(dt, delta_bias, delta_softplus), A, B, C, D, z)
    return (y, final) if return_last_state else y
def lightning_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                         initial_state: torch.Tensor | None = None):
    """MiniMax lightning attention, one token at a time. ``q, k, v [b, l, h, d]``, ``slope [h]`` (> 0).
    State ``[b, h, d, d]``: ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``; ``o_t = q_t S_t``.
    Returns ``(o [b, l, h, d], final_state)``."""
    b, l, h, d = q.shape
    decay = torch.exp(-slope.reshape(-1))[None, :, None, None]
    state = q.new_zeros(b, h, d, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(l):
        state = decay * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
    return torch.stack(outs, dim=1), state


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = True):
    """Kimi Delta Attention, one token at a time: the gated delta rule with a decay per key channel.
    ``q, k [b, l, h, dk]``, ``v [b, l, h, dv]``, ``g [b, l, h, dk]`` log decays, ``beta [b, l, h]``. State
    ``[b, h, dk, dv]``: ``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = S_t^T q_t / sqrt(dk)``. Returns ``(o [b, l, h, dv], final_state)``."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    b, l, h, dk = k.shape
    state = v.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(v.dtype)
    outs = []
    for t in range(l):
        state = state * torch.exp(g[:, t])[..., None]
        kt = k[:, t]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, kt)) * beta[:, t, :, None]
        state = state + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def chunk_kda_ref(query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):
    """:func:`kda_recurrence` behind the ``chunk_kimi_delta_attention`` signature (any dtype)."""
    out, final = kda_recurrence(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, (final if output_final_state else None)


def rglru_recurrence(x: torch.Tensor, a: torch.Tensor, reset: torch.Tensor | None = None,
                     initial_state: torch.Tensor | None = None):
    """The RG-LRU's linear recurrence, one token at a time: ``h_t = a_t (1 - reset_t) h_{t-1} + x_t``.
    ``x, a [b, l, w]`` (``x`` already gated and normalised), ``reset [b, l, 1]`` bool. Returns ``(h, final)``."""
    h = x.new_zeros(x.shape[0], x.shape[-1]) if initial_state is None else initial_state.to(x.dtype)
    keep = torch.ones_like(a) if reset is None else (~reset).to(a.dtype)
    outs = []
    for t in range(x.shape[1]):
        h = a[:, t] * keep[:, t] * h + x[:, t]
        outs.append(h)
    return torch.stack(outs, dim=1), h


def wkv_recurrence(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   initial_state: tuple[torch.Tensor, torch.Tensor] | None = None):
    """RWKV-4's WKV without the max stabiliser (float64, moderate keys): ``w = -exp(time_decay)``,
    ``out_t = (num + e^{u+k_t} v_t) / (den + e^{u+k_t})``, then ``num = e^w num + e^{k_t} v_t``,
    ``den = e^w den + e^{k_t}``. ``key, value [b, l, c]``. Returns ``(out, (num, den))``."""
    w, u = -torch.exp(time_decay), time_first
    num, den = ((key.new_zeros(key.shape[0], key.shape[-1]),) * 2 if initial_state is None else initial_state)
    outs = []
    for t in range(key.shape[1]):
        e = torch.exp(u + key[:, t])
        outs.append((num + e * value[:, t]) / (den + e))
        num = torch.exp(w) * num + torch.exp(key[:, t]) * value[:, t]
        den = torch.exp(w) * den + torch.exp(key[:, t])
    return torch.stack(outs, dim=1), (num, den)


def mlstm_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor, fgate: torch.Tensor,
                     eps: float = 1e-6):
    """xLSTM's mLSTM token by token with the matrix memory and normaliser *unstabilised* (float64, moderate
    gates): ``C_t = f_t C_{t-1} + e^{i_t} k_t v_t^T``, ``n_t = f_t n_{t-1} + e^{i_t} k_t`` with
    ``f_t = sigmoid(fgate_t)``, and the stabiliser only where it enters the output: the max-plus recurrence
    ``m_t = max(log f_t + m_{t-1}, i_t)`` from ``m_0 = 0``, ``h_t = q̃·C_t / (max(|q̃·n_t|, 1) + eps e^{m_t})``
    (``q̃ = q / sqrt(d_k)``): transformers' ``(q̃·C'_t) / (max(|q̃·n'_t|, e^{-m_t}) + eps)`` with
    ``(C', n') = e^{-m}(C, n)``. ``q, k [b, h, l, dk]``, ``v [b, h, l, dv]``, gates ``[b, h, l]``."""
    b, nh, L, dk = q.shape
    C = q.new_zeros(b, nh, dk, v.shape[-1])
    n = q.new_zeros(b, nh, dk)
    m = q.new_zeros(b, nh)
    outs = []
    for t in range(L):
        logf = F.logsigmoid(fgate[:, :, t])
        m = torch.maximum(logf + m, igate[:, :, t])
        f, i = torch.exp(logf), torch.exp(igate[:, :, t])
        C = f[..., None, None] * C + i[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = f[..., None] * n + i[..., None] * k[:, :, t]
        qs = q[:, :, t] * dk ** -0.5
        num = (qs[..., None] * C).sum(-2)
        den = (qs * n).sum(-1).abs().clamp(min=1.0) + eps * torch.exp(m)
        outs.append(num / den[..., None])
    return torch.stack(outs, dim=2), (C, n, m)
