"""CP-correct, token-weighted loss.

Convention: every rank's loss is ``sum of its token losses / (global tokens / P)``, so the
mean over the CP group (what DDP/FSDP2 gradient averaging computes) is the single-device
token-mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import all_reduce_sum
from .batch import IGNORE_INDEX


def cp_num_items(global_num_items, cp_size: int) -> torch.Tensor:
    """The ``num_items_in_batch`` each rank passes to HF's loss: global tokens / P."""
    return torch.as_tensor(global_num_items, dtype=torch.float32) / cp_size


def chunked_nll(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, num_items,
                chunk_size: int = 1024, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``shift_labels``, ``chunk_size`` tokens at a
    time with recomputation, so full-vocabulary logits never exist for the whole shard at once.
    Returns the summed token loss divided by ``num_items``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        def piece(hc, yc):
            return F.cross_entropy((hc @ weight.T).float(), yc, ignore_index=ignore_index, reduction="sum")

        hc, yc = h[start:start + chunk_size], y[start:start + chunk_size]
        total = total + torch.utils.checkpoint.checkpoint(piece, hc, yc, use_reentrant=False)
    return total / torch.as_tensor(num_items, dtype=torch.float32, device=total.device)


def reduce_mean(value: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of a scalar over the CP group (for logging; not differentiable), reduced on the group's
    device and returned on ``value``'s."""
    return all_reduce_sum(value, group, tag="reduce_mean") / dist.get_world_size(group)
