"""Structured block masks: what a query block may see of one K/V block, without a dense [Sq, Sk] mask.

A ring block's mask is always one of a few shapes: everything visible, a band of diagonals
(causal diagonal blocks, sliding-window blocks), either of those cut by documents (packed rows),
or, for tests and generic callers, an arbitrary bool tensor. Keeping the structure lets each
provider use its kernel's own masking (flash ``is_causal`` / ``window_size`` / ``cu_seqlens``)
and build a dense mask only per tile of query rows (O(tile * Sk), never O(Sq * Sk) in fp32).

Coordinates are local to the block: query row ``i`` in ``[0, sq)``, key column ``j`` in ``[0, sk)``.
The band keeps ``lo <= i - j <= hi`` (``None`` = unbounded on that side); documents keep
``q_docs[b, i] == k_docs[b, j]`` (ids non-decreasing along a row, as packing writes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BlockMask:
    sq: int
    sk: int
    lo: int | None = None
    hi: int | None = None
    q_docs: torch.Tensor | None = field(default=None, compare=False)   # [B, sq]
    k_docs: torch.Tensor | None = field(default=None, compare=False)   # [B, sk]
    dense: torch.Tensor | None = field(default=None, compare=False)    # bool [sq, sk] or [B, 1, sq, sk]
    # ALiBi (bloom, mpt): score bias slopes[h] * (k_pos - q_pos), global positions k_pos - q_pos = offset + j - i
    alibi_slopes: torch.Tensor | None = field(default=None, compare=False)  # [H] of the block's query heads
    alibi_offset: int = 0
    # a per-query relative position bias (Inkling): ``rel_logits [B, H, sq, E]`` are the block's query rows'
    # bias-vs-distance profiles; the score of (i, j) gets ``rel_logits[.., i, d]`` for the global distance
    # ``d = q_pos - k_pos = rel_offset + i - j`` when ``0 <= d < E``, else nothing
    rel_logits: torch.Tensor | None = field(default=None, compare=False)
    rel_offset: int = 0
    # the host copy of the documents (``sharding.documents.Runs``) and the global positions of the block's
    # first query and first key: segments and tile skips are decided from these, never from q_docs' values
    runs: object | None = field(default=None, compare=False)
    q_start: int = 0
    k_start: int = 0
    # documents planned statically (compiled steps): a tile the band shows is computed with its document mask
    # from q_docs / k_docs on the device, never skipped by documents; the host copy may then be absent
    static_docs: bool = False

    def __post_init__(self):
        check_documents(self.q_docs, self.runs, self.static_docs, "BlockMask")

    # ---- what kind of block this is
    @property
    def full(self) -> bool:
        return self.lo is None and self.hi is None and self.q_docs is None and self.dense is None

    def bias(self, r0: int, r1: int, k0: int, k1: int, device, dtype) -> torch.Tensor | None:
        """The additive score bias of that tile, ALiBi ``[1, H, t, k]`` and/or the relative bias ``[B, H, t, k]``
        (``None`` without either): a tile's worth, never the block's."""
        out = None
        if self.alibi_slopes is not None:
            d = (self.alibi_offset + torch.arange(k0, k1, device=device)[None, :]
                 - torch.arange(r0, r1, device=device)[:, None]).to(dtype)
            out = self.alibi_slopes.to(device=device, dtype=dtype).view(1, -1, 1, 1) * d
        if self.rel_logits is not None:
            rel = self.rel_logits[..., r0:r1, :].to(device=device, dtype=dtype)
            index, keep = self.rel_index(r0, r1, k0, k1, device)
            rel = rel.gather(-1, index.expand(*rel.shape[:2], -1, -1)) * keep.to(dtype)
            out = rel if out is None else out + rel
        return out

    def rel_index(self, r0: int, r1: int, k0: int, k1: int, device):
        """``(index, keep)`` ``[1, 1, t, k]``: the distance column of ``rel_logits`` each score of the tile
        reads (clamped) and whether that distance is inside ``[0, E)``."""
        extent = self.rel_logits.shape[-1]
        d = (self.rel_offset + torch.arange(r0, r1, device=device)[:, None]
             - torch.arange(k0, k1, device=device)[None, :])
        keep = (d >= 0) & (d < extent)
        return d.clamp(0, extent - 1)[None, None], keep[None, None]

    @property
    def has_docs(self) -> bool:
        return self.q_docs is not None

    @property
    def is_band(self) -> bool:
        """Only a band (no documents, no arbitrary mask): expressible as one flash call."""
        return self.q_docs is None and self.dense is None

    @property
    def causal_square(self) -> bool:
        """The diagonal block of a causal sequence: ``j <= i`` on a square block."""
        return self.is_band and self.sq == self.sk and self.lo == 0 and self.hi is None

    def region(self, r0: int = 0, r1: int | None = None):
        """``(q0, q1, k0, k1)``: the rows of ``[r0, r1)`` that see a key through the band (documents
        aside) and the keys they see; ``None`` when the band hides everything."""
        return _trim(r0, self.sq if r1 is None else r1, 0, self.sk, self.lo, self.hi)

    # ---- dense pieces (a tile at a time)
    def tile(self, r0: int, r1: int, k0: int, k1: int, device) -> torch.Tensor | None:
        """bool ``[1 or B, 1, r1-r0, k1-k0]`` (True = attend) for that tile; ``None`` when all visible."""
        m = None
        if self.lo is not None or self.hi is not None:
            d = torch.arange(r0, r1, device=device)[:, None] - torch.arange(k0, k1, device=device)[None, :]
            m = torch.ones_like(d, dtype=torch.bool)
            if self.lo is not None:
                m &= d >= self.lo
            if self.hi is not None:
                m &= d <= self.hi
            m = m.view(1, 1, r1 - r0, k1 - k0)
        if self.q_docs is not None:
            same = (self.q_docs[:, r0:r1, None].to(device) == self.k_docs[:, None, k0:k1].to(device)).unsqueeze(1)
            m = same if m is None else m & same
        if self.dense is not None:
            dm = self.dense.to(device)
            dm = (dm.view(1, 1, *dm.shape) if dm.dim() == 2 else dm)[..., r0:r1, k0:k1]
            m = dm if m is None else m & dm
        return m

    def to_dense(self, device) -> torch.Tensor | None:
        """The whole block's bool mask (the math reference kernel and tests only)."""
        return self.tile(0, self.sq, 0, self.sk, device)

    # ---- documents as flash segments
    def segments(self) -> list[tuple[int, int, int, int, int]]:
        """``(b, q0, q1, k0, k1)`` per document present in both the query and the key block, each
        trimmed to the rows and keys its band reaches, so every listed row sees at least one key.
        From the host runs (no device read): a flash-style kernel cuts documents on the host, so its plan carries
        them even when compiled (``attention/ring/hf.py``)."""
        assert self.q_docs is not None and self.dense is None
        if self.runs is None:
            raise RuntimeError("a document block cut into flash calls needs the batch's host runs (BlockMask.runs); "
                               "a static plan without them runs only through the tile kernels (math, aten on CPU)")
        return self._host_segments(0, self.sq, 0, self.sk)

    def _host_segments(self, r0: int, r1: int, k0: int, k1: int) -> list[tuple[int, int, int, int, int]]:
        """:meth:`segments` of the tile ``[r0, r1) x [k0, k1)`` from the host runs (no device read)."""
        out = []
        runs, qs, ks = self.runs, self.q_start, self.k_start
        for b in range(self.q_docs.shape[0]):
            kspans = {i: (s - ks, e - ks) for i, s, e in runs.spans(b, ks + k0, ks + k1)}
            for i, s, e in runs.spans(b, qs + r0, qs + r1):
                if i in kspans:
                    seg = _trim(s - qs, e - qs, *kspans[i], self.lo, self.hi)
                    if seg is not None:
                        out.append((b, *seg))
        return out

    def visibility(self, r0: int, r1: int, k0: int, k1: int) -> str | None:
        """``"none"``, ``"all"`` or ``"some"`` of the tile's (row, key) pairs are visible, decided on the host
        (band and host runs); ``None`` when only the mask's values can tell (an arbitrary dense mask)."""
        if self.dense is not None:
            return None
        if _trim(r0, r1, k0, k1, self.lo, self.hi) is None:
            return "none"
        if self.q_docs is not None and self.static_docs:   # static documents: the tile mask decides per row
            return "some"
        band_all = (self.lo is None or r0 - (k1 - 1) >= self.lo) and (self.hi is None or (r1 - 1) - k0 <= self.hi)
        if self.q_docs is None:
            return "all" if band_all else "some"
        segs = self._host_segments(r0, r1, k0, k1)
        if not segs:
            return "none"
        rows = self.q_docs.shape[0]
        one_doc = all(len(self.runs.spans(b, self.q_start + r0, self.q_start + r1)) == 1 for b in range(rows)) \
            and len(segs) == rows and all(s[1:] == (r0, r1, k0, k1) for s in segs)
        return "all" if band_all and one_doc else "some"


