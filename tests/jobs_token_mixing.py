"""Rank-side jobs of tests/test_token_mixing.py: modules no registry knows, on a tiny Llama, under CP."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringmaster as rm
from ringmaster.architectures import mixing
from ringmaster_tools.parity import compare


class RunningMean(nn.Module):
    """Wraps an MLP and adds the running mean of its input over the sequence (``x.cumsum(1) / arange``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        n = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return self.inner(x) + x.cumsum(1) / n


class SequenceCentredNorm(nn.Module):
    """The final norm, after subtracting the mean over the sequence."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x - x.mean(dim=1, keepdim=True))


class LocalSinusoid(nn.Module):
    """The token embedding plus a sinusoidal position numbered from the local input (``arange(S)``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        x = self.inner(input_ids)
        pos = torch.arange(input_ids.shape[1], device=x.device, dtype=x.dtype)[:, None]
        freq = torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)[None, :]
        return x + 0.1 * torch.sin(pos / (10000 ** (freq / x.shape[-1])))


class RemoteAttention(nn.Module):
    """Attention as hub repositories write it: fused ``wqkv``, rotary built from the local length, and either
    ``F.scaled_dot_product_attention(is_causal=True)`` called directly or ``softmax(QK^T + ALiBi)`` computed
    in the module."""

    def __init__(self, config, alibi: bool = False):
        super().__init__()
        self.heads = config.num_attention_heads
        self.dim = config.hidden_size // self.heads
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.alibi = alibi

    def forward(self, hidden_states, *args, **kwargs):
        B, S, _ = hidden_states.shape
        q, k, v = self.wqkv(hidden_states).view(B, S, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        if self.alibi:
            slopes = torch.tensor([2 ** (-8 * (h + 1) / self.heads) for h in range(self.heads)], dtype=q.dtype)
            pos = torch.arange(S, dtype=q.dtype)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
            scores = scores - slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            out = scores.softmax(-1) @ v
        else:
            pos = torch.arange(S, dtype=q.dtype)[:, None]   # rotary numbered from the local length
            inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=q.dtype) / self.dim))
            cos, sin = torch.cos(pos * inv).repeat(1, 2), torch.sin(pos * inv).repeat(1, 2)

            def rot(x):
                a, b = x.chunk(2, dim=-1)
                return x * cos + torch.cat([-b, a], dim=-1) * sin
            out = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(B, S, -1)), None


def _edit(case: str):
    def prepare(model):
        layers = model.model.layers
        if case == "running_mean_mlp":
            layers[0].mlp = RunningMean(layers[0].mlp)
        elif case == "sequence_centred_norm":
            model.model.norm = SequenceCentredNorm(model.model.norm)
        elif case == "local_positions":
            model.model.embed_tokens = LocalSinusoid(model.model.embed_tokens)
        elif case in ("remote_sdpa", "remote_alibi"):
            layers[1].self_attn = RemoteAttention(model.config, alibi=case == "remote_alibi")
        elif case in ("remote_sdpa_everywhere",):
            for layer in layers:
                layer.self_attn = RemoteAttention(model.config)
        elif case != "plain":
            raise ValueError(case)
    return prepare


def llama_case(ctx, case: str, P: int = 2, backend: str = "ulysses", probe: bool = True) -> dict:
    """The tiny Llama edited by ``case`` under CP against itself without CP: ``refused`` (the error, raised
    before any backward: ``grads`` counts the CP model's parameters with a gradient then) or the errors.
    ``probe=False`` is the mutation: the token-mixing probe sees no module."""
    original = mixing.candidates
    if not probe:
        mixing.candidates = lambda model, routed: {}
    seen: dict = {}

    def prepare(model):
        _edit(case)(model)
        seen["model"] = model
    try:
        r = compare("llama", rm.RingmasterConfig(size=P, backend=backend), seq_len=64, device_mesh=ctx.mesh(P),
                    prepare=prepare, num_hidden_layers=2)
    except rm.UnsupportedLayerError as exc:
        model = seen.get("model")
        grads = sum(p.grad is not None for p in model.parameters()) if model is not None else 0
        return {"refused": str(exc), "grads": grads}
    finally:
        mixing.candidates = original
        if "model" in seen and getattr(seen["model"], "_ringmaster_runtime", None) is not None:
            rm.unwire(seen["model"])
    return {"refused": None, "loss": r["loss_err"], "logits": r["logits_err"], "grad": r["grad_err_total"]}


def probe_report(ctx, P: int = 2) -> str:
    """The wiring report of a tiny Llama after its first CP forward (the probe's line)."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model = tiny_model("llama", num_hidden_layers=2)
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses"), device_mesh=ctx.mesh(P))
    try:
        before = runtime.report.token_probe
        with context_parallel_region(tiny_batch(model.config.vocab_size, 64), runtime=runtime) as shard:
            model(**shard)
        return {"before": before, "after": runtime.report.token_probe, "text": str(runtime.report)}
    finally:
        rm.unwire(model)
