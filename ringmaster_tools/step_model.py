"""Step-time model: the per-layer attention time (forward + backward, slowest rank) of each CP backend.

Bytes alone do not choose a backend: a Ring hop that travels while a block computes costs nothing,
an all-to-all always costs its latency and transfer. This model replays each backend's schedule
(the order in which ``attention/ring/loop.py`` and ``attention/ulysses.py`` issue, compute and wait)
with:

* **compute**: attention FLOPs / the kernel's rate. A ``q x k`` block of ``h`` heads and head dim
  ``d`` costs ``4 * q * k * h * d`` FLOPs forward (half on the causal diagonal), ``bwd_factor`` times
  that backward (2.5 for flash-style kernels: five matmuls against two). ``Hardware.flops`` is the
  forward rate (measured: ``benchmarks/overlap.py`` times the block kernel; or given: a GPU's dense
  rate times an efficiency).
* **communication**: every p2p exchange or collective costs ``latency + bytes / bandwidth`` of the
  link it crosses (``Link``): intra-node when the group fits in ``ranks_per_node`` ranks, else
  inter-node (a ring spanning nodes moves at its slowest hop). Latency is charged once per call
  (what ``ringmaster_tools.latency.inject_latency`` injects).
* **overlap**: a p2p hop issued before a block's compute and waited after it costs
  ``max(0, hop - compute)``; collectives are synchronous (nothing hides them).

Bytes per call are the ones ``planning.alternative`` predicts and ``rm.profile_comms`` measures.
The model is checked against CPU gloo runs with injected latency (``benchmarks/overlap.py``, the
"model" column, within 25%); it has not yet been checked against a GPU step.

``auto_select_modelled`` is the selector with the model: the split with the smallest predicted
time among those today's rule would accept on heads (``u`` divides the query and KV heads). With no
link figures (``links=None``) it returns ``config.auto_select``'s choice unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringmaster.config import auto_select


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes/s, per rank, one direction) and latency (s per call)."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """The kernel's forward FLOP rate per rank, its backward/forward cost ratio, and the links."""

    flops: float
    intra: Link
    inter: Link | None = None           # None: one node (or inter == intra)
    ranks_per_node: int | None = None   # None: every rank in one node
    bwd_factor: float = 2.5

    def link(self, span: int) -> Link:
        """The link a group of ``span`` consecutive ranks moves at (its slowest hop)."""
        node = self.ranks_per_node or span
        return self.intra if span <= node or self.inter is None else self.inter


@dataclass(frozen=True)
class Shape:
    """One attention layer: query heads, KV heads, head dim, sequence, batch, bytes per element."""

    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    batch: int = 1
    dtype_bytes: int = 2


@dataclass
class Prediction:
    name: str
    ulysses: int
    ring: int
    rotate: str | None
    compute: float        # s, forward + backward, slowest rank
    comm: float           # s, every call's latency + transfer, as if none overlapped
    total: float          # s, with the overlap the schedule allows
    calls: int            # p2p exchanges + collectives per step

    @property
    def no_overlap(self) -> float:
        return self.compute + self.comm

    @property
    def hidden(self) -> float:
        """Fraction of the communication time the schedule hides."""
        return 0.0 if self.comm <= 0 else max(0.0, 1.0 - (self.total - self.compute) / self.comm)


def _unit(shape: Shape, heads: int, chunk: int, hw: Hardware) -> float:
    """Forward seconds of one full ``chunk x chunk`` block of ``heads`` query heads."""
    return 4.0 * shape.batch * heads * chunk * chunk * shape.head_dim / hw.flops


def _ring_steps(layout: str, r: int, unit: float) -> tuple[float, list[float], float]:
    """(own-block early part, per-step compute of steps 1..r-1, own-block late part), forward units
    of the slowest rank. head_tail: every step is two full pairs, the own block one full pair (early)
    and two causal diagonals (late). contiguous: the last rank, own diagonal (late) and one full block
    per step."""
    if layout == "head_tail":
        return unit, [2 * unit] * (r - 1), unit
    return 0.0, [unit] * (r - 1), unit / 2


def _ring_time(early: float, steps: list[float], late: float, hop_kv: float, hop_dkv: float,
               bwd: float) -> tuple[float, float]:
    """(forward, backward) seconds of the p2p ring schedule of ``loop.py`` for one rank whose
    neighbours run the same schedule (a hop issued at ``t`` arrives at ``t + hop``)."""
    r = len(steps) + 1
    now, arrive = 0.0, None
    for s, comp in enumerate([early + late] + steps):   # forward: the own block first, whole
        arrive = now + hop_kv if s < r - 1 else None
        now += comp
        if arrive is not None:
            now = max(now, arrive)
    fwd = now
    now = 0.0
    arrive_kv = hop_kv if r > 1 else None
    now += early * bwd
    arrive_dkv = None
    for s, comp in enumerate(steps, start=1):
        now = max(now, arrive_kv)
        arrive_kv = now + hop_kv if s < r - 1 else None
        now += comp * bwd
        if arrive_dkv is not None:
            now = max(now, arrive_dkv)
        arrive_dkv = now + hop_dkv
    now += late * bwd
    if arrive_dkv is not None:
        now = max(now, arrive_dkv)
    return fwd, now