def check_documents(docs, runs, static_docs: bool, what: str) -> None:
    """Document ids come with their host copy (``sharding.documents.Runs``, the step context's ``CPBatch.runs``),
    or are planned statically (``static_docs``: every pair and tile computed under its mask from the ids on the
    device). Nothing reads the document structure back from the ids' values. The one check of every ring plan
    (:class:`BlockMask`, ``loop.RingPlan``, ``distflash.DistFlashPlan``)."""
    if docs is not None and runs is None and not static_docs:
        raise ValueError(f"{what}: document ids without their host runs; pass runs= (the batch's CPBatch.runs; "
                         "Runs.from_doc_ids(ids) where a test builds the ids itself) or static_docs=True")


def _trim(q0, q1, k0, k1, lo, hi):
    """The rows of ``[q0, q1)`` that see a key of ``[k0, k1)`` through ``lo <= i - j <= hi`` and the
    keys those rows see; ``None`` when nothing is visible."""
    if lo is not None and hi is not None and lo > hi:
        return None
    r0 = q0 if lo is None else max(q0, k0 + lo)
    r1 = q1 if hi is None else min(q1, k1 + hi)
    if r0 >= r1:
        return None
    c0 = k0 if hi is None else max(k0, r0 - hi)
    c1 = k1 if lo is None else min(k1, r1 - lo)
    if c0 >= c1:
        return None
    return r0, r1, c0, c1


