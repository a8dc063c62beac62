"""Per-token attention sinks under CP (Inkling2).

gpt-oss has one sink logit per head (``module.sinks`` / ``s_aux``). Inkling2 computes one per *query
token*: ``sinks = sink_proj(hidden_states)`` ``[B, H, q, 1]``, passed to the attention interface as the
``sinks`` kwarg; its eager kernel appends it as one extra zero-value column of every query row's softmax.
A sink depends on its query only, so it travels with the queries:

* :func:`take` (called by :mod:`.layer_rules` before any collective) moves a 4-D ``sinks`` kwarg to
  :data:`KWARG` as ``[B, H, q]`` rows of this shard;
* Ulysses all-to-alls them with q (``[B, H/P, S]``) and hands them to the model's eager kernel as ``sinks``;
* Ring keeps them local (queries never move) and merges them once into each row's normaliser
  (:func:`ringmaster.attention.ring.merge.merge_sink`; the backward returns ``-p_sink * (dout . out)``
  per row, :func:`~ringmaster.attention.ring.merge.sink_grad`).
"""

from __future__ import annotations

import torch

KWARG = "token_sinks"   # the CP attention's kwarg carrying [B, H, q] per-token sink logits to the backends


def take(query: torch.Tensor, kwargs: dict, where: str) -> None:
    """Move a per-token ``sinks`` kwarg ``[B, H, q, 1]`` to ``kwargs[KWARG]`` ``[B, H, q]``; refuse another
    shape (a per-token sink for other rows than this call's queries)."""
    sinks = kwargs.get("sinks")
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 4:
        return
    if tuple(sinks.shape) != (*query.shape[:3], 1):
        raise NotImplementedError(
            f"{where}: per-token attention sinks of shape {tuple(sinks.shape)} for queries {tuple(query.shape)}; "
            "ringmaster CP carries sinks [B, H, q, 1] with their queries only. Use a CP size of 1")
    kwargs[KWARG] = kwargs.pop("sinks")[..., 0]