def predict(shape: Shape, hw: Hardware, ulysses: int, ring: int, rotate: str = "alltoall",
            layout: str | None = None) -> Prediction | None:
    """The modelled step of a ``ulysses x ring`` split (``None`` when the heads do not split)."""
    u, r = ulysses, ring
    P = u * r
    if shape.seq % P or shape.heads % u or (shape.kv_heads % u and u % shape.kv_heads):
        return None
    kv_u = shape.kv_heads if shape.kv_heads % u == 0 else u
    heads, kv_heads = shape.heads // u, kv_u // u
    B, d, e = shape.batch, shape.head_dim, shape.dtype_bytes
    n = shape.seq // P                      # tokens per rank
    compute = comm = total = 0.0
    calls = 0
    if u > 1:
        link = hw.link(u)
        a2a_qkv = link.time((heads * u + 2 * kv_u) * d * n * B * e * (u - 1) / u)
        a2a_out = link.time(heads * u * d * n * B * e * (u - 1) / u)
        ulysses_comm = 2 * (a2a_qkv + a2a_out)   # forward: q|k|v in, out back; backward: the adjoints
        comm += ulysses_comm
        total += ulysses_comm
        calls += 4
    span = shape.seq // r                   # tokens per ring rank (Ulysses: the whole sequence)
    if r == 1:
        flops_fwd = 4.0 * B * heads * d * span * (span + 1) / 2 / hw.flops
        compute = flops_fwd * (1 + hw.bwd_factor)
        total += compute
        name = "ulysses"
    else:
        layout = layout or ("head_tail" if u == 1 and span % 2 == 0 else "contiguous")
        chunk = span // 2 if layout == "head_tail" else span
        unit = _unit(shape, heads, chunk, hw)
        early, steps, late = _ring_steps(layout, r, unit)
        link = hw.link(P)
        kv_block = 2 * kv_heads * d * span * B * e
        kv_fp32 = kv_block / e * 4
        step_fwd = early + late + sum(steps)
        compute += step_fwd * (1 + hw.bwd_factor)
        if rotate == "allgather":
            gather, scatter = link.time((r - 1) * kv_block), link.time((r - 1) * kv_fp32)
            comm += gather + scatter
            total += compute + gather + scatter
            calls += 2
        else:
            hop_kv, hop_dkv = link.time(kv_block), link.time(kv_fp32)
            fwd, bwd = _ring_time(early, steps, late, hop_kv, hop_dkv, hw.bwd_factor)
            comm += 2 * (r - 1) * hop_kv + (r - 1) * hop_dkv
            total += fwd + bwd
            calls += 3 * (r - 1)
        name = f"ring {'p2p' if rotate == 'alltoall' else rotate}" if u == 1 else f"usp {u}x{r}"
    return Prediction(name, u, r, None if r == 1 else rotate, compute, comm, total, calls)


def step_cost(shape: Shape, hw: Hardware):
    """``(u, r) -> seconds`` (``None`` when the split does not apply) for ``config.auto_select(cost=)``."""
    def cost(u: int, r: int) -> float | None:
        p = predict(shape, hw, u, r)
        return None if p is None else p.total

    return cost


def auto_select_modelled(shape: Shape, world: int, hw: Hardware | None = None,
                         ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(ulysses_size, ring_size)``: today's rule without link figures, the fastest predicted split with."""
    return auto_select(shape.heads, shape.kv_heads, world, ranks_per_node,
                       cost=None if hw is None else step_cost(shape, hw))


# -- load_balance="documents" ---------------------------------------------------------------------------------

def _per_rank(lens: list[int], hidden: int, shape: Shape, hw: Hardware, ulysses: int, ring: int) -> list[float]:
    """Forward + backward compute of each rank of a static layout on a packed row of documents ``lens`` (see
    :func:`predict_documents`); per ring rank (its Ulysses group's ranks share it equally)."""
    import torch

    S, P = sum(lens), ulysses * ring
    if S == 0:
        return [0.0] * ring
    k = (1 + hw.bwd_factor) / hw.flops
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lens])     # position inside its document
    attn_row = 4.0 * shape.batch * shape.heads * shape.head_dim * (pos + 1)    # a query's causal row, forward
    linear = 24.0 * hidden * hidden * S / P
    if ring == 1:
        return [k * (float(attn_row.sum()) / P + linear)]
    from ringmaster.sharding.balancers import shard_positions

    layout = "head_tail" if S % (2 * ring) == 0 else "contiguous"
    return [k * (float(attn_row[shard_positions(S, ring, r, layout)].sum()) / ulysses + linear) for r in range(ring)]


