"""Pure-torch reference math behind the kernel stand-ins (:mod:`standins.kernels`).

Written from the published recurrences, token by token (no chunking: the real kernels' results do not
depend on their chunk size), in fp32 or fp64 (``float64`` in, ``float64`` inside). Each function keeps
the real package function's signature and return convention; the packages under ``site/`` re-export them.
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringmaster.comm import all_gather

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


# --------------------------------------------------------------------------- flash-linear-attention


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """The (per-head or per-key-channel) gated delta rule of FLA's chunk kernels::

        S_t = (I - β_t k_t k_tᵀ) · diag(exp g_t) · S_{t-1} + β_t k_t v_tᵀ,   o_t = S_tᵀ (scale · q_t)

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` (GVA: HV a multiple of H), ``g [B, T, HV]`` (GDN) or
    ``[B, T, HV, K]`` (KDA), ``beta [B, T, HV]``; states ``[N, HV, K, V]``, one per sequence of
    ``cu_seqlens`` (batch 1) or per row."""
    dtype = wide(q, k, v)
    Bsz, T, H, K = q.shape
    HV = v.shape[2]
    qq, kk = q.to(dtype), k.to(dtype)
    if use_qk_l2norm_in_kernel:
        qq, kk = _l2norm(qq), _l2norm(kk)
    if HV != H:
        qq, kk = qq.repeat_interleave(HV // H, dim=2), kk.repeat_interleave(HV // H, dim=2)
    qq = qq * scale
    vv, gg, bb = v.to(dtype), g.to(dtype), beta.to(dtype)
    per_channel = gg.dim() == 4
    if cu_seqlens is not None:
        spans = [(0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    else:
        spans = [(r, 0, T) for r in range(Bsz)]
    finals = []
    out_rows = [[] for _ in range(Bsz)]
    for i, (row, a, e) in enumerate(spans):
        S = (initial_state[i].to(dtype) if initial_state is not None
             else vv.new_zeros(HV, K, vv.shape[-1]))
        for t in range(a, e):
            decay = torch.exp(gg[row, t])                                          # [HV] or [HV, K]
            S = S * (decay[:, :, None] if per_channel else decay[:, None, None])
            kt = kk[row, t]
            pred = torch.einsum("hk,hkv->hv", kt, S)
            S = S + bb[row, t][:, None, None] * kt[:, :, None] * (vv[row, t] - pred)[:, None, :]
            out_rows[row].append(torch.einsum("hk,hkv->hv", qq[row, t], S))
        finals.append(S)
    outs = torch.stack([torch.stack(r, dim=0) if r else vv.new_zeros(0, HV, vv.shape[-1]) for r in out_rows], dim=0)
    final = torch.stack(finals, dim=0) if output_final_state else None
    return outs.to(v.dtype), final


def check_fla_call(name: str, q, k, v, beta, initial_state, cu_seqlens, kwargs: dict, chunk_sizes) -> None:
    """The argument checks the real FLA entry points make (and what the stand-in does not emulate)."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    cp_context = kwargs.get("cp_context")
    if cp_context is not None:
        assert initial_state is None, "Initial state is not supported for CP"
        assert not kwargs.get("output_final_state"), "Output final state is not supported for CP"
        assert cp_context.cu_seqlens is not None, "cu_seqlens is required for CP"
        cu_seqlens = cp_context.cu_seqlens
    for flag in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "state_v_first", "return_intermediate_states",
                 "safe_gate", "transpose_state_layout"):
        if kwargs.get(flag):
            raise NotImplementedError(f"stand-in {name}: {flag}=True is not emulated")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in chunk_sizes:
        raise ValueError(f"`chunk_size` must be one of {chunk_sizes} for {name}, got {chunk_size}.")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same number of heads, but got {q.shape[2]} and {k.shape[2]}")
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"For GVA, num_v_heads (HV={v.shape[2]}) must be evenly divisible by num_heads "
                         f"(H={q.shape[2]})")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                             "Please flatten variable-length inputs before processing.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError("The number of initial states is expected to be equal to the number of input sequences, "
                             f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """FLA's ``chunk_gated_delta_rule`` (0.5.x): returns ``(o [B, T, HV, V], final_state [N, HV, K, V] | None)``."""
    check_fla_call("chunk_gated_delta_rule", q, k, v, beta, initial_state, cu_seqlens,
                   {**kwargs, "cp_context": cp_context, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel,
                    "state_v_first": state_v_first, "output_final_state": output_final_state}, (16, 32, 64))
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if cp_context is not None:
        return cp_delta_rule(cp_context, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    return delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, **kwargs):
    """FLA's ``chunk_kda`` (0.5.x): KDA's per-key-channel decay ``g [B, T, HV, K]`` (natural log)."""
    check_fla_call("chunk_kda", q, k, v, beta, initial_state, cu_seqlens,
                   {**kwargs, "cp_context": cp_context, "use_gate_in_kernel": use_gate_in_kernel,
                    "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel, "safe_gate": safe_gate,
                    "return_intermediate_states": return_intermediate_states, "state_v_first": state_v_first,
                    "output_final_state": output_final_state}, (32, 64))
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.float64):
        # upstream: ``assert initial_state.dtype == torch.float32`` (float64 exists only in the stand-in)
        raise AssertionError("initial_state must be in float32.")
    Bsz, T, H, K = q.shape
    HV = v.shape[2]
    if K > 256:
        raise AssertionError(f"Currently we only support key headdim <=256 for KDA, got {K}.")
    if tuple(g.shape) != (Bsz, T, HV, K):
        raise AssertionError(f"g must have shape [B, T, HV, K]={[Bsz, T, HV, K]}, got {list(g.shape)}")
    if tuple(beta.shape) != (Bsz, T, HV):
        raise AssertionError(f"beta must have shape [B, T, HV]={[Bsz, T, HV]}, got {list(beta.shape)}")
    if scale is None:
        scale = K ** -0.5
    if cp_context is not None:
        return cp_delta_rule(cp_context, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    return delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


# --------------------------------------------------------------------------- FLA's context parallelism


@dataclass
class FLACPContext:
    """``fla.ops.cp.FLACPContext``'s fields (rank-local ``cu_seqlens``); ``global_cu_seqlens`` is the
    stand-in's own: its kernels gather the whole stream instead of exchanging states."""

    group: Any = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    is_last_rank: bool | None = None
    pre_num_ranks: int | None = None
    is_first_rank: bool | None = None
    post_num_ranks: int | None = None
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int | None = None
    global_cu_seqlens: torch.Tensor | None = None


def build_cp_context(cu_seqlens, group, conv1d_kernel_size=None, cu_seqlens_cpu=None) -> FLACPContext:
    """``fla.ops.cp.build_cp_context``: the global ``cu_seqlens`` of a batch-1 stream split into equal
    contiguous parts over ``group``; this rank's local ``cu_seqlens``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()).to(torch.long)
    total = int(cu[-1])
    if total < world:
        raise ValueError(f"`total_tokens` ({total}) must be at least `world_size` ({world}) for context parallelism.")
    if total % world:
        raise ValueError(f"`total_tokens` ({total}) must be divisible by `world_size` ({world}) for context "
                         "parallelism.")
    part = total // world
    local = (cu.clamp(min=part * rank, max=part * (rank + 1)) - part * rank).unique_consecutive().to(torch.int32)
    return FLACPContext(group=group, cu_seqlens=local.to(cu_seqlens.device), cu_seqlens_cpu=local,
                        conv1d_kernel_size=conv1d_kernel_size, global_cu_seqlens=cu)


def cp_delta_rule(cp_context: FLACPContext, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """The chunk kernels with ``cp_context``: this rank's outputs of the whole stream (batch 1), exact, by
    gathering every rank's part (differentiably) and running the rule over the global ``cu_seqlens``.
    A test double of FLA's CP semantics, not of its state exchange."""
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                         "Please flatten variable-length inputs before processing.")
    group = cp_context.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T = q.shape[1]
    if int(cp_context.global_cu_seqlens[-1]) != T * world:
        raise ValueError(f"cp_context describes {int(cp_context.global_cu_seqlens[-1])} tokens, the ranks hold "
                         f"{world} x {T}")
    full = [torch.cat(list(all_gather(x.contiguous(), group, tag="standin_fla_cp")), dim=1)
            for x in (q, k, v, g, beta)]
    o, _ = delta_rule(*full, scale, None, False, use_qk_l2norm_in_kernel, cp_context.global_cu_seqlens)
    return o[:, rank * T:(rank + 1) * T], None


__all__ = ["FLACPContext", "build_cp_context", "causal_conv1d_fn", "selective_scan_fn", "mamba_chunk_scan_combined", "chunk_gated_delta_rule",
           "chunk_kda"]
