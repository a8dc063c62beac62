"""What one attention layer adds to the batch's global mask, and what CP refuses, per call.

The CP attention function gets HF's per-layer ``attention_mask`` as ``None`` (ringmaster's mask
function builds nothing: a mask for the local length would be wrong), so anything a family
encodes *only* in that mask must be recovered here from the layer's own config, from global
positions, or refused before the first collective. Every check below reads only facts that
are the same on every rank (config, global sequence length, shapes), so every rank raises
together and no collective is left waiting.

* **Chunked attention** (llama4 ``layer_types[i] == "chunked_attention"``, ``attention_chunk_size``):
  a key is visible iff it is causal and in the same chunk of its document. Chunks are documents
  of fixed length counted from *global* positions (:meth:`CPBatch.chunked`), so every backend's
  document machinery (sdpa tiles, flex BlockMask, flash varlen, Ring block plans) masks them.
* **Llama4 attention temperature tuning** (NoPE layers): HF scales queries by
  ``log1p(floor((t + 1) / floor_scale)) * attn_scale + 1`` with ``t = arange(local length)``, the
  shard's *local* index. The query is rescaled here by ``scale(global t) / scale(local t)`` (1 for
  every token until the sequence reaches ``floor_scale``), which makes it the single-device query.
* **A call over another length than the shard** (an attention over a pooled or windowed sequence,
  perhaps a second call of a layer that also attends normally): refused; every call, however
  many a layer makes per forward, must attend over this rank's whole shard.
* **Queries shorter than keys** (gemma4 slicing inputs to ``logits_to_keep`` before its
  KV-shared layers, a KV cache, cross-attention): refused; CP shards one self-attended sequence.
* **Cross-layer KV sharing** (gemma3n / gemma4 ``kv_sharing_modes``): needs nothing. The sharing
  layer stores the K/V it computed in a ``KVSharingDict`` *before* its attention call, and the
  reusing layer passes them to its own attention call; under CP those are the shard's own K/V
  (global RoPE positions), which is exactly what the reusing layer's CP attention expects. It
  does not go through the KV cache, so ``use_cache=False`` does not disable it.
* **ALiBi**: no family of the installed transformers that dispatches through the attention
  interface uses it; bloom and mpt compute theirs inline and reach the CP function through a site
  that passes per-head ``alibi_slopes`` (:mod:`ringmaster.attention.selfattn`; the kernels add
  ``slope * (k_pos - q_pos)`` from global positions);
  a ``alibi`` / ``position_bias`` tensor reaching the CP function is refused.
* **A hidden-state-conditioned relative position bias** (Inkling, declared per class as a
  ``RelativeBiasSite``): its ``position_bias`` arrives as per-token states and becomes a
  :class:`~ringmaster.attention.relbias.RelativeBias` the backends build from global positions; queries
  and states log-scaled by the *local* index are rescaled to the global one (:mod:`.relbias`).
* **Per-token attention sinks** (Inkling2's ``sinks`` ``[B, H, q, 1]``): moved to the backends' per-token
  sink kwarg; Ulysses all-to-alls them with q, Ring merges them per row (:mod:`.token_sinks`).
"""

from __future__ import annotations

import torch

from . import relbias, token_sinks

# kwargs that carry a bias built for the local shard's scores: nothing here rebuilds them globally
# (``position_bias`` of a declared relative-bias module is rebuilt: attention.relbias)
_REFUSED_BIAS_KWARGS = ("alibi",)


class _Where:
    """A layer's name for error messages, formatted only when one is raised: reading ``layer_idx`` on every
    call would make torch.compile specialise each decoder block on it (one graph per layer, and past
    dynamo's recompile limit at the ninth block)."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def __str__(self) -> str:
        return f"{type(self.module).__name__} (layer_idx={getattr(self.module, 'layer_idx', '?')})"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _where(module) -> _Where:
    return _Where(module)


def layer_chunk(module) -> int | None:
    """The chunk size of a chunked-attention layer (``config.layer_types[layer_idx] ==
    "chunked_attention"``), or None for any other layer."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if not layer_types or not isinstance(idx, int) or idx >= len(layer_types):
        return None
    if layer_types[idx] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{_where(module)} is a chunked_attention layer but config.attention_chunk_size={chunk!r}; "
                         "set it to the chunk length the model was trained with")
    return chunk


def local_index_rules(module) -> bool:
    """Whether CP attention corrects something this layer computes from the *local* token index (llama4's NoPE
    temperature, a relative bias's log scaling): the token-mixing check stands in for the whole module then."""
    tuned = getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
    return bool(tuned) or relbias.log_scaled(module)


def _temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama4's query temperature for positions (HF's formula, in fp32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def global_temperature(module, query: torch.Tensor, cpb) -> torch.Tensor:
    """Llama4 NoPE layers scale the queries by a temperature of the *local* token index; return
    the query scaled as on one device (global index). Unchanged when the layer has no tuning or
    no token's temperature differs (short sequences)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    floor_scale, attn_scale = float(module.floor_scale), float(module.attn_scale)
    if cpb.seq_len < floor_scale:  # floor((t + 1) / floor_scale) = 0 for every global t: scale 1 everywhere
        return query
    n = query.shape[2]
    local = _temperature_scales(torch.arange(n, device=query.device), floor_scale, attn_scale)
    glob = _temperature_scales(cpb.local_positions(query.device), floor_scale, attn_scale)
    ratio = (glob / local).to(query.dtype)
    return query * ratio.view(1, 1, n, 1)


def apply(module, query: torch.Tensor, key: torch.Tensor, cpb, kwargs: dict):
    """``(cpb, query)`` for this layer's CP call: the batch as this layer masks it (chunks) and the
    query as one device computes it; raises (before any collective) what CP cannot make exact."""
    # compiled, the shard's length is the query's (a documents part's length changes per batch; the first CP
    # forward's eager replay checks it against the batch)
    local = cpb.local_len if cpb is not None and not torch.compiler.is_compiling() else query.shape[2]
    if key.shape[2] == query.shape[2] != local:
        raise NotImplementedError(
            f"{_where(module)}: an attention call over {query.shape[2]} tokens, but this rank holds {local} of the "
            f"batch's {cpb.seq_len}. ringmaster CP attention is exact for self-attention over the rank's whole shard; "
            "a call over a pooled, windowed or otherwise re-cut sequence is not that (use a CP size of 1)")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"{_where(module)}: {query.shape[2]} query tokens against {key.shape[2]} keys on this rank. ringmaster CP "
            "runs full-sequence self-attention training forwards: no KV cache (use_cache=False), no query slicing "
            "(logits_to_keep=0; gemma4 slices before its KV-shared layers otherwise), no cross-attention")
    query, rel = relbias.take(module, query, cpb, kwargs, _where(module))
    if rel is not None:
        kwargs[relbias.KWARG] = rel
    token_sinks.take(query, kwargs, _where(module))   # Inkling2's per-token sinks travel with the queries
    for name in _REFUSED_BIAS_KWARGS:
        if isinstance(kwargs.get(name), torch.Tensor):
            raise NotImplementedError(
                f"{_where(module)} passes an attention bias `{name}` built for the local shard; ringmaster CP cannot "
                "rebuild it from global positions. Use a model without ALiBi/relative position bias, or no CP")
    chunk = layer_chunk(module)
    if chunk is not None:
        cpb = cpb.chunked(chunk)
    return cpb, global_temperature(module, query, cpb)