def documents_cost(hidden: int, shape: Shape, hw: Hardware, ulysses: int, ring: int):
    """The :class:`~ringmaster.sharding.assignment.Cost` a documents assignment balances by on ``hw``: attention's
    quadratic weight for ``hidden`` (``4 h`` FLOPs per key against ``24 h^2`` per token), and ``comm`` = the modelled communication time of one split token (the
    step model's collective time for the row, per token) over a token's linear-layer time (``24 h^2`` FLOPs
    forward, ``1 + bwd_factor`` with the backward)."""
    from ringmaster.sharding.assignment import Cost

    p = predict(shape, hw, ulysses, ring)
    per_token_comm = 0.0 if p is None else (p.total - p.compute) / (shape.seq / (ulysses * ring))
    per_token_linear = 24.0 * hidden * hidden * (1 + hw.bwd_factor) / hw.flops
    return Cost(quadratic=1.0 / (6 * hidden), comm=per_token_comm / per_token_linear)


def predict_documents(lens: list[int], hidden: int, shape: Shape, hw: Hardware, ulysses: int, ring: int,
                      threshold: int | None = None):
    """Modelled per-layer step (forward + backward, slowest rank) of the static layout and of ``documents`` for
    one packed row of documents ``lens`` at ``P = ulysses x ring`` ranks: ``(static s, documents s,
    assignment)``.

    Assumes: attention FLOPs only inside documents (the kernels skip masked tiles) and a transformer layer's
    linear FLOPs ``24 h^2`` per token forward, the backward ``bwd_factor`` times the forward; the static
    layout's per-rank compute: Ulysses a 1/P share of the row's (heads split), Ring (and USP's ring) the causal
    rows of the queries its ``head_tail`` shard holds, the slowest rank; its communication the step model's for
    the row (:func:`predict` on ``S`` tokens, overlap included); ``documents``: per rank its
    share of the split documents (cut like the static layout: the same rule on the split sub-row) plus its whole
    documents (the slowest rank), and the split sub-row's
    communication from the same model on its ``L`` tokens. The threshold (unless given) is the candidate of
    :func:`~ringmaster.sharding.assignment.candidate_thresholds` this model predicts fastest, the whole documents
    balanced with :func:`documents_cost`."""
    from ringmaster.sharding.assignment import candidate_thresholds, plan_documents
    from ringmaster.sharding.documents import Runs

    P = ulysses * ring
    S = sum(lens)
    starts, t = [], 0
    for n in lens:
        starts.append(t)
        t += n
    k = (1 + hw.bwd_factor) / hw.flops
    heads, d = shape.heads, shape.head_dim

    def work(n: int) -> float:
        return k * (4.0 * shape.batch * heads * d * n * (n + 1) / 2 + 24.0 * hidden * hidden * n)

    row = predict(Shape(heads, shape.kv_heads, d, S, shape.batch, shape.dtype_bytes), hw, ulysses, ring)
    static = max(_per_rank(lens, hidden, shape, hw, ulysses, ring)) + (row.total - row.compute)
    cost = documents_cost(hidden, Shape(heads, shape.kv_heads, d, S, shape.batch, shape.dtype_bytes), hw, ulysses,
                          ring)
    layout = "contiguous" if ulysses > 1 or S % (2 * P) else "head_tail"
    runs = Runs(S, (tuple(starts),))

    def modelled(a) -> float:
        split = _per_rank([e - s for s, e in a.split], hidden, shape, hw, ulysses, ring)   # per ring rank
        slowest = max(split[(r // ulysses) % len(split)] + sum(work(e - s) for s, e in a.whole[r]) for r in range(P))
        comm = 0.0
        if a.split_len:
            part = predict(Shape(heads, shape.kv_heads, d, a.split_len, shape.batch, shape.dtype_bytes), hw,
                           ulysses, ring)
            comm = 0.0 if part is None else part.total - part.compute
        return slowest + comm

    if threshold is not None:
        a = plan_documents(runs, S, P, layout, threshold, cost, heads_split=ring == 1)
        return static, modelled(a), a
    # the threshold the step model itself predicts fastest, among the assignment's candidates
    best = None
    for t in candidate_thresholds(list(zip(starts, (*starts[1:], S))), S, P):
        a = plan_documents(runs, S, P, layout, t, cost, heads_split=ring == 1)
        m = modelled(a)
        if best is None or m < best[0] - 1e-12:
            best = (m, a)
    return static, best[0], best[1]