"""Per-token log-probabilities (and entropies) of the target tokens under CP, for RL losses.

GRPO/PPO-style losses need ``log p(label_t | tokens <= t)`` for every token, not a mean NLL. The
obvious way (full logits, ``log_softmax``, gather) builds ``[N, vocab]`` per rank: 40 GB at 1M
tokens on 8 ranks for a 150k vocabulary in bf16. :func:`token_logprobs` instead

- projects the shard's hidden states through the LM head ``chunk_size`` tokens at a time, only
  for the tokens that have a label (a GRPO prompt is all ``-100``: it never reaches the head),
  so at most ``chunk_size x vocab`` logits exist at once; the backward recomputes each chunk's
  logits from the saved hidden states (a custom autograd function: nothing of size vocab is
  saved between forward and backward, only the per-token log-normaliser);
- applies what the model's own head does to its logits before a softmax: ``logit_scale``
  (Cohere, Falcon-H1, Granite's ``1/logits_scaling``), final-logit soft-capping (Gemma 2/3) and
  a sampling ``temperature``, in that order;
- all-gathers only the ``[B, N_local]`` results over the CP group and puts them back in global
  token order for the shard's layout (contiguous or head_tail): every rank gets ``[B, S]``.

The result is differentiable: the gather's backward sums each rank's gradient back to the rank that
owns the token (reduce-scatter). A loss computed identically on every rank from the gathered
values therefore follows the library's convention (the mean over the CP group of each rank's
parameter gradients is the single-device gradient), as DDP/FSDP2 averaging completes it.

Labels are the *shifted* labels the shard step produces (``shift_labels``: the target of token t
is token t+1; the last global position has none). A position whose label is ``ignore_index``
(-100) gets log-prob 0 and entropy 0 and no gradient: it is never projected.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..runtime import Runtime, active, runtime_of
from .batch import IGNORE_INDEX, gather_sequence
from .documents import BATCH_KWARG, CPBatch


def head_transform(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` a causal LM applies to its head's output, read from its
    (text) config: Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``, Granite's ``1 /
    logits_scaling``, Gemma's ``final_logit_softcapping``. 1.0 / None when the model has none."""
    get_text = getattr(config, "get_text_config", None)
    tcfg = get_text() if callable(get_text) else config
    scale = getattr(tcfg, "logit_scale", None)
    if scale is None:
        scale = getattr(tcfg, "lm_head_multiplier", None)
    if scale is None and getattr(tcfg, "logits_scaling", None) is not None:
        scale = 1.0 / tcfg.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(tcfg, "final_logit_softcapping", None)


