"""Stand-in for ``fla.layers.mamba2``: the interface of flash-linear-attention's Mamba2 layer.

Kept from the real layer: the module-level kernel names (``mamba_chunk_scan_combined``,
``mamba_split_conv1d_scan_combined``, ``selective_state_update``: mamba-ssm's when installed, else
None), the conv kernels as *instance* attributes (``self.causal_conv1d_fn(x=, weight=, bias=,
activation=)``), and ``cuda_kernels_forward`` / ``torch_forward(hidden_states, last_state, use_cache,
attention_mask)`` returning ``(output, conv_state, ssm_state)``. The kernel path calls the fused
``mamba_split_conv1d_scan_combined`` in training without a cache, else the conv,
``mamba_chunk_scan_combined(..., return_final_states=True)``, ``self.norm(y, gate)`` and ``out_proj``;
the torch path is a pure-torch token loop.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined
except ImportError:
    selective_state_update, mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined = None, None, None
try:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except ImportError:
    causal_conv1d_fn, causal_conv1d_update = None, None
is_fast_path_available = selective_state_update is not None


def _mask(x, attention_mask):
    if attention_mask is not None and attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1:
        return (x * attention_mask[:, :, None]).to(x.dtype)
    return x


class Mamba2(nn.Module):
    """Only the methods; axolotl's view owns no parameters of its own (the transformers mixer does)."""

    def _split(self, projected):
        d_mlp = (projected.shape[-1] - 2 * self.intermediate_size - 2 * self.n_groups * self.ssm_state_size
                 - self.num_heads) // 2
        return projected.split([d_mlp, d_mlp, self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)

    def cuda_kernels_forward(self, hidden_states, last_state=None, use_cache=False, attention_mask=None):
        projected_states = self.in_proj(hidden_states)
        b, l, _ = hidden_states.shape
        gn = self.n_groups * self.ssm_state_size
        if last_state is not None:
            conv_state, ssm_state = last_state["conv_state"], last_state["recurrent_state"]
            _, _, gate, xbc, dt = self._split(projected_states.squeeze(1))
            xbc = self.causal_conv1d_update(xbc.contiguous(), conv_state, self.conv1d.weight.squeeze(1),
                                            self.conv1d.bias, self.activation)
            x, B, C = torch.split(xbc, [self.intermediate_size, gn, gn], dim=-1)
            A = (-torch.exp(self.A_log.float()))[:, None, None].expand(-1, self.head_dim, self.ssm_state_size)
            y = selective_state_update(ssm_state, x.view(b, self.num_heads, self.head_dim),
                                       dt[:, :, None].expand(-1, -1, self.head_dim), A,
                                       B.view(b, self.n_groups, -1), C.view(b, self.n_groups, -1),
                                       self.D[:, None].expand(-1, self.head_dim), z=None,
                                       dt_bias=self.dt_bias[:, None].expand(-1, self.head_dim), dt_softplus=True)
            y = self.norm(y.view(b, -1), gate)
            return self.out_proj(y)[:, None], conv_state, ssm_state
        A = -torch.exp(self.A_log.float())
        limit = {} if tuple(self.time_step_limit) == (0.0, float("inf")) else {"dt_limit": self.time_step_limit}
        if self.training and not use_cache:
            out = mamba_split_conv1d_scan_combined(
                projected_states, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, A, D=self.D,
                chunk_size=self.chunk_size, seq_idx=None, activation=self.activation, rmsnorm_weight=self.norm.weight,
                rmsnorm_eps=self.norm.eps, outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias,
                headdim=self.head_dim, ngroups=self.n_groups, norm_before_gate=False, return_final_states=False,
                **limit)
            return out, None, None
        _, _, gate, xbc, dt = self._split(projected_states)
        conv_state = F.pad(xbc.transpose(1, 2), (self.conv_kernel_size - l, 0)) if use_cache else None
        if self.activation not in ("silu", "swish"):
            xbc = self.act(self.conv1d(xbc.transpose(1, 2))[..., :l].transpose(1, 2))
        else:
            xbc = self.causal_conv1d_fn(x=xbc.transpose(1, 2).contiguous(), weight=self.conv1d.weight.squeeze(1),
                                        bias=self.conv1d.bias, activation=self.activation).transpose(1, 2)
        xbc = _mask(xbc, attention_mask)
        x, B, C = torch.split(xbc, [self.intermediate_size, gn, gn], dim=-1)
        y, ssm_state = mamba_chunk_scan_combined(
            x.view(b, l, -1, self.head_dim), dt, A, B.view(b, l, self.n_groups, -1), C.view(b, l, self.n_groups, -1),
            chunk_size=self.chunk_size, D=self.D, z=None, seq_idx=None, return_final_states=True,
            dt_bias=self.dt_bias, dt_softplus=True, **limit)
        y = self.norm(y.view(b, l, -1), gate)
        return self.out_proj(y), conv_state, ssm_state

    def torch_forward(self, input_states, last_state=None, use_cache=False, attention_mask=None):
        if last_state is not None:
            raise NotImplementedError("the fla stand-in's torch path does not decode")
        b, l, _ = input_states.shape
        dtype = input_states.dtype
        _, _, gate, xbc, dt = self._split(self.in_proj(input_states))
        conv_state = F.pad(xbc.transpose(1, 2), (self.conv_kernel_size - l, 0)) if use_cache else None
        xbc = _mask(self.act(self.conv1d(xbc.transpose(1, 2))[..., :l].transpose(1, 2)), attention_mask)
        gn = self.n_groups * self.ssm_state_size
        x, B, C = torch.split(xbc, [self.intermediate_size, gn, gn], dim=-1)
        h, p, rep = self.num_heads, self.head_dim, self.num_heads // self.n_groups
        dt = F.softplus(dt + self.dt_bias).clamp(self.time_step_limit[0], self.time_step_limit[1])   # [b, l, h]
        A = -torch.exp(self.A_log.float())
        x = x.reshape(b, l, h, p)
        B = B.reshape(b, l, self.n_groups, -1).repeat_interleave(rep, dim=2)
        C = C.reshape(b, l, self.n_groups, -1).repeat_interleave(rep, dim=2)
        state = x.new_zeros(b, h, p, self.ssm_state_size)
        ys = []
        for t in range(l):
            state = torch.exp(dt[:, t] * A)[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
            ys.append((state * C[:, t, :, None]).sum(-1))
        y = (torch.stack(ys, dim=1) + x * self.D[:, None]).reshape(b, l, -1)
        return self.out_proj(self.norm(y, gate).to(dtype)), conv_state, state

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        if past_key_values is not None:
            raise NotImplementedError("the fla stand-in has no cache")
        run = self.cuda_kernels_forward if is_fast_path_available and hidden_states.is_cuda else self.torch_forward
        return run(hidden_states, None, use_cache, attention_mask)[0], None, past_key_values
