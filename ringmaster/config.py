"""User-facing configuration: what CP degree, which backend, which layout.

Every enum field also accepts its string value (``backend="ulysses"``), so YAML configs and
the axolotl plugin can pass strings straight through. ``resolve()`` turns the config into a frozen
:class:`RingmasterPlan` with every ``AUTO`` field decided, once the model's KV-head count and the topology
are known; the config itself is never changed by ringmaster (``normalize()``: see there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:  # "ulysses", not "Backend.ULYSSES", in messages
        return self.value


class _AutoType:
    """Sentinel for "let ringmaster choose"; ``rm.AUTO``."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self):
        return (_AutoType, ())


AUTO = _AutoType()


class Backend(_StrEnum):
    AUTO = "auto"
    ULYSSES = "ulysses"
    RING = "ring"
    USP = "usp"


class RotateMethod(_StrEnum):
    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value.lower() == "p2p":
            return cls.ALLTOALL
        return None


class LoadBalance(_StrEnum):
    AUTO = "auto"
    NONE = "none"
    HEAD_TAIL = "head_tail"
    DISTFLASH = "distflash"
    DOCUMENTS = "documents"   # length-aware: short documents whole on one rank, long ones split (per batch)


class RingImpl(_StrEnum):
    """The ring block kernel. ``ATEN``: torch's fused ops (flash / memory-efficient on CUDA, the CPU
    flash op); ``TORCH_NATIVE`` is its former name, accepted and run by the same kernel
    (``resolve_ring_impl`` maps it to ``ATEN``). ``HF_KERNELS``: the hub flash kernels.
    ``MATH``: the dense reference, only when asked for."""

    AUTO = "auto"
    MATH = "math"
    ATEN = "aten"
    TORCH_NATIVE = "torch_native"
    HF_KERNELS = "hf_kernels"


