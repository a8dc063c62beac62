"""Online-softmax merge of partial attention results, in fp32 (fp64 for fp64 inputs).

A block result is ``(out, lse)``: the softmax-weighted values over that block's keys and the
log-sum-exp of its scores. Two results merge into the result over the union of their keys.
A fully masked block has ``lse = -inf`` and contributes nothing (no NaN).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half precision, the input's own when it is wider (fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _weight(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    w = torch.exp(lse - total)
    return torch.where(torch.isneginf(total), torch.zeros_like(w), w)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge ``(out_b, lse_b)`` into the running ``(out, lse)``. out ``[..., S, D]``, lse ``[..., S]``."""
    out_b, lse_b = out_b.to(acc_dtype(out_b)), lse_b.to(acc_dtype(lse_b))
    if out is None:
        return out_b, lse_b
    total = torch.logaddexp(lse, lse_b)
    merged = out * _weight(lse, total).unsqueeze(-1) + out_b * _weight(lse_b, total).unsqueeze(-1)
    return merged, total


def sink_logits(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sink logit of every row of ``lse`` ``[B, H, S]``: ``sink`` is per head ``[H]`` (gpt-oss) or per
    query token ``[B, H, S]`` (Inkling2's ``sink_proj`` of the query's hidden state, the rows in ``lse``'s
    order: it travels with the queries)."""
    if sink.dim() == 1:
        return sink.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    if sink.shape != lse.shape:
        raise ValueError(f"per-token sinks {tuple(sink.shape)} for rows {tuple(lse.shape)}")
    return sink.to(lse.dtype)


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sink's gradient: ``-p_sink * (dout . out)`` per row, summed over batch and rows for a per-head sink."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)     # [B, H, S]
    g = -torch.exp(sink_logits(sink, lse) - lse) * delta          # the sink's share of each row, times delta
    return (g.sum(dim=(0, 2)) if sink.dim() == 1 else g).to(sink.dtype)


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """Add an attention sink (a logit whose value vector is zero) to a merged result.

    ``sink`` is ``[H]`` or per token ``[B, H, S]`` (:func:`sink_logits`); ``out`` ``[B, H, S, D]``. The sink
    enters the normaliser once.
    """
    s = sink_logits(sink, lse)
    total = torch.logaddexp(lse, s)
    return out * _weight(lse, total).unsqueeze(-1), total


def reference_attention(q, k, v, scale: float, mask: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                        softcap: float | None = None):
    """Dense softmax attention over the concatenation (fp32), for tests: returns ``(out, lse)``;
    ``softcap`` caps the scores at ``softcap * tanh(s / softcap)`` (Gemma-2)."""
    g = q.shape[1] // k.shape[1]
    dt = acc_dtype(q)
    k, v = k.repeat_interleave(g, dim=1).to(dt), v.repeat_interleave(g, dim=1).to(dt)
    s = torch.matmul(q.to(dt), k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    if sink is not None:
        s = torch.cat([s, sink.to(dt).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(s), torch.exp(s - lse.unsqueeze(-1)))
    return torch.matmul(p, v), lse