def _hidden_of(hidden_or_output) -> torch.Tensor:
    """The final hidden states ``[B, N, H]`` of a tensor, a backbone output (``last_hidden_state``) or a
    causal-LM output run with ``output_hidden_states=True`` (its last entry is after the final norm)."""
    if isinstance(hidden_or_output, torch.Tensor):
        return hidden_or_output
    last = getattr(hidden_or_output, "last_hidden_state", None)
    if isinstance(last, torch.Tensor):
        return last
    states = getattr(hidden_or_output, "hidden_states", None)
    if states:
        return states[-1]
    raise TypeError(
        f"token_logprobs needs the final hidden states: a tensor [batch, seq, hidden], a backbone output with "
        "last_hidden_state, or a model output run with output_hidden_states=True; got "
        f"{type(hidden_or_output).__name__}"
    )


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype: the wider of the two (bf16 activations with fp32 master weights, as under
    autocast, run the head in fp32), the same in forward and in the recomputing backward."""
    return torch.promote_types(hidden.dtype, weight.dtype)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias, scale: float, softcap, temperature: float, acc):
    """One chunk's transformed logits ``z`` in the accumulation dtype, and ``dz/dy`` per element (None when
    it is the constant ``scale / temperature``)."""
    dt = _head_dtype(h, weight)
    y = h.to(dt) @ weight.to(dt).T
    if bias is not None:
        y = y + bias.to(dt)
    y = y.to(acc)
    if scale != 1.0:
        y = y * scale
    slope = None
    if softcap is not None:
        t = torch.tanh(y / softcap)
        y = softcap * t
        slope = (1 - t * t) * (scale / temperature)
    if temperature != 1.0:
        y = y / temperature
    return y, slope


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``(log p[label], entropy)`` of ``n`` tokens, ``chunk`` at a time; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, bias, scale, softcap, temperature, chunk, want_entropy):
        acc = torch.promote_types(_head_dtype(hidden, weight), torch.float32)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=acc)
        lse = hidden.new_empty(n, dtype=acc)
        ent = hidden.new_empty(n, dtype=acc) if want_entropy else None
        # autocast off: the backward recomputes the same logits in the same dtypes (it runs outside autocast)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z, _ = _logits(hidden[s:e], weight, bias, scale, softcap, temperature, acc)
                norm = torch.logsumexp(z, dim=-1)
                lse[s:e] = norm
                logp[s:e] = z.gather(1, labels[s:e, None]).squeeze(1) - norm
                if want_entropy:   # H = lse - sum_v p_v z_v
                    ent[s:e] = norm - (torch.softmax(z, dim=-1) * z).sum(-1)
                del z
        ctx.save_for_backward(hidden, labels, weight, bias, lse, ent)
        ctx.conf = (scale, softcap, temperature, chunk)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, labels, weight, bias, lse, ent = ctx.saved_tensors
        scale, softcap, temperature, chunk = ctx.conf
        acc = lse.dtype
        need_h, _, need_w, need_b = ctx.needs_input_grad[:4]
        gh = torch.zeros_like(hidden) if need_h else None
        gw = torch.zeros_like(weight, dtype=acc) if need_w else None
        gb = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):   # the forward's dtypes
            dt = _head_dtype(hidden, weight)
            w = weight.to(dt)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e]
                z, slope = _logits(h, weight, bias, scale, softcap, temperature, acc)
                p = torch.exp(z - lse[s:e, None])
                g = torch.zeros_like(z)
                if g_logp is not None:   # d logp / dz = onehot(label) - p
                    gl = g_logp[s:e].to(acc)
                    g = g - p * gl[:, None]
                    g.scatter_add_(1, labels[s:e, None], gl[:, None])
                if g_ent is not None:    # dH / dz = -p (z - lse + H)
                    g = g - g_ent[s:e].to(acc)[:, None] * p * (z - lse[s:e, None] + ent[s:e, None])
                del z, p
                g = g * slope if slope is not None else g * (scale / temperature)
                if need_h:
                    gh[s:e] = (g.to(dt) @ w).to(hidden.dtype)
                if need_w:
                    gw += (g.T.to(dt) @ h.to(dt)).to(acc)
                if gb is not None:
                    gb += g.sum(0)
        return (gh, None, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None)


def _cp_batch(batch) -> CPBatch | None:
    if batch is None or isinstance(batch, CPBatch):
        return batch
    if isinstance(batch, Mapping):
        return batch.get(BATCH_KWARG)
    raise TypeError(f"batch must be the shard's CPBatch (its `{BATCH_KWARG}` kwarg) or the shard dict, "
                    f"got {type(batch).__name__}")


def _group_for(cpb: CPBatch, group, runtime: Runtime | None, model):
    """The CP group to gather over, checked against the batch before any collective."""
    if group is None:
        rt = runtime if runtime is not None else (runtime_of(model) if model is not None else None)
        rt = rt if rt is not None else active()
        if rt is None:
            raise RuntimeError("token_logprobs got a CP shard but no CP group: pass group=, runtime= or a wired model=")
        group = rt.cp_group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (cpb.size, cpb.rank):
        raise RuntimeError(f"the batch was cut for rank {cpb.rank} of {cpb.size}, but the CP group has this process as "
                           f"rank {rank} of {size}; pass the group (or runtime) the batch was sharded for")
    return group


def token_logprobs(hidden_or_output, labels: torch.Tensor, *, model=None,
                   batch: CPBatch | Mapping[str, Any] | None = None, runtime: Runtime | None = None, group=None,
                   weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, temperature: float = 1.0, logit_scale: float | None = None,
                   softcap: float | None = None, chunk_size: int = 1024, entropy: bool = False, gather: bool = True,
                   ignore_index: int = IGNORE_INDEX):
    """Log-probability of each target token, ``[B, S]`` in global token order on every rank of the CP group.

    ``hidden_or_output``: the shard's final hidden states ``[B, N_local, H]`` (after the final norm), a
    backbone output (``last_hidden_state``) or a causal-LM output run with ``output_hidden_states=True``.
    ``labels``: the shard's ``shift_labels`` ``[B, N_local]`` (what ``context_parallel_region`` / the
    trainers' pre-hook put in the shard); ``ignore_index`` positions give 0 (log-prob and entropy) and
    no gradient. ``batch``: the shard's ``ringmaster_batch`` (a :class:`CPBatch`) or the shard dict
    carrying it: its rank, size and layout place the values; without one (no CP) nothing is gathered.
    The group is ``group``, else ``runtime``'s, else ``model``'s runtime's, else the current runtime's.

    The head is ``weight`` / ``bias`` or ``model.get_output_embeddings()``'s; ``logit_scale`` and ``softcap``
    default to the model config's (:func:`head_transform`), then the logits are divided by ``temperature``.
    ``chunk_size`` tokens go through the head at a time (forward and the recomputing backward), so the
    logits never exceed ``chunk_size x vocab``. Accumulates in float32 (float64 for a float64 model).

    Returns the log-probs, or ``(logprobs, entropies)`` with ``entropy=True``. ``gather=False`` returns
    this shard's ``[B, N_local]`` values in the shard's own order.
    """
    hidden = _hidden_of(hidden_or_output)
    if hidden.dim() != 3 or tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} must be [B, N, H] and "
                         "[B, N] for the same shard (pass the shard's shift_labels)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if weight is None:
        if model is None:
            raise ValueError("token_logprobs needs the LM head: pass model= (its get_output_embeddings()) or weight=")
        head = model.get_output_embeddings()
        weight = head.weight
        bias = getattr(head, "bias", None) if bias is None else bias
    if hasattr(weight, "full_tensor"):   # FSDP2 DTensor: the whole head, as the model's own forward sees it
        weight = weight.full_tensor()
    if bias is not None and hasattr(bias, "full_tensor"):
        bias = bias.full_tensor()
    if model is not None and (logit_scale is None or softcap is None):
        m_scale, m_softcap = head_transform(model.config)
        logit_scale = m_scale if logit_scale is None else logit_scale
        softcap = m_softcap if softcap is None else softcap
    logit_scale = 1.0 if logit_scale is None else float(logit_scale)

    cpb = _cp_batch(batch)
    cp = gather and cpb is not None and cpb.size > 1
    if cp:   # every check that can fail runs before the collective
        cp_group = _group_for(cpb, group, runtime, model)
        mine = cpb.local_len
        if labels.shape[1] != mine or (cpb.assignment is None and labels.shape[1] * cpb.size != cpb.seq_len):
            raise ValueError(f"this shard holds {labels.shape[1]} tokens but the batch gives this rank {mine} of "
                             f"{cpb.seq_len} over {cpb.size} ranks: pass the shard's own hidden states and shift_labels")

    B, N, H = hidden.shape
    flat_labels = labels.reshape(-1)
    keep = (flat_labels != ignore_index).nonzero().squeeze(1)
    h = hidden.reshape(B * N, H).index_select(0, keep)
    y = flat_labels.index_select(0, keep).to(torch.long)
    lp, ent = _ChunkedTokenLogprobs.apply(h, y, weight, bias, logit_scale, softcap, float(temperature),
                                          int(chunk_size), bool(entropy))
    outs = [lp] + ([ent] if entropy else [])
    outs = [v.new_zeros(B * N).index_copy(0, keep, v).view(B, N) for v in outs]
    if cp:
        documents = {"assignment": cpb.assignment} if cpb.assignment is not None else {}   # load_balance="documents"
        outs = [gather_sequence(v, dim=1, group=cp_group, layout=cpb.layout, **documents) for v in outs]
    return (outs[0], outs[1]) if entropy else outs[0]


__all__ = ["head_transform", "token_logprobs"]
