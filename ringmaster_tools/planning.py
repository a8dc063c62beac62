"""Closed-form cost of each CP alternative, per rank and per attention layer.

The byte counts are what ``rm.profile_comms`` measures (bytes a rank puts on the wire; the
share an all-to-all keeps locally is not counted); the tests check them against gloo runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringmaster.config import auto_select
from .step_model import Hardware, Shape, predict, step_cost


@dataclass
class Alternative:
    name: str
    ulysses: int
    ring: int
    rotate: str | None
    fwd_bytes: float
    bwd_bytes: float
    kv_resident_bytes: float   # K/V held at once per rank per layer during attention
    valid: bool = True
    why: str = ""


def _kv_heads_after_replication(kv_heads: int, u: int) -> int | None:
    if kv_heads % u == 0:
        return kv_heads
    if u % kv_heads == 0:
        return u
    return None


def alternative(heads: int, kv_heads: int, head_dim: int, seq: int, ulysses: int, ring: int, rotate: str = "alltoall",
                batch: int = 1, dtype_bytes: int = 4, name: str | None = None) -> Alternative:
    """Bytes sent per rank per layer (forward, backward) and resident K/V for a u x r split."""
    u, r = ulysses, ring
    P = u * r
    label = name or ("ulysses" if r == 1 else f"ring {'p2p' if rotate == 'alltoall' else rotate}" if u == 1
                     else f"usp {u}x{r} ({'p2p' if rotate == 'alltoall' else rotate})")
    if seq % P:
        return Alternative(label, u, r, rotate, 0, 0, 0, False, f"seq {seq} not divisible by {P}")
    if heads % u:
        return Alternative(label, u, r, rotate, 0, 0, 0, False, f"{heads} heads not divisible by ulysses {u}")
    kv_u = _kv_heads_after_replication(kv_heads, u)
    if kv_u is None:
        return Alternative(label, u, r, rotate, 0, 0, 0, False, f"{kv_heads} KV heads cannot split over {u}")
    n = seq // P
    fwd = bwd = 0.0
    if u > 1:
        a2a = (2 * heads + 2 * kv_u) * head_dim * n * batch * dtype_bytes * (u - 1) / u
        fwd += a2a
        bwd += a2a
    span = seq // r
    kv_block = 2 * (kv_u // u) * head_dim * span * batch * dtype_bytes
    kv_block_fp32 = kv_block / dtype_bytes * 4
    if r > 1:
        fwd += (r - 1) * kv_block
        if rotate == "allgather":
            bwd += (r - 1) * kv_block_fp32
        else:
            bwd += (r - 1) * kv_block + (r - 1) * kv_block_fp32  # dK/dV: P-1 hops, the owner's share stays home
    if r == 1:
        resident = kv_block
    elif rotate == "allgather":
        resident = r * kv_block
    else:
        resident = 2 * kv_block  # the block being used and the one in flight
    return Alternative(label, u, r, rotate if r > 1 else None, fwd, bwd, resident)


def alternatives(heads: int, kv_heads: int, head_dim: int, seq: int, world: int, batch: int = 1,
                 dtype_bytes: int = 4) -> list[Alternative]:
    out = [alternative(heads, kv_heads, head_dim, seq, world, 1, batch=batch, dtype_bytes=dtype_bytes)]
    for rotate in ("alltoall", "allgather"):
        out.append(alternative(heads, kv_heads, head_dim, seq, 1, world, rotate, batch, dtype_bytes))
    for u in range(2, world):
        if world % u == 0:
            out.append(alternative(heads, kv_heads, head_dim, seq, u, world // u, "alltoall", batch, dtype_bytes))
    return out


def plan_table(heads: int, kv_heads: int, world: int, ranks_per_node: int, seq: int, hidden: int, layers: int,
               batch: int = 1, dtype_bytes: int = 2, hardware: Hardware | None = None) -> str:
    """The alternatives' bytes and resident K/V; with ``hardware`` (link figures and the kernel's
    FLOP rate) also each one's modelled step time (``step_model``), and auto_select picks by it."""
    head_dim = hidden // heads
    shape = Shape(heads, kv_heads, head_dim, seq, batch, dtype_bytes)
    cost = None if hardware is None else step_cost(shape, hardware)
    u, r = auto_select(heads, kv_heads, world, ranks_per_node, cost=cost)
    chosen = alternative(heads, kv_heads, head_dim, seq, u, r, batch=batch, dtype_bytes=dtype_bytes)
    gib = 2 ** 30
    lines = [
        f"model: {heads} heads, {kv_heads} KV heads, head_dim {head_dim}, hidden {hidden}, {layers} layers; "
        f"seq {seq}, batch {batch}, {dtype_bytes}-byte activations",
        f"cluster: {world} ranks, {ranks_per_node} per node ({-(-world // ranks_per_node)} nodes)",
        f"auto_select -> ulysses_size={u} x ring_size={r}  ({chosen.name}; "
        f"{'by the step-time model' if cost else 'by heads and node size: give link figures for the model'})",
        f"activation per rank per layer (hidden states in + out of attention): "
        f"{2 * seq // world * hidden * batch * dtype_bytes / 2**20:.1f} MiB",
        "",
        f"{'alternative':<22} {'fwd MiB/layer':>13} {'bwd MiB/layer':>13} {'K/V resident MiB':>16} "
        f"{'model GiB/step':>14}" + (f" {'step ms/layer':>13} {'hidden':>6}" if cost else "") + "  note",
    ]
    for alt in alternatives(heads, kv_heads, head_dim, seq, world, batch, dtype_bytes):
        mark = " <- chosen" if (alt.ulysses, alt.ring, alt.rotate in (None, "alltoall")) == (u, r, True) else ""
        if not alt.valid:
            lines.append(f"{alt.name:<22} {'-':>13} {'-':>13} {'-':>16} {'-':>14}  invalid: {alt.why}")
            continue
        where = "" if alt.ulysses <= ranks_per_node else "  (Ulysses crosses nodes)"
        timing = ""
        if cost:
            pred = predict(shape, hardware, alt.ulysses, alt.ring, alt.rotate or "alltoall")
            timing = f" {pred.total * 1e3:>13.3f} {pred.hidden:>6.0%}" if pred else f" {'-':>13} {'-':>6}"
        lines.append(f"{alt.name:<22} {alt.fwd_bytes / 2**20:>13.1f} {alt.bwd_bytes / 2**20:>13.1f} "
                     f"{alt.kv_resident_bytes / 2**20:>16.1f} {(alt.fwd_bytes + alt.bwd_bytes) * layers / gib:>14.2f}"
                     f"{timing}{mark}{where}")
    return "\n".join(lines)


