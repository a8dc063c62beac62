"""Simulated slow links for benchmarks and tests: every p2p exchange or collective costs ``X`` ms more.

    from ringmaster_tools.latency import inject_latency
    with inject_latency(p2p_ms=5, collective_ms=5) as links:   # on every rank
        out = attention(q, k, v); out.sum().backward()
    links.p2p_ops, links.collective_ops                        # how many were delayed on this rank

**What a delay means.** A p2p exchange returns at once, as before, and completes no earlier than ``X``
after it was *issued*: ``torch.distributed.batch_isend_irecv``'s requests in their ``wait()``, and a
functional ``all_to_all_single`` (how the ring and distflash issue their hops: ``comm.start_exchange``,
in flight until waited for) in its ``wait_tensor``. That is a link's latency: a caller that issues a
hop, computes, and only then waits sees ``max(0, X - compute)``, a caller that waits at once sees
``X``. A collective (``all_to_all_single``, ``all_gather_into_tensor`` / ``all_gather_single``,
``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``all_reduce``) is synchronous in ringmaster,
so it runs and then sleeps ``X``. Results are unchanged: the data moves through the real gloo/NCCL
call; only completion is held back.

**Why here, and this way.** Production code is untouched and reads no flag: the context manager
swaps the public entry points of the ``torch.distributed`` module for its duration and restores
them (tests and benchmarks only; ``import ringmaster`` never imports this module). A wrapping
``ProcessGroup`` was the other candidate, but torch 2.13's C++ ``Backend`` has no Python
constructor and a Python ``ProcessGroup`` subclass is unknown to c10d's group maps, so
``get_global_rank`` / ``P2POp`` refuse it. ``isend`` / ``irecv`` themselves are not swapped:
``P2POp`` checks its op by identity, so the delay sits on ``batch_isend_irecv``. Calls made through
``torch.distributed`` attribute lookup (ringmaster's ``dist.all_to_all_single(...)``) see the delay;
a library that imported a function by name before the block does not. Functional collectives are
not module functions to swap: a dispatch mode (public ``TorchDispatchMode``) sees their ops
(``_c10d_functional.all_to_all_single`` issues, ``_c10d_functional.wait_tensor`` completes), whoever
called them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

P2P = ("batch_isend_irecv",)
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_reduce")


class DelayedWork:
    """A request whose ``wait()`` returns no earlier than ``ready_at`` (``time.perf_counter`` seconds);
    its first ``wait()`` is logged in ``links.events`` as ``("wait", call)``."""

    def __init__(self, inner, ready_at: float, links: "Links | None" = None, call: int = -1, delay: float = 0.0):
        self.inner, self.ready_at, self.links, self.call, self.delay = inner, ready_at, links, call, delay

    def wait(self, *args, **kwargs):
        if self.links is not None:
            self.links.log("wait", self.call)
        entered = time.perf_counter()
        if self.links is not None:  # the part of the latency window the caller did not fill with work
            self.links.exposed_s += max(0.0, min(self.ready_at - entered, self.delay))
        result = self.inner.wait(*args, **kwargs)
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return result

    def is_completed(self) -> bool:
        return self.inner.is_completed() and time.perf_counter() >= self.ready_at

    def __getattr__(self, name):  # result(), exception(), get_future(), ... of the real request
        return getattr(self.inner, name)


@dataclasses.dataclass
class Links:
    """What the block injected on this rank: the delays and how many calls received one."""

    p2p_s: float
    collective_s: float
    p2p_ops: int = 0
    collective_ops: int = 0
    # injected latency not covered by work: per call, the part of [issue, issue + X] after its first
    # wait() began (a collective: all of X). Peer lag does not count, only this rank's schedule does.
    exposed_s: float = 0.0
    issued_at: list = dataclasses.field(default_factory=list)  # (perf_counter, op name) per delayed call
    # the order of what happened: ("issue", call), ("wait", call) (first wait of a p2p call's requests),
    # and whatever a test logs itself (``log("compute", ...)`` from a wrapped kernel): overlap evidence
    # that does not depend on a quiet machine
    events: list = dataclasses.field(default_factory=list)
    _waited: set = dataclasses.field(default_factory=set, repr=False)

    def log(self, kind: str, what=None) -> None:
        if kind == "wait":
            if what in self._waited:
                return
            self._waited.add(what)
        self.events.append((kind, what))

    def reset(self) -> None:
        self.p2p_ops = self.collective_ops = 0
        self.exposed_s = 0.0
        self.issued_at.clear()
        self.events.clear()
        self._waited.clear()

    def hops_without_compute(self, compute: str = "compute") -> list[int]:
        """The p2p calls with no ``compute`` event between their issue and their first wait."""
        bare, open_calls = [], {}
        for kind, what in self.events:
            if kind == "issue":
                open_calls[what] = False
            elif kind == compute:
                for call in open_calls:
                    open_calls[call] = True
            elif kind == "wait" and what in open_calls:
                if not open_calls.pop(what):
                    bare.append(what)
        return bare


class _FunctionalHops(TorchDispatchMode):
    """Delays functional all-to-alls as p2p exchanges: the op is issued at once, and the ``wait_tensor`` of
    its result returns no earlier than ``X`` after the issue (what :class:`DelayedWork` does for requests)."""

    def __init__(self, links: Links):
        super().__init__()
        self.links = links
        self.in_flight: dict[int, tuple] = {}   # id(result) -> (result, DelayedWork stand-in)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            issued = time.perf_counter()
            out = func(*args, **kwargs)
            links = self.links
            links.p2p_ops += 1
            call = len(links.issued_at)
            links.issued_at.append((issued, "all_to_all_single"))
            links.log("issue", call)
            self.in_flight[id(out)] = (out, issued + links.p2p_s, call)
            return out
        if func is torch.ops._c10d_functional.wait_tensor.default and id(args[0]) in self.in_flight:
            _, ready_at, call = self.in_flight.pop(id(args[0]))
            links = self.links
            return DelayedWork(_Wait(func, args, kwargs), ready_at, links, call, links.p2p_s).wait()
        return func(*args, **kwargs)


class _Wait:
    """A functional hop's ``wait_tensor`` as the request :class:`DelayedWork` wraps."""

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs

    def wait(self):
        return self.func(*self.args, **self.kwargs)


