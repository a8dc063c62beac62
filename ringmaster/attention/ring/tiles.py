"""Query-row tiles of a masked block: each tile's region and its dense mask, O(tile * Sk).

Kernels that take a dense mask (aten's CPU flash op, memory-efficient attention's bias) call
themselves once per tile, so no block-sized ``[Sq, Sk]`` mask is ever built. A tile first shrinks
to the rows and keys the band reaches; a tile that sees everything runs without a mask, a tile
that sees nothing is skipped (its rows keep ``lse = -inf``).
"""

from __future__ import annotations

import torch

from .masks import BlockMask

TILE_ROWS = 128  # query rows per dense-mask tile: temporaries are O(TILE_ROWS * Sk)


def tiles(mask: BlockMask, device, tile_rows: int = TILE_ROWS):
    """Yield ``(r0, r1, k0, k1, bool_mask_or_None)`` covering every visible (row, key) pair of ``mask``."""
    region = mask.region()
    if region is None:
        return
    q0, q1, _, _ = region
    for start in range(q0, q1, tile_rows):
        sub = mask.region(start, min(q1, start + tile_rows))
        if sub is None:
            continue
        r0, r1, k0, k1 = sub
        seen = mask.visibility(r0, r1, k0, k1)   # from the host copy of the documents: no device read
        if seen == "none":
            continue
        m = None if seen == "all" else mask.tile(r0, r1, k0, k1, device)
        if seen is None and m is not None and m.device.type != "meta":  # an arbitrary mask: only values tell
            if not bool(m.any()):
                continue
            if bool(m.all()):
                m = None
        yield r0, r1, k0, k1, m


def additive(mask: torch.Tensor, dtype, pad_to: int = 1) -> torch.Tensor:
    """A bool tile as an additive bias (0 / -inf) in ``dtype``; the last dim's storage padded to a
    multiple of ``pad_to`` (memory-efficient attention wants 16-aligned bias rows), then sliced."""
    n = mask.shape[-1]
    width = -(-n // pad_to) * pad_to
    bias = torch.zeros(*mask.shape[:-1], width, dtype=dtype, device=mask.device)[..., :n]
    return bias.masked_fill_(~mask, float("-inf"))


def rows_seen(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``[1|B, 1, t]``: whether each row of a tile sees any key (``None``: all do)."""
    return None if mask is None else mask.any(-1)
