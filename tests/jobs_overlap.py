"""Rank-side jobs of tests/test_overlap.py: the p2p ring under injected link latency."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringmaster.attention.ring import loop
from ringmaster.attention.ring.kernels import get_kernel
from ringmaster.config import RingImpl
from ringmaster_tools.latency import inject_latency


class TimedKernel:
    """The math block kernel, logging each call into the latency injector's event list and (for the
    wall-time check) standing in for a slower kernel by sleeping ``compute_s`` per call: a sleep needs
    no CPU, so the overlap shows on a loaded machine too."""

    def __init__(self, compute_s: float = 0.0):
        self.inner, self.compute_s, self.links = get_kernel(RingImpl.MATH), compute_s, None

    def check(self, *args, **kwargs):
        return self.inner.check(*args, **kwargs)

    def _call(self, fn, *args, **kwargs):
        if self.links is not None:
            self.links.log("compute")
        if self.compute_s:
            time.sleep(self.compute_s)
        return fn(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self._call(self.inner.forward, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._call(self.inner.backward, *args, **kwargs)


def _inputs(P, r, S, H, Hkv, D):
    g = torch.Generator().manual_seed(0)  # the full sequence, the same on every rank
    q, k, v, dout = (torch.randn(1, h, S, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    plan = loop.RingPlan("head_tail", P, r, S // (2 * P))
    idx = torch.cat([torch.arange(c * plan.chunk, (c + 1) * plan.chunk) for c in plan.chunks(r)])
    return (q, k, v, dout), plan, idx


def _step(group, plan, kernel, local, dout):
    leaves = [t.clone().requires_grad_(True) for t in local]
    start = time.perf_counter()
    out = loop.ring_attention(*leaves, group, plan, kernel, rotate="alltoall")
    (out * dout).sum().backward()
    return time.perf_counter() - start, out.detach(), [t.grad for t in leaves]


def ring_under_latency(ctx, P, latency_ms, compute_ms=0.0, reps=1, S=32, H=4, Hkv=2, D=8):
    """One p2p ring step without and with ``latency_ms`` on every hop (best of ``reps`` each): the
    times, hop counts, the hops with no compute between issue and wait, whether the delayed run's
    output and gradients equal the undelayed ones bit for bit, and the error against dense attention."""
    group = ctx.mesh(P)["cp"].get_group()
    r = dist.get_rank(group)
    (q, k, v, dout), plan, idx = _inputs(P, r, S, H, Hkv, D)
    local = [t[..., idx, :] for t in (q, k, v)]
    kernel = TimedKernel(compute_ms / 1e3)
    base = []
    for _ in range(reps):
        dist.barrier(group=group)
        base.append(_step(group, plan, kernel, local, dout[..., idx, :]))
    delayed = []
    for _ in range(reps):
        dist.barrier(group=group)
        with inject_latency(p2p_ms=latency_ms, collective_ms=latency_ms) as links:
            kernel.links = links
            delayed.append(_step(group, plan, kernel, local, dout[..., idx, :]))
            kernel.links = None
        events = list(links.events)
        calls = links.p2p_ops
        hidden = 1 - links.exposed_s / (calls * latency_ms / 1e3)
        bare = links.hops_without_compute()
    # one exchange waited at once costs the whole latency
    buf = torch.ones(4)
    with inject_latency(p2p_ms=latency_ms) as links:
        ring = loop._Ring(group)
        t0 = time.perf_counter()
        got = ring.wait(ring.start(buf * r, "forward", "probe"))
        sync_hop = time.perf_counter() - t0
    # dense reference on the whole sequence
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    (ref * dout).sum().backward()
    _, out, grads = delayed[-1]
    err = max([(out - ref.detach()[..., idx, :]).abs().max().item()]
              + [(g - t.grad[..., idx, :]).abs().max().item() for g, t in zip(grads, leaves)])
    same = torch.equal(out, base[-1][1]) and all(torch.equal(a, b) for a, b in zip(grads, base[-1][2]))
    return dict(t0=min(b[0] for b in base), t=min(d[0] for d in delayed), calls=calls, bare=bare, hidden=hidden,
                events=events, same=same, err=err, sync_hop=sync_hop,
                probe_ok=bool(torch.equal(got, torch.ones(4) * ((r - 1) % P))))


class SyncRing(loop._Ring):
    """Mutation: every hop is waited for as soon as it is issued (no prefetch, no overlap)."""

    def start(self, tensor, phase, tag, channel=0):
        recv, works, meta = super().start(tensor, phase, tag, channel)
        self.wait((recv, works, meta))
        return recv, [], meta  # already complete: the loop's own wait has nothing left to wait for


def ring_without_prefetch(ctx, P, latency_ms):
    original = loop._Ring
    loop._Ring = SyncRing
    try:
        return ring_under_latency(ctx, P, latency_ms)
    finally:
        loop._Ring = original