def flash_window(q0: int, q1: int, k0: int, k1: int, lo, hi) -> tuple[int | None, int | None]:
    """``(window_left, window_right)`` that make a flash kernel (causal/window aligned bottom-right)
    keep exactly ``lo <= i - j <= hi`` on the region ``[q0, q1) x [k0, k1)``; ``None`` = unbounded.

    Flash keeps ``-right <= i' - j' + (Sk' - Sq') <= left`` in region coordinates; a trimmed region's
    last row sees its last key, so both bounds come out >= 0."""
    shift = q1 - k1          # i - j = (i' - j') + (q0 - k0); Sk' - Sq' = (k1 - k0) - (q1 - q0)
    left = None if hi is None else hi - shift
    right = None if lo is None else shift - lo
    sq, sk = q1 - q0, k1 - k0
    if left is not None and left >= sk - 1:
        left = None
    if right is not None and right >= sq - 1:
        right = None
    assert (left is None or left >= 0) and (right is None or right >= 0), (q0, q1, k0, k1, lo, hi)
    return left, right


def as_block_mask(mask, sq: int, sk: int) -> BlockMask:
    """Accept the block kernels' mask forms: ``None``, ``"causal"`` (square, top-left), a bool tensor,
    or a :class:`BlockMask`."""
    if isinstance(mask, BlockMask):
        return mask
    if mask is None:
        return BlockMask(sq, sk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown block mask {mask!r}")
        if sq != sk:
            raise ValueError(f"a 'causal' block must be square, got {sq}x{sk}; pass BlockMask(lo=..., hi=...)")
        return BlockMask(sq, sk, lo=0)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return BlockMask(sq, sk, dense=mask)
    raise ValueError(f"block mask must be None, 'causal', a bool tensor or a BlockMask, got {type(mask).__name__}")


def flash_calls(m: BlockMask):
    """How flash kernels (causal/window aligned bottom-right, ``cu_seqlens`` for documents) cover a
    band or document block, as a list of calls:

    * ``("dense", (q0, q1, k0, k1), (left, right))``: one batched call on that region;
    * ``("varlen", segments, (left, right))``: one varlen call over those documents (segments as
      :meth:`BlockMask.segments`), one call per distinct window among the block's documents.

    An empty list: nothing visible. Arbitrary dense masks are not flash-shaped (``ValueError``)."""
    if m.dense is not None or m.alibi_slopes is not None or m.rel_logits is not None:
        raise ValueError("an arbitrary dense block mask (or an ALiBi / relative bias) has no flash form here")
    if m.is_band:
        region = m.region()
        return [] if region is None else [("dense", region, flash_window(*region, m.lo, m.hi))]
    groups: dict = {}
    for seg in m.segments():
        groups.setdefault(flash_window(*seg[1:], m.lo, m.hi), []).append(seg)
    return [("varlen", segs, window) for window, segs in groups.items()]
