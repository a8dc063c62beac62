"""Absolute position indices under CP: what a single-device model would build, cut for this shard.

Why this exists: a model with a learned (absolute) position table builds the table's indices
itself when it gets no ``position_ids``, and each family has its own rule, computed over the
whole row: GPT-2, BERT, BioGPT number tokens ``0..S-1``; OPT numbers them by the cumulative
``attention_mask`` (left padding starts at 0); RoBERTa and its descendants skip padding *tokens*
(``padding_idx + 1 + `` the count of non-pad tokens so far). Under CP each rank holds one shard
of the row, and the rule applied to the shard gives the wrong numbers (the count restarts, the
mask is gone). So ringmaster computes the family's rule on the *full* row, which every rank
holds before the cut, and hands this rank's slice (in its layout: contiguous or head_tail) to
the model as ``position_ids``; the model adds its own constant offset (OPT's 2) exactly as it
does on one device. Which rule a model follows is not declared per family: ``rm.wire`` finds it
with a probe forward of the unwired model (:mod:`ringmaster.architectures.positions`) and
refuses a model that follows none of these rules.

A batch that brings its own ``position_ids`` is left alone: every family here indexes its table
with ``position_ids + offset``, element by element, so the shard of the given ids is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, MutableMapping

import torch

from .documents import BATCH_KWARG

# full-row rules: (input_ids [B,S] | None, attention_mask [B,S] | None, padding_idx, (B, S), device) -> [B,S] long


def _arange(input_ids, attention_mask, padding_idx, shape, device) -> torch.Tensor:
    B, S = shape
    return torch.arange(S, device=device).unsqueeze(0).expand(B, S)


def _mask_cumsum(input_ids, attention_mask, padding_idx, shape, device) -> torch.Tensor:
    """OPT's rule: ``cumsum(mask) * mask - 1`` (padding gets -1; no mask: all ones)."""
    mask = attention_mask if attention_mask is not None else torch.ones(shape, dtype=torch.long, device=device)
    return (torch.cumsum(mask, dim=1) * mask - 1).long()


def _pad_cumsum(input_ids, attention_mask, padding_idx, shape, device) -> torch.Tensor:
    """RoBERTa's rule (fairseq ``make_positions``): non-pad tokens count from ``padding_idx + 1``,
    pad tokens get ``padding_idx``; with no input_ids (``inputs_embeds``) every token counts."""
    if input_ids is None:
        keep = torch.ones(shape, dtype=torch.long, device=device)
    else:
        keep = input_ids.ne(padding_idx).long()
    return torch.cumsum(keep, dim=1) * keep + padding_idx


RULES: dict[str, Callable[..., torch.Tensor]] = {
    "arange": _arange,            # GPT-2, BERT, ELECTRA, ERNIE, BioGPT (+2 inside the module)
    "mask_cumsum": _mask_cumsum,  # OPT (+2 inside the module)
    "pad_cumsum": _pad_cumsum,    # RoBERTa, XLM-R, CamemBERT, data2vec-text
}


def rule_positions(rule: str, input_ids, attention_mask, padding_idx, shape, device) -> torch.Tensor:
    if rule == "pad_cumsum" and padding_idx is None:
        raise ValueError("the pad_cumsum position rule needs a padding_idx")
    return RULES[rule](input_ids, attention_mask, padding_idx, shape, device)


def row_inputs(batch, seq_len: int) -> dict[str, Any] | None:
    """What a position rule needs from a *full* batch, kept before the cut (the shard drops the
    attention_mask): the rows' ``input_ids`` and raw ``attention_mask`` (references, no copy) and
    the batch size, or None when the batch brings its own ``position_ids`` (then those are the
    positions, on one device and under CP)."""
    if batch.get("position_ids") is not None:
        return None
    ids = batch.get("input_ids")
    ref = ids if isinstance(ids, torch.Tensor) else batch.get("inputs_embeds")
    if not isinstance(ref, torch.Tensor):
        return None
    mask = batch.get("attention_mask")
    return {"input_ids": ids if isinstance(ids, torch.Tensor) else None,
            "attention_mask": mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None,
            "batch_size": int(ref.shape[0])}


@dataclass(frozen=True)
class PositionConvention:
    """How one wired model numbers its absolute positions (found by ``rm.wire``'s probe).

    ``rule``: a key of :data:`RULES`; ``padding_idx``: the pad token id the rule skips (RoBERTa);
    ``modules``: ``(path, offset)`` of every absolute position table, indexed with
    ``position_ids + offset`` (OPT and BioGPT: 2, the others 0)."""

    rule: str
    padding_idx: int | None
    modules: tuple[tuple[str, int], ...]

    def local(self, batch, device=None) -> torch.Tensor | None:
        """This shard's ``position_ids`` [B, S/P] in the model's convention (on ``device``, default:
        the rows' own), or None when the batch brought its own (``batch.rows`` is None). Computed
        once per batch and device (cached on the CPBatch)."""
        rows = getattr(batch, "rows", None)
        if rows is None:
            return None
        key = ("positions", self.rule, self.padding_idx, str(device))
        cache = batch._cache
        if key not in cache:
            ids, mask = rows["input_ids"], rows["attention_mask"]
            here = next((t.device for t in (ids, mask) if t is not None), device)
            full = rule_positions(self.rule, ids, mask, self.padding_idx, (rows["batch_size"], batch.seq_len), here)
            mine = batch.local_positions(full.device)   # the row positions of this shard (any layout)
            out = full.index_select(1, mine).contiguous()
            cache[key] = out if device is None else out.to(device)
        return cache[key]

    def apply(self, kwargs: MutableMapping[str, Any]) -> None:
        """Replace the shard's synthesized ``position_ids`` (ringmaster's global ``arange``) with the
        model's own convention, cut for this shard. Called by the shard step, after the
        ``ringmaster_batch`` kwarg is attached; a batch with its own ``position_ids`` is left alone."""
        batch = kwargs.get(BATCH_KWARG)
        ref = next((kwargs[k] for k in ("position_ids", "input_ids", "inputs_embeds")
                    if isinstance(kwargs.get(k), torch.Tensor)), None)
        positions = self.local(batch, None if ref is None else ref.device) if batch is not None else None
        if positions is not None:
            kwargs["position_ids"] = positions

    def describe(self) -> str:
        tables = ", ".join(f"{p!r} (+{c})" if c else repr(p) for p, c in self.modules)
        pad = f", padding_idx={self.padding_idx}" if self.rule == "pad_cumsum" else ""
        return f"{self.rule}{pad}: {tables}"
