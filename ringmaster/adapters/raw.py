"""Raw PyTorch: shard one full batch for this rank and follow the loss convention."""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from ..runtime import active, runtime_of
from ..sharding.assignment import policy_of
from ..sharding.batch import (CP_SHARD_KEY, apply_positions, batch_kwarg, check_shard_target, global_num_items,
                              shard_collated_batch)
from ..sharding.carrier import carrier_of, holding
from ..sharding.documents import BATCH_KWARG
from ..validation import validate_batch


@contextlib.contextmanager
def context_parallel_region(batch: Mapping[str, Any], *, runtime=None, model=None, num_items_in_batch=None):
    """Yield this rank's shard of ``batch`` (every rank of the CP group passes the same full batch).

    The shard is cut for ``runtime`` (what ``rm.wire`` returned), or for ``model``'s runtime, or
    else for the current runtime (the last ``rm.setup``/``rm.wire``): with two wired models in one
    process, pass the one this batch is for. The batch may be packed (position_ids restarting per
    document, or ``cu_seq_lens``) or padded (``attention_mask`` zeros, labels -100 there):
    documents never see each other and padding is never attended. The shard carries the batch's
    global document structure and layout as the ``ringmaster_batch`` kwarg, which the CP layers
    read (and check against what they were bound to); inside the block the same step context is
    held by the step carrier of ``model`` (else of every model wired against the runtime) for the
    layers transformers calls without kwargs, and cleared on exit (:mod:`ringmaster.sharding.carrier`).

    ``model(**shard).loss`` then follows the convention: the mean over the CP group of each
    rank's loss and gradients equals the single-device loss and gradients. Pass
    ``num_items_in_batch`` (global supervised tokens, e.g. over a gradient-accumulation window)
    to override the count taken from this batch.
    """
    if model is not None:   # an unwired model, or one rm.setup's path cannot make exact, raises here
        runtime = check_shard_target(model, runtime if runtime is not None else runtime_of(model), None, None)
    rt = runtime if runtime is not None else active()
    shard = shard_collated_batch(batch, rt.cp_rank, rt.cp_size, rt.shard_load_balance,
                                 multimodal=rt.multimodal is not None, documents=policy_of(rt), keep_one=rt.compiled)
    meta = shard.pop(CP_SHARD_KEY)
    validate_batch(rt, meta, full_batch=batch)
    shard[BATCH_KWARG] = batch_kwarg(meta, rt)
    apply_positions(rt, shard)   # absolute position tables: the model's own numbering of the full row
    count = num_items_in_batch if num_items_in_batch is not None else global_num_items(batch)
    if count is not None and "shift_labels" in shard:
        count = torch.as_tensor(count, dtype=torch.float32)
        shard["num_items_in_batch"] = count / rt.cp_size
    shard["use_cache"] = False
    if model is not None:
        found = carrier_of(model)
        carriers = [found] if found is not None else []
    else:
        carriers = rt.carriers
    with holding(carriers, shard[BATCH_KWARG]):
        yield shard