# fla_cp: gated DeltaNet / KDA only; heads: the kinds that offer it (RecurrentKind.strategies)
RECURRENT_CHOICES = ("auto", "scan", "sequential", "fla_cp", "heads")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def auto_select(num_heads: int | None, num_kv_heads: int | None, world: int,
                ranks_per_node: int | None = None, cost=None) -> tuple[int, int]:
    """Return ``(ulysses_size, ring_size)`` with product ``world``.

    Rule without a cost (``cost=None``, what ``normalize`` uses unless given one): Ulysses is the
    cheaper collective on fast intra-node links but every rank must hold whole KV heads, so take the
    largest Ulysses degree that divides ``world``, fits in a node and divides both the query and the
    KV head counts (no KV replication); the rest of the group becomes Ring, which has no head cap.
    Unknown head counts only cap by the node.

    With ``cost`` (``(u, r) -> predicted seconds or None``, e.g. ``ringmaster_tools.step_model.step_cost`` built from
    link figures and the kernel's FLOP rate): among the degrees that divide ``world`` and both head
    counts, the one with the smallest predicted time (ties: the larger Ulysses degree). The node cap
    is then the model's business: it charges a Ulysses group that crosses nodes the inter-node link.
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    node = ranks_per_node if ranks_per_node and ranks_per_node > 0 else world
    best, best_time = 1, None
    for u in _divisors(world):
        if u > node and cost is None:
            continue
        if num_heads is not None and num_heads % u:
            continue
        if num_kv_heads is not None and num_kv_heads % u:
            continue
        if cost is None:
            best = max(best, u)
            continue
        t = cost(u, world // u)
        if t is not None and (best_time is None or t <= best_time):
            best, best_time = u, t
    return best, world // best


def _coerce(enum_cls: type[enum.Enum], value: Any, name: str):
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"RingmasterConfig.{name}={value!r} is not one of {choices}") from None


def _degree(value: Any, name: str):
    if value is AUTO or value is None:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RingmasterConfig.{name}={value!r} must be a positive int or rm.AUTO")
    return value


def _threshold(value: Any):
    if value is AUTO or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RingmasterConfig.documents_threshold={value!r} must be a positive int (tokens), None or "
                         "rm.AUTO")
    return value


_FIELDS = ("size", "backend", "ulysses_size", "ring_size", "rotate_method", "load_balance", "ring_impl", "recurrent",
           "ranks_per_node", "validate_inputs", "documents_threshold")


def _as_dict(obj) -> dict[str, Any]:
    out = {}
    for name in _FIELDS:
        v = getattr(obj, name)
        out[name] = v.value if isinstance(v, enum.Enum) else ("auto" if v is AUTO else v)
    return out


@dataclass(frozen=True)
class RingmasterPlan:
    """A :class:`RingmasterConfig` resolved against the model and the topology: what ``rm.setup`` /
    ``rm.wire`` run by (``runtime.config``). Frozen; the field names are the config's, every ``AUTO``
    decided: ``backend`` is ulysses / ring / usp, ``ulysses_size * ring_size == size``, ``load_balance``
    none / head_tail / distflash, ``recurrent`` scan / sequential / fla_cp / heads. ``ring_impl`` may stay ``AUTO``: the
    block kernel is chosen against the inner attention kernel at setup (``resolve_ring_impl``).

    Made by :meth:`RingmasterConfig.resolve` (or ``normalize``); ``resolve`` / ``normalize`` on a plan return
    it unchanged, and ``plan.replace(load_balance="none")`` is a checked copy with other choices."""

    size: int
    backend: Backend
    ulysses_size: int
    ring_size: int
    rotate_method: RotateMethod
    load_balance: LoadBalance
    ring_impl: RingImpl
    recurrent: str
    ranks_per_node: int | _AutoType
    validate_inputs: bool
    documents_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.backend is Backend.AUTO or self.load_balance is LoadBalance.AUTO or self.recurrent == "auto" \
                or self.ulysses_size is AUTO or self.ring_size is AUTO:
            raise ValueError(f"a RingmasterPlan has every AUTO resolved, got {self!r}; make one with "
                             "RingmasterConfig(...).resolve(...)")
        if self.ulysses_size * self.ring_size != self.size:
            raise ValueError(f"ulysses_size({self.ulysses_size}) * ring_size({self.ring_size}) != size({self.size})")

    @property
    def normalized(self) -> bool:
        return True

    def resolve(self, num_kv_heads: int | None = None, intra_node_size: int | None = None,
                num_heads: int | None = None, step_cost=None) -> "RingmasterPlan":
        """Already resolved: ``self``."""
        return self

    normalize = resolve

    def replace(self, **changes) -> "RingmasterPlan":
        """A copy with ``changes`` (strings accepted), resolved and checked like the config it came from."""
        return RingmasterConfig(**{**{f: getattr(self, f) for f in _FIELDS}, **changes}).resolve()

    def as_dict(self) -> dict[str, Any]:
        return _as_dict(self)


@dataclass
class RingmasterConfig:
    """Context-parallel settings. ``size`` is the number of ranks that share one sequence.

    What the user asks for, ``AUTO`` fields included. ringmaster never changes it: ``rm.setup`` and
    ``rm.wire`` run by the :class:`RingmasterPlan` that :meth:`resolve` returns (``runtime.config``), so one
    config object can wire several models (a policy and its reference model, two CP groups) and still read
    as the user wrote it. :meth:`normalize` is the one explicit exception (see there)."""

    size: int = 1
    backend: Backend | str = Backend.AUTO
    ulysses_size: int | _AutoType = AUTO
    ring_size: int | _AutoType = AUTO
    rotate_method: RotateMethod | str = RotateMethod.ALLTOALL
    load_balance: LoadBalance | str = LoadBalance.AUTO
    ring_impl: RingImpl | str = RingImpl.AUTO
    recurrent: str = "auto"
    ranks_per_node: int | _AutoType = AUTO
    validate_inputs: bool = True
    # load_balance="documents": documents longer than this many tokens are split over the group, the rest stay
    # whole on one rank; None (or AUTO): per batch, the threshold the cost model predicts fastest
    documents_threshold: int | None = None
    _normalized: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in self._checked().items():
            setattr(self, name, value)

    def _checked(self) -> dict[str, Any]:
        """The fields, coerced and validated (fields assigned after construction, e.g. a string, too)."""
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"RingmasterConfig.size={self.size!r} must be a positive int (the CP degree)")
        if self.recurrent not in RECURRENT_CHOICES:
            raise ValueError(
                f"RingmasterConfig.recurrent={self.recurrent!r} is not one of {', '.join(map(repr, RECURRENT_CHOICES))}"
            )
        return dict(size=self.size, backend=_coerce(Backend, self.backend, "backend"),
                    ulysses_size=_degree(self.ulysses_size, "ulysses_size"),
                    ring_size=_degree(self.ring_size, "ring_size"),
                    rotate_method=_coerce(RotateMethod, self.rotate_method, "rotate_method"),
                    load_balance=_coerce(LoadBalance, self.load_balance, "load_balance"),
                    ring_impl=_coerce(RingImpl, self.ring_impl, "ring_impl"), recurrent=self.recurrent,
                    ranks_per_node=_degree(self.ranks_per_node, "ranks_per_node"),
                    validate_inputs=bool(self.validate_inputs),
                    documents_threshold=_threshold(self.documents_threshold))

    @property
    def normalized(self) -> bool:
        """Whether :meth:`normalize` resolved this object in place."""
        return self._normalized

    def resolve(self, num_kv_heads: int | None = None, intra_node_size: int | None = None,
                num_heads: int | None = None, step_cost=None) -> RingmasterPlan:
        """Resolve every ``AUTO`` field and check that the split is consistent; returns a frozen
        :class:`RingmasterPlan` and leaves this config as it is.

        ``num_kv_heads`` caps the Ulysses degree (each rank needs whole KV heads);
        ``intra_node_size`` keeps Ulysses inside a node. ``step_cost`` (``(u, r) -> seconds``,
        e.g. ``ringmaster_tools.step_model.step_cost``: the caller builds and passes it) makes an AUTO split
        the fastest predicted one (``auto_select``); without it the head/node rule decides.
        """
        c = self._checked()
        P, backend = c["size"], c["backend"]
        if c["ranks_per_node"] is not AUTO:
            intra_node_size = c["ranks_per_node"]
        u, r = c["ulysses_size"], c["ring_size"]
        if backend is Backend.ULYSSES:
            if u not in (AUTO, P) or r not in (AUTO, 1):
                raise ValueError(
                    f"backend='ulysses' needs ulysses_size=size={P} and ring_size=1, got "
                    f"ulysses_size={u!r}, ring_size={r!r}; use backend='usp' for a 2D split"
                )
            u, r = P, 1
        elif backend is Backend.RING:
            if r not in (AUTO, P) or u not in (AUTO, 1):
                raise ValueError(
                    f"backend='ring' needs ring_size=size={P} and ulysses_size=1, got "
                    f"ulysses_size={u!r}, ring_size={r!r}; use backend='usp' for a 2D split"
                )
            u, r = 1, P
        else:
            if u is AUTO and r is AUTO:
                u, r = auto_select(num_heads=num_heads, num_kv_heads=num_kv_heads, world=P,
                                   ranks_per_node=intra_node_size, cost=step_cost)
            elif u is AUTO:
                if P % r:
                    raise ValueError(f"ring_size={r} does not divide size={P}")
                u = P // r
            elif r is AUTO:
                if P % u:
                    raise ValueError(f"ulysses_size={u} does not divide size={P}")
                r = P // u
            if u * r != P:
                raise ValueError(
                    f"ulysses_size({u}) * ring_size({r}) = {u * r} != size({P}); pick degrees whose product is size"
                )
            if backend is Backend.AUTO:
                backend = Backend.ULYSSES if r == 1 else Backend.RING if u == 1 else Backend.USP
        load_balance = c["load_balance"]
        if load_balance is LoadBalance.AUTO:
            load_balance = LoadBalance.HEAD_TAIL if (r > 1 and u == 1) else LoadBalance.NONE
        recurrent = c["recurrent"]
        if recurrent == "auto":
            recurrent = "sequential" if P <= 2 else "scan"
        return RingmasterPlan(**{**c, "backend": backend, "ulysses_size": u, "ring_size": r,
                                 "load_balance": load_balance, "recurrent": recurrent})

    def normalize(self, num_kv_heads: int | None = None, intra_node_size: int | None = None,
                  num_heads: int | None = None, step_cost=None) -> RingmasterPlan:
        """:meth:`resolve`, and also write the resolved values onto this object; returns the plan.

        The one place a config changes, and only when its owner asks: ringmaster never calls it (``rm.setup``
        and ``rm.wire`` call :meth:`resolve`). It stays in place because axolotl 0.21's plugin relies on it:
        it calls ``rm_cfg.normalize(...)``, ignores the result, reads ``rm_cfg.ulysses_size`` /
        ``rm_cfg.ring_size`` / ``rm_cfg.backend.value`` afterwards, assigns ``rm_cfg.load_balance`` (its own
        balancing rule) and hands the same object to ``rm.setup``. Returning the plan, whose fields have the same
        names, also lets new code write ``cfg = cfg.normalize(...)`` and never see a mutable config again.
        """
        plan = self.resolve(num_kv_heads=num_kv_heads, intra_node_size=intra_node_size, num_heads=num_heads,
                            step_cost=step_cost)
        for name in _FIELDS:
            setattr(self, name, getattr(plan, name))
        self._normalized = True
        return plan

    def as_dict(self) -> dict[str, Any]:
        return _as_dict(self)
