"""FlexAttention masks for the whole sequence, from the batch's global structure.

HF's ``flex_attention_forward`` uses a ``BlockMask`` passed as ``attention_mask`` directly,
but *adds* any other tensor mask to the scores (a bool mask becomes +1/0, which masks
nothing), and given no mask at all it applies no causal mask either. So a CP flex call must
always get a ``BlockMask``, also for plain causal rows.

The mask has exactly the semantics of :meth:`ringmaster.sharding.documents.CPBatch.dense_mask`
(causal ``q >= k``; a window keeps ``q - k < window`` when causal, ``|q - k| < window``
otherwise; tokens attend only within their document id), expressed as a ``mask_mod``. The
block tables are computed per tile from the tile's position and document ranges, so nothing
of size S x S is ever built: ``O(B * (S / 128)^2)`` booleans plus the ``[B, S]`` doc ids.
A tile is *full* only when every pair in it is allowed (the kernel then skips the mask_mod),
*partial* when some pair may be allowed (the kernel applies the mask_mod per element), and
skipped only when no pair can be allowed.
"""

from __future__ import annotations

import torch


def _tile_ranges(S: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last real index of every tile of ``block`` positions."""
    n = -(-S // block)
    first = torch.arange(n, device=device) * block
    last = torch.clamp(first + block - 1, max=S - 1)
    return first, last


def _position_tiles(S: int, block: int, causal: bool, window, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, all)`` ``[nQ, nK]``: some / every (q, k) pair of a tile passes the position rule."""
    first, last = _tile_ranges(S, block, device)
    d_min = first[:, None] - last[None, :]  # smallest q - k in the tile
    d_max = last[:, None] - first[None, :]  # largest q - k in the tile (every value between occurs)
    if causal:
        lo, hi = 0, (window - 1 if window is not None else None)
    elif window is not None:
        lo, hi = -(window - 1), window - 1
    else:
        lo, hi = None, None
    any_ok = torch.ones_like(d_min, dtype=torch.bool)
    all_ok = torch.ones_like(d_min, dtype=torch.bool)
    if lo is not None:
        any_ok &= d_max >= lo
        all_ok &= d_min >= lo
    if hi is not None:
        any_ok &= d_min <= hi
        all_ok &= d_max <= hi
    return any_ok, all_ok


def _doc_tiles(docs: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any, all)`` ``[B, nQ, nK]``: some pair of a tile may share a document / every pair does."""
    B, S = docs.shape
    n = -(-S // block)
    padded = torch.cat([docs, docs[:, -1:].expand(B, n * block - S)], dim=1).view(B, n, block)
    lo, hi = padded.amin(-1), padded.amax(-1)  # edge padding leaves each tile's range unchanged
    any_ok = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])  # ranges overlap
    single = lo == hi
    all_ok = single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    return any_ok, all_ok


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[B, H, nQ, nK]`` tiles -> (count, indices with the selected tiles first), int32."""
    count = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, idx


def _mask_mod(S: int, padded_len: int, causal: bool, window, docs: torch.Tensor | None):
    per_row = False  # every cell the closure reads is bound (torch.compile refuses an empty cell)
    if docs is not None:
        # indices past S can reach the mask_mod inside a partial last tile: pad, never index out of range
        docs = torch.cat([docs, docs.new_full((docs.shape[0], padded_len - S), -1)], dim=1)
        per_row = docs.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        if causal:
            ok = d >= 0
            if window is not None:
                ok = ok & (d < window)
        elif window is not None:
            ok = d.abs() < window
        else:
            ok = d == d
        if docs is not None:
            row = docs[b] if per_row else docs[0]
            ok = ok & (row[q_idx] == row[kv_idx])
        return ok

    return mask_mod


def build_block_mask(seq_len: int, causal: bool, window, docs: torch.Tensor | None, device,
                     block_size: int | None = None):
    """A ``BlockMask`` over ``seq_len`` tokens: B = ``docs.shape[0]`` (1, broadcast, without docs)."""
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE
    from torch.nn.attention.flex_attention import BlockMask

    BLOCK = block_size or _DEFAULT_SPARSE_BLOCK_SIZE

    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    any_ok, all_ok = _position_tiles(seq_len, BLOCK, causal, window, device)
    any_ok, all_ok = any_ok[None], all_ok[None]  # [B, nQ, nK]
    if docs is not None:
        docs = docs.to(device)
        doc_any, doc_all = _doc_tiles(docs, BLOCK)
        any_ok, all_ok = any_ok & doc_any, all_ok & doc_all
    full = all_ok[:, None]  # [B, H=1, nQ, nK]
    partial = (any_ok & ~all_ok)[:, None]
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    n = any_ok.shape[-1]
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
        mask_mod=_mask_mod(seq_len, n * BLOCK, causal, window, docs), seq_lengths=(seq_len, seq_len),
    )


def block_mask(cpb, causal: bool, window, device):
    """The whole sequence's ``BlockMask`` for this forward, built once and shared by every layer."""
    key = ("flex_block_mask", causal, window, str(device))
    if key not in cpb._cache:
        cpb._cache[key] = build_block_mask(cpb.seq_len, causal, window, cpb.docs_on(device), device)
    return cpb._cache[key]

