"""Stand-in for ``fla.layers.mamba``: the interface of flash-linear-attention's Mamba layer.

What callers rely on is kept: the module-level kernel names (``mamba_inner_fn``, ``selective_scan_fn``,
``selective_state_update``: mamba-ssm's when installed, else None), the conv kernels as *instance*
attributes (``self.causal_conv1d_fn`` / ``self.causal_conv1d_update``), and the methods
``cuda_kernels_forward`` / ``slow_forward(hidden_states, last_state, use_cache, attention_mask)``
returning ``(output, conv_state, ssm_state)``. The kernel path calls the fused ``mamba_inner_fn`` in
training without a cache, else the conv, ``x_proj``, ``dt_proj.weight @ time_step`` and
``selective_scan_fn(..., return_last_state=True)``; the slow path is a pure-torch token loop.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except ImportError:
    mamba_inner_fn, selective_scan_fn, selective_state_update = None, None, None
try:
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
except ImportError:
    causal_conv1d_fn, causal_conv1d_update = None, None
is_fast_path_available = all((mamba_inner_fn, selective_scan_fn, selective_state_update))


class Mamba(nn.Module):
    def __init__(self, hidden_size=2048, state_size=16, conv_kernel=4, use_conv_bias=True, intermediate_size=2048,
                 time_step_rank=256, use_bias=True, hidden_act="silu", layer_idx=None, backend="cuda"):
        super().__init__()
        self.hidden_size, self.ssm_state_size, self.conv_kernel_size = hidden_size, state_size, conv_kernel
        self.use_conv_bias, self.intermediate_size, self.time_step_rank = use_conv_bias, intermediate_size, time_step_rank
        self.use_bias, self.activation, self.layer_idx = use_bias, hidden_act, layer_idx
        self.act = nn.SiLU()
        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel, bias=use_conv_bias,
                                groups=intermediate_size, padding=conv_kernel - 1)
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=use_bias)
        self.x_proj = nn.Linear(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(time_step_rank, intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state_size + 1.0)).expand(intermediate_size, -1).clone())
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=use_bias)
        self.backend = os.environ.get("FLA_CONV_BACKEND", backend)
        self.causal_conv1d_fn, self.causal_conv1d_update = causal_conv1d_fn, causal_conv1d_update

    def cuda_kernels_forward(self, hidden_states, last_state=None, use_cache=False, attention_mask=None, **kwargs):
        projected_states = self.in_proj(hidden_states).transpose(1, 2)
        if self.training and not use_cache:
            out = mamba_inner_fn(projected_states, self.conv1d.weight, self.conv1d.bias if self.use_conv_bias else None,
                                 self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight,
                                 self.out_proj.bias.float() if self.use_bias else None, -torch.exp(self.A_log.float()),
                                 None, None, self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)
            return out, None, None
        hidden_states, gate = projected_states.chunk(2, dim=1)
        if attention_mask is not None and last_state is None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)
        weight = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        if last_state is not None:
            conv_state, ssm_state = last_state["conv_state"], last_state["recurrent_state"]
            hidden_states = self.causal_conv1d_update(hidden_states.squeeze(-1), conv_state, weight, self.conv1d.bias,
                                                      self.activation).unsqueeze(-1)
        else:
            conv_state = ssm_state = None
            if use_cache:
                conv_state = F.pad(hidden_states, (self.conv_kernel_size - hidden_states.shape[-1], 0))
            hidden_states = self.causal_conv1d_fn(hidden_states, weight, self.conv1d.bias, activation=self.activation)
        if attention_mask is not None and last_state is None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)
        params = self.x_proj(hidden_states.transpose(1, 2))
        time_step, B, C = torch.split(params, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        dt = self.dt_proj.weight @ time_step.transpose(1, 2)
        A = -torch.exp(self.A_log.float())
        dt_bias = self.dt_proj.bias.float() if hasattr(self.dt_proj, "bias") else None
        if last_state is not None:
            y = selective_state_update(ssm_state, hidden_states[..., 0], dt[..., 0], A, B[:, 0], C[:, 0], self.D,
                                       gate[..., 0], dt_bias, dt_softplus=True).unsqueeze(-1)
        else:
            y, ssm_state = selective_scan_fn(hidden_states, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.float(),
                                             gate, dt_bias, delta_softplus=True, return_last_state=True)
        return self.out_proj(y.transpose(1, 2)), conv_state, ssm_state

    def slow_forward(self, input_states, last_state=None, use_cache=False, attention_mask=None, **kwargs):
        b, l, _ = input_states.shape
        dtype = input_states.dtype
        hidden_states, gate = self.in_proj(input_states).transpose(1, 2).chunk(2, dim=1)
        if attention_mask is not None and last_state is None:
            hidden_states = hidden_states * attention_mask.unsqueeze(1)
        if last_state is not None:
            conv_state = last_state["conv_state"].roll(shifts=-1, dims=-1)
            conv_state[:, :, -1] = hidden_states[:, :, 0]
            ssm_state = last_state["recurrent_state"].clone()
            x = (conv_state * self.conv1d.weight[:, 0, :]).sum(-1)
            x = self.act(x + self.conv1d.bias if self.use_conv_bias else x).to(dtype).unsqueeze(-1)
        else:
            conv_state = F.pad(hidden_states, (self.conv_kernel_size - l, 0)) if use_cache else None
            ssm_state = hidden_states.new_zeros(b, self.intermediate_size, self.ssm_state_size)
            x = self.act(self.conv1d(hidden_states)[..., :l])
        if attention_mask is not None and last_state is None:
            x = x * attention_mask.unsqueeze(1)
        params = self.x_proj(x.transpose(1, 2))
        time_step, B, C = torch.split(params, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        dt = F.softplus(self.dt_proj(time_step)).transpose(1, 2)                 # [b, d, l]
        A = -torch.exp(self.A_log.float())
        ys = []
        for t in range(x.shape[-1]):
            ssm_state = torch.exp(A * dt[:, :, t, None]) * ssm_state + (dt[:, :, t] * x[:, :, t])[..., None] * B[:, None, t]
            ys.append((ssm_state.to(dtype) * C[:, None, t]).sum(-1))
        y = (torch.stack(ys, dim=-1) + x * self.D[None, :, None]) * self.act(gate)
        return self.out_proj(y.transpose(1, 2)), conv_state, ssm_state

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, **kwargs):
        if past_key_values is not None:
            raise NotImplementedError("the fla stand-in has no cache")
        run = self.cuda_kernels_forward if is_fast_path_available and hidden_states.is_cuda else self.slow_forward
        return run(hidden_states, None, use_cache, attention_mask)[0], None, past_key_values