def document_lengths(spec: str, seq: int, seed: int = 0) -> list[int]:
    """``--documents`` of ``ringmaster plan``: ``"512,512,8000"`` (lengths; the last one padded up to ``seq``) or
    ``"lognormal:MU,SIGMA"`` (lengths drawn until ``seq`` tokens are filled, at least 16 each)."""
    import torch

    if spec.startswith("lognormal:"):
        mu, sigma = (float(x) for x in spec.split(":", 1)[1].split(","))
        g = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while True:
            n = int(torch.empty(1).log_normal_(mu, sigma, generator=g).clamp(16, seq))
            if sum(out) + n + 16 > seq:
                out.append(seq - sum(out))
                return out
            out.append(n)
    lens = [int(x) for x in spec.split(",") if x.strip()]
    if sum(lens) > seq or min(lens, default=0) < 1:
        raise ValueError(f"--documents {spec!r}: lengths must be >= 1 and add up to at most --seq {seq}")
    if sum(lens) < seq:
        lens.append(seq - sum(lens))
    return lens


def documents_table(lens: list[int], world: int, heads: int, kv_heads: int, hidden: int, hardware=None,
                    ranks_per_node: int = 8, dtype_bytes: int = 2) -> str:
    """What ``load_balance="documents"`` does with one packed row of documents ``lens`` at ``world`` ranks, per
    backend: the threshold the cost model chooses, the tokens that travel, the balance, and (with link figures)
    the modelled step against the static layout (:func:`ringmaster_tools.step_model.predict_documents`)."""
    from ringmaster.config import auto_select
    from ringmaster.sharding.assignment import Cost, plan_documents
    from ringmaster.sharding.documents import Runs
    from ringmaster_tools.step_model import Shape, predict_documents

    S = sum(lens)
    starts, t = [], 0
    for n in lens:
        starts.append(t)
        t += n
    u, r = auto_select(heads, kv_heads, world, ranks_per_node)
    splits = [("ulysses", world, 1)] if heads % world == 0 and (kv_heads % world == 0 or world % kv_heads == 0) else []
    splits += [("ring", 1, world)] + ([(f"usp {u}x{r}", u, r)] if u > 1 and r > 1 else [])
    lines = [f"documents: {len(lens)} in {S} tokens (longest {max(lens)}, median {sorted(lens)[len(lens) // 2]}), "
             f"{world} ranks", "",
             "| backend | threshold | split tokens | work max/mean | static s/layer | documents s/layer | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, uu, rr in splits:
        shape = Shape(heads, kv_heads, hidden // heads, S, 1, dtype_bytes)
        if hardware is not None:
            static, docs, a = predict_documents(lens, hidden, shape, hardware, uu, rr)
            times = f"{static:.4f} | {docs:.4f} | {docs / static:.2f}"
        else:
            layout = "head_tail" if uu == 1 and S % (2 * world) == 0 else "contiguous"
            a = plan_documents(Runs(S, (tuple(starts),)), S, world, layout, None, Cost.for_model(hidden),
                               heads_split=rr == 1)
            times = "- | - | - (pass --tflops and --intra-gbps for the step model)"
        lines.append(f"| {name} | {a.threshold} | {a.split_fraction:.0%} | {a.work_max_over_mean:.3f} | {times} |")
    return "\n".join(lines)