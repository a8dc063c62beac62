"""Agree before communicating: one small all-gather per forward checks that every rank of the
CP group holds the same batch layout and configuration.

Without it, a rank whose batch is longer, shorter, differently packed or simply a different
batch issues collectives of other sizes than its peers: at best a crash with a message about
buffer sizes, at worst a hang or a silently wrong gradient. The fingerprint is a handful of
integers; a mismatch raises the same error, naming the differing fields per rank, on every rank.
The all-gather runs on the group's device (:func:`ringmaster.comm.collective_device`: the batch's
device when the group has a backend for it, else one it has; an NCCL group has none for CPU).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .comm import collective_device, diagnosed
from .compat import all_gather_single

FIELDS = ("seq_len", "batch", "layout", "cp_size", "backend", "ulysses", "ring", "dtype", "documents", "tokens")
_LAYOUTS = {"contiguous": 0, "head_tail": 1, "documents": 2}
_BACKENDS = {"ulysses": 0, "ring": 1, "usp": 2, "auto": 3}
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


class InputMismatchError(ValueError):
    """The ranks of a CP group disagree on the batch or the configuration."""


def _digest(t: torch.Tensor | None) -> int:
    """An order-sensitive integer digest of a tensor's values (0 for None), computed where the
    tensor lives; int64 arithmetic may wrap, which is deterministic and so fine for equality."""
    if t is None:
        return 0
    t = t.detach().reshape(-1)
    flat = (t.double() * 1e6).round().long() if t.is_floating_point() else t.long()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device) % 1_000_003 + 1
    return int((flat * weights).sum())


def fingerprint(meta: Mapping[str, Any], config, full_batch: Mapping[str, Any] | None,
                local: Mapping[str, Any] | None = None) -> list[int]:
    """The integers the ranks must agree on. ``full_batch`` (every rank holds the same one)
    contributes a digest of its tokens; a batch already cut in the collator contributes its
    local shapes only (its tokens differ per rank by design)."""
    ref = None
    for source in (full_batch, local):
        if source is not None:
            ref = source.get("input_ids", source.get("inputs_embeds"))
            if ref is not None:
                break
    embeds = (full_batch or {}).get("inputs_embeds", (local or {}).get("inputs_embeds"))
    return [
        int(meta["seq_len"]),
        int(ref.shape[0]) if ref is not None else -1,
        _LAYOUTS.get(meta["layout"], 9),
        int(meta["size"]),
        _BACKENDS.get(config.backend.value, 9) if config is not None else -1,
        int(config.ulysses_size) if config is not None else -1,
        int(config.ring_size) if config is not None else -1,
        _DTYPES.get(embeds.dtype, 0) if isinstance(embeds, torch.Tensor) else 0,
        _digest(meta.get("doc_ids")),
        _digest(full_batch.get("input_ids")) if full_batch is not None else
        # a documents batch's shards differ in length by design: its row length is what the ranks share
        int(meta["seq_len"]) if meta.get("assignment") is not None else int(ref.shape[-1]) if ref is not None else 0,
    ]


# DeepSpeed counts every rank as data-parallel: its loader and the HF Trainer's with deepspeed= give each rank its own batch
_DEEPSPEED_HINT = ("; DeepSpeed's data loader (deepspeed.initialize(training_data=...)) and the HF Trainer with "
                   "deepspeed= count every rank as data-parallel and give each its own batch: sample per CP group "
                   "instead (ringmaster.adapters.trl.CPSFTTrainer does; else a sampler over world_size // cp_size "
                   "replicas, indexed by this rank's CP group; docs/integration.md, DeepSpeed ZeRO)")


def check_agreement(values: list[int], group, device=None) -> None:
    """All-gather the fingerprint over ``group`` and raise the same error on every rank if any differs.

    ``device``: where the fingerprint travels (:func:`validate_batch` passes the group's device for the
    batch); None: :func:`~ringmaster.comm.collective_device` of the group. The gathered rows come back
    to the host in one transfer, then every comparison is plain Python."""
    device = collective_device(group) if device is None else device
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    P = dist.get_world_size(group)
    gathered = torch.empty(P * mine.numel(), dtype=torch.int64, device=device)
    with diagnosed("all_gather", "input fingerprint", group):
        all_gather_single(gathered, mine, group=group)
    rows = gathered.view(P, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    differ = [FIELDS[i] for i in range(len(FIELDS)) if any(row[i] != rows[0][i] for row in rows)]
    def shown(field: str, value: int) -> str:   # the tokens enter as a digest, not a count
        return f"token digest {value & 0xFFFFFFFFFFFFFFFF:016x}" if field == "tokens" else f"{field}={value}"
    per_rank = "; ".join(f"rank {r}: " + ", ".join(shown(f, rows[r][FIELDS.index(f)]) for f in differ)
                         for r in range(P))
    if "tokens" in differ:
        hint = ("every rank of a CP group must pass the same full batch (same data-loader seed/sampler for the "
                "ranks of one CP group; data parallelism happens across CP groups)")
        if "deepspeed" in sys.modules:
            hint += _DEEPSPEED_HINT
    else:
        hint = "every rank must use the same sequence length, packing and RingmasterConfig"
    raise InputMismatchError(f"the CP group disagrees on {', '.join(differ)} ({per_rank}); {hint}. "
                             "Set RingmasterConfig(validate_inputs=False) to skip this check")


def validate_batch(runtime, meta: Mapping[str, Any], full_batch=None, local=None) -> None:
    """The per-forward check, unless the runtime's config switched it off. The fingerprint goes to
    the group's device for the batch (the batch's own device when the group has a backend for it)."""
    if runtime is None or not getattr(runtime.config, "validate_inputs", True) or runtime.cp_size == 1:
        return
    like = next((value for source in (full_batch, local) for value in (source or {}).values()
                 if isinstance(value, torch.Tensor)), None)
    device = collective_device(runtime.cp_group, like=like)
    check_agreement(fingerprint(meta, runtime.config, full_batch, local), runtime.cp_group, device)
