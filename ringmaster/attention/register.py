"""Register one CP attention function per runtime with transformers' attention interface.

Each runtime gets a name of its own (``ringmaster_<backend>_<inner>_<n>``) whose function is
closed over that runtime's :class:`~ringmaster.runtime.AttentionBinding` (groups, ring block
kernel, rotation). A model switched to that name calls exactly that binding, so models wired
differently in one process never see each other's settings.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from ..comm import with_layer_context
from ..compat import has_module
from ..sharding.documents import BATCH_KWARG, CPBatch, by_parts
from . import layer_rules, local, relbias, ulysses, usp
from .token_sinks import KWARG as TOKEN_SINKS
from .binding import AttentionBinding
from .ring import hf as ring_hf


def attention_name(backend: str, inner: str, serial: int | None = None) -> str:
    """The name registered with transformers: no '/' (read as a hub repo), no 'flash' and no 'sdpa'
    (HF special-cases names containing them: a name with 'sdpa' runs the model's SDPA dispatch check,
    which raises for a model without attention modules, e.g. a pure Mamba set through axolotl)."""
    short = re.sub(r"[^0-9a-zA-Z]+", "_", inner).strip("_").replace("flash", "fa").replace("sdpa", "sdp")
    return f"ringmaster_{backend}_{short}" + (f"_{serial}" if serial is not None else "")


def require_batch(kwargs: dict, binding: AttentionBinding, module=None) -> CPBatch:
    """The per-batch structure a CP attention call needs, checked against what the function is bound
    to, before any collective (fail closed: a batch cut for another group, rank or layout raises)."""
    cpb = kwargs.pop(BATCH_KWARG, None)
    if cpb is None:
        raise RuntimeError(
            f"ringmaster CP attention ({binding.name or binding.backend}) was called without the batch's global "
            "structure: shard batches with ringmaster.adapters.raw.context_parallel_region(batch) or "
            "ContextParallelContextManager, which pass it to the model as the `ringmaster_batch` kwarg (generation and "
            "other unsharded calls need the model unwired: rm.unwire(model))"
            + (binding.ledger.missing_batch(module) if binding.ledger is not None else "")
        )
    if cpb.size != binding.cp_size or cpb.rank != binding.cp_rank:
        raise RuntimeError(
            f"the batch was cut for rank {cpb.rank} of {cpb.size}, but this model's CP attention "
            f"({binding.name}) runs as rank {binding.cp_rank} of {binding.cp_size}; shard it with this model's "
            "runtime (context_parallel_region(batch, runtime=runtime) or ContextParallelContextManager(models, "
            "runtime.cp_group))"
        )
    if cpb.layout not in binding.layouts():
        raise RuntimeError(
            f"the batch was cut in the {cpb.layout!r} layout, but {binding.backend} attention ({binding.name}) "
            f"needs {' or '.join(binding.layouts())} shards; shard with load_balance='contiguous' (or leave "
            "load_balance unset so the model's own runtime decides)"
        )
    return cpb


def per_token_attention(query, key, value):
    """The token-mixing check's stand-in for CP attention (``CPBatch.stand_in``): each token's output from that
    token's q, k and v alone, shaped as attention's ``[B, S, Hq, Dv]``; no collective."""
    groups = query.shape[1] // key.shape[1] if query.shape[1] % key.shape[1] == 0 else None

    def heads(t):
        if t.shape[1] == query.shape[1]:
            return t
        return t.repeat_interleave(groups, dim=1) if groups else t.mean(1, keepdim=True).expand(-1, query.shape[1], -1, -1)
    out = heads(value) + torch.tanh(query).mean(-1, keepdim=True) + torch.tanh(heads(key)).mean(-1, keepdim=True)
    return out.transpose(1, 2).contiguous(), None


def _call(fn, binding: AttentionBinding, module, query, key, value, attention_mask, **kwargs):
    if getattr(kwargs.get(BATCH_KWARG), "stand_in", False):   # the token-mixing check's runs
        return per_token_attention(query, key, value)
    if local.is_local(module):  # per-token attention over layer depth: the wrapped kernel, no collective
        kwargs.pop(BATCH_KWARG, None)
        return ulysses.inner_attention(binding.inner, module)(module, query, key, value, attention_mask, **kwargs)
    ledger = binding.ledger
    # the first CP forward only (attention.accounting); a compiled block never records (its forward is replayed
    # eagerly for the ledger), so the graph does not depend on the layer or the ledger's state
    if not torch.compiler.is_compiling() and ledger is not None and ledger.armed:
        ledger.record(module, attention_mask)
    cpb = require_batch(kwargs, binding, module)
    if cpb.assignment is not None:   # load_balance="documents": the split documents over the group, the rest here
        return _documents(fn, binding, module, query, key, value, cpb, kwargs)
    cpb, query = layer_rules.apply(module, query, key, cpb, kwargs)  # chunks, temperature, refusals
    return fn(module, query, key, value, binding=binding, cpb=cpb, **kwargs)


def _documents(fn, binding: AttentionBinding, module, query, key, value, cpb: CPBatch, kwargs: dict):
    """A documents batch's attention: the shard's first ``split_share`` tokens are its piece of the long
    documents, run by the backend over the group (only they travel); the rest are this rank's whole
    documents, run by the model's own kernel here with no collective (Ulysses' path at one rank). Both
    parts mask by their own documents; their outputs are concatenated in the shard's order (the step context's
    one cut, :func:`~ringmaster.sharding.documents.by_parts`, as the recurrent kernels')."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ulysses.LOCAL_ONLY_KWARGS}   # each part masks by cpb
    for name in _PER_TOKEN_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__}: load_balance='documents' runs each document's attention in one of two "
                f"parts, and this call brings per-token {name!r} ringmaster does not cut yet; use "
                "load_balance='auto' for this model")
    split = cpb.parts[0]
    if split is not None and split.layout not in binding.layouts():
        raise RuntimeError(f"the split documents were cut {split.layout!r}, but {binding.backend} attention "
                           f"({binding.name}) needs {' or '.join(binding.layouts())}")

    def attend(kernel, part, q, k, v):
        kw = dict(kwargs)
        part, q = layer_rules.apply(module, q, k, part, kw)
        return kernel(module, q, k, v, binding=binding, cpb=part, **kw)[0], None

    return by_parts(cpb, partial(attend, fn), (query, key, value), (2, 2, 2), 1,
                    whole=partial(attend, ulysses.local_attention))


