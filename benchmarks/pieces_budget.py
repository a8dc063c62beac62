"""How often a compiled hybrid's chunk pieces pass their budget on realistic packings (host only, no model).

    python benchmarks/pieces_budget.py [--batches 200] [--seed 0]

A compiled block runs each chunk's documents as one padded batch of pieces (``ChunkPieces``: a slot per piece and
row, ``L`` tokens each, a power of two); past ``PIECES_BUDGET`` times the chunk's tokens the chunk is cut in Python
instead, and that packing recompiles the block. The compile benchmark's packings (``benchmarks/compile.py``: 1 to 6
documents in 64 tokens) never pass it. Here: rows of ``S`` tokens packed with documents of log-normal length (sigma
1, at least 16 tokens, the last one cut at the row's end), cut into ``P`` contiguous chunks as the static layout
does; per row, the worst rank's padded tokens over its chunk's (``n * L / m`` with ``n`` and ``L`` powers of two,
as one group padded before the groups), and the share of rows where some rank
passes the budget with one group (every piece padded to the longest) and with ``PIECE_GROUPS`` groups by length
(``ChunkPieces.of(groups=...)`` returns None; the kernels that take the length as a size run the groups:
``RecurrentWiring.piece_groups``). Beside it, what other paddings would cost: ``n`` exact (the number of pieces, at
least 2) with ``L`` a power of two, both exact, and every piece padded to its own power of two. Prints a markdown
table.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

import torch

from ringmaster.sharding.documents import PIECE_GROUPS, PIECES_BUDGET, ChunkPieces, Runs, bucket

CASES = ((32768, 4, 1024), (131072, 8, 2048), (131072, 8, 8192), (1 << 20, 32, 4096))


def packing(rng: random.Random, seq_len: int, mean: int) -> list[int]:
    """Document lengths summing to ``seq_len``: log-normal with mean ``mean`` (sigma 1), at least 16 tokens."""
    lens, total = [], 0
    while total < seq_len:
        n = min(max(16, int(rng.lognormvariate(math.log(mean) - 0.5, 1.0))), seq_len - total)
        lens.append(n)
        total += n
    return lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"| S | P | mean document | pieces per chunk | past the budget ({PIECES_BUDGET}x), one group "
          f"| {PIECE_GROUPS} groups | n*L/m (both pow2) median | p95 | n exact, L pow2 | n, L exact "
          "| each piece its own pow2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seq_len, size, mean in CASES:
        m = seq_len // size
        over, over_groups, worst, per_chunk = 0, 0, {"pow2": [], "n_exact": [], "exact": [], "own": []}, []
        for _ in range(args.batches):
            lens = packing(rng, seq_len, mean)
            docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None]
            runs = Runs.from_doc_ids(docs)
            over += any(ChunkPieces.of(runs, [r * m], m, "cpu") is None for r in range(size))
            over_groups += any(ChunkPieces.of(runs, [r * m], m, "cpu", groups=PIECE_GROUPS) is None
                               for r in range(size))
            row = {k: 0.0 for k in worst}
            for r in range(size):
                (_, cuts), = runs.pattern(r * m, (r + 1) * m)
                bounds = [0, *cuts, m]
                pieces = [b - a for a, b in zip(bounds, bounds[1:])]
                per_chunk.append(len(pieces))
                n = max(2, len(pieces))
                row["pow2"] = max(row["pow2"], max(2, bucket(len(pieces))) * bucket(max(pieces)) / m)
                row["n_exact"] = max(row["n_exact"], n * bucket(max(pieces)) / m)
                row["exact"] = max(row["exact"], n * max(pieces) / m)
                row["own"] = max(row["own"], sum(bucket(p) for p in pieces) / m)
            for k, v in row.items():
                worst[k].append(v)

        def med(k):
            return f"{statistics.median(worst[k]):.1f}"

        p95 = sorted(worst["pow2"])[int(0.95 * len(worst["pow2"]))]
        print(f"| {seq_len} | {size} | {mean} | {statistics.mean(per_chunk):.1f} | {over}/{args.batches} "
              f"| {over_groups}/{args.batches} | {med('pow2')} | {p95:.1f} | {med('n_exact')} | {med('exact')} "
              f"| {med('own')} |")


if __name__ == "__main__":
    main()