_LOCK = threading.Lock()
_ACTIVE: list[Links] = []


def _p2p(fn, links: Links):
    @functools.wraps(fn)
    def delayed(*args, **kwargs):
        issued = time.perf_counter()
        works = fn(*args, **kwargs)
        links.p2p_ops += 1
        call = len(links.issued_at)
        links.issued_at.append((issued, fn.__name__))
        links.log("issue", call)
        return [DelayedWork(w, issued + links.p2p_s, links, call, links.p2p_s) for w in works]

    return delayed


def _collective(fn, links: Links):
    @functools.wraps(fn)
    def delayed(*args, **kwargs):
        issued = time.perf_counter()
        result = fn(*args, **kwargs)
        links.collective_ops += 1
        links.issued_at.append((issued, fn.__name__))
        if kwargs.get("async_op"):
            return DelayedWork(result, issued + links.collective_s, links, -1, links.collective_s)
        left = issued + links.collective_s - time.perf_counter()
        if left > 0:
            time.sleep(left)
        links.exposed_s += links.collective_s
        return result

    return delayed


@contextlib.contextmanager
def inject_latency(p2p_ms: float = 0.0, collective_ms: float = 0.0):
    """Delay every p2p exchange by ``p2p_ms`` and every collective by ``collective_ms`` inside the block
    (this process only: enter it on every rank). Yields a :class:`Links` that counts the delayed calls.
    Not reentrant: a nested block raises (two layers of delay would measure neither)."""
    if p2p_ms < 0 or collective_ms < 0:
        raise ValueError(f"inject_latency(p2p_ms={p2p_ms}, collective_ms={collective_ms}): delays must be >= 0")
    links = Links(p2p_ms / 1e3, collective_ms / 1e3)
    with _LOCK:
        if _ACTIVE:
            raise RuntimeError("inject_latency is already active in this process; leave the outer block first")
        _ACTIVE.append(links)
    saved = {}
    try:
        for name in P2P + COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            saved[name] = fn
            setattr(dist, name, (_p2p if name in P2P else _collective)(fn, links))  # counts even at 0 ms
        with _FunctionalHops(links):
            yield links
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        with _LOCK:
            _ACTIVE.remove(links)