# per-token attention inputs a documents batch would have to cut per part (Inkling's relative-bias states,
# Inkling2's per-token sinks): refused under load_balance="documents"
_PER_TOKEN_KWARGS = (relbias.KWARG, TOKEN_SINKS)


def cp_attention(binding: AttentionBinding):
    """The attention-interface function for ``binding``: q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]``
    -> ``[B, S/P, Hq, D]``."""
    fn = {"ulysses": ulysses.ulysses_attention, "ring": ring_hf.ring_attention_hf,
          "usp": usp.usp_attention_hf}[binding.backend]
    return with_layer_context(partial(_call, fn, binding))


def no_cache_mask(*, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, **kwargs):
    """Mask-interface function for ringmaster's names: nothing to build here (the CP attention
    builds its masks for the whole sequence from ``ringmaster_batch``), but a KV cache, whose
    offsets describe one shard only, is refused."""
    if (isinstance(q_offset, int) and q_offset) or kv_offset or q_length != kv_length:
        raise NotImplementedError(
            f"ringmaster CP runs training/prefill forwards without a KV cache (q_offset={q_offset}, "
            f"q_length={q_length}, kv_length={kv_length}); call the model with use_cache=False"
        )
    return None


def register_attention(binding: AttentionBinding) -> bool:
    """Register ``binding``'s function (and its mask function) under ``binding.name``. Returns False
    when transformers is not installed (the collectives still work on raw tensors)."""
    if not has_module("transformers"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(binding.name, cp_attention(binding))
    AttentionMaskInterface.register(binding.name, no_cache_mask)
    return True
