"""What a wired recurrent layer is bound to, and the checks every call of it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..sharding.carrier import StepCarrier
from ..sharding.documents import BATCH_KWARG
from .cost import HEADS, CostRecorded, LayerCost, layer_cost
from .heads import check_groups, check_heads
from .scan import KERNEL_STRATEGIES, STRATEGIES, auto_strategy


@dataclass
class Probe:
    """What a probe forward records: which replacement kernels ran, and whether they start from a
    random non-zero incoming state (conv halo, scan state) instead of zeros."""

    inject: set = field(default_factory=set)      # kernel names that get a random incoming state
    called: set = field(default_factory=set)
    seed: int = 0
    # recurrent="heads": the layer's path and the CP size its heads (the state's dim 1) are split over
    path: str = ""
    heads: int = 1
    # recurrent="auto": the CP size, and what heads and the state passing would send for this layer (cost.LayerCost)
    auto: int = 1
    cost: "LayerCost | None" = None
    # layer_costs: record the costs and stop the forward there (no kernel runs; the conv returns its input's shape)
    record_only: bool = False
    # the layer's segment pads its pieces neutrally (its ``neutral_padding``: documents.PiecesSegment); None: no
    # segment seen
    neutral: bool | None = None

    def observe(self, segment, tensors, out, heads: int, shared: dict | None = None) -> None:
        """What the wiring learns from the layer's segment (each kind's probe branch calls this once per run):
        whether it pads neutrally, and for recurrent="auto" what this layer would send under each strategy
        (:func:`~.cost.layer_cost`: ``tensors`` and ``out`` in the form heads moves them, ``shared``: index ->
        (groups, what))."""
        self.neutral = bool(getattr(segment, "neutral_padding", False))
        if self.auto > 1 and self.cost is None:
            self.cost = layer_cost(self.path, self.auto, segment, tensors, out, heads, shared)
        if self.record_only:
            raise CostRecorded(self.path)

    def shared_by(self, heads: int, groups: int, what: str) -> None:
        """recurrent="heads": an input that ``groups`` groups of the layer's ``heads`` heads share must split over
        or replicate to the CP size: refused at wire (:func:`~.heads.check_groups`)."""
        if self.heads > 1:
            check_groups(self.path, heads, groups, self.heads, what)

    def state(self, name: str, shape, dtype, device):
        self.called.add(name)
        if self.heads > 1 and name == "scan":   # a head count the CP size does not divide: refused at wire
            check_heads(self.path, "heads", tuple(shape)[1], self.heads)
        if name not in self.inject:
            return None
        g = torch.Generator().manual_seed(self.seed + len(self.called))
        return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


@dataclass
class LayerContext:
    """What a wired layer is bound to when it is wired: its path, CP group, state-passing strategy and
    its model's step carrier. The per-step layout and documents come only from the step context: the
    ``ringmaster_batch`` of the call, else the carrier the shard step set (nothing is read from a
    process global), checked against the group here."""

    path: str
    group: Any = None
    strategy: str = "auto"
    # the model's step carrier (ringmaster.sharding.carrier), for a layer called without the kwarg
    carrier: StepCarrier = field(default_factory=StepCarrier, repr=False)
    # set only while ``wire`` probes the layer (:func:`ringmaster.intercept.probe_layer`)
    probe: "Probe | None" = field(default=None, repr=False)
    # recurrent="auto" asked: heads for this layer on the rows where it sends no more than the state passing
    # (``cost``, recorded by wire's probe; without it the state passing, as before)
    auto: bool = False
    cost: LayerCost | None = None
    # the layer's segment pads its pieces neutrally (wire's probe: Probe.neutral); None: not probed, or no segment
    neutral_padding: bool | None = None

    def __post_init__(self):
        if self.strategy not in ("auto", *STRATEGIES, *KERNEL_STRATEGIES):
            raise ValueError(f"{self.path}: recurrent strategy {self.strategy!r}: use 'auto' or one of "
                             f"{STRATEGIES + KERNEL_STRATEGIES}")

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def take_batch(self, kwargs: dict):
        """The ``ringmaster_batch`` of this call, removed from ``kwargs`` (the kernels never see it):
        the kwarg itself when the layer got it, else the step carrier's."""
        return self.carrier.batch(kwargs, pop=True)

    def resolve(self, batch) -> tuple[Any, int, str, str]:
        """``(group, size, layout, strategy)`` for a call that carries ``batch`` (its ``CPBatch``)."""
        size = self.size
        if batch is None:
            if size > 1:
                raise RuntimeError(
                    f"{self.path}: a recurrent layer wired for CP ran without the batch's global structure "
                    "(`ringmaster_batch`); shard batches with context_parallel_region(batch) or "
                    "ContextParallelContextManager"
                )
            return self.group, size, "contiguous", "sequential"
        if batch.assignment is not None:   # a documents batch: by_parts runs its two parts, never the whole
            raise NotImplementedError(
                f"{self.path}: load_balance='documents' is not wired for this recurrent layer's kernel yet; use "
                "load_balance='auto'")
        if batch.size == 1 and getattr(batch, "is_part", False):   # a documents batch's whole documents: no collective
            return None, 1, "contiguous", "sequential"
        if batch.size != size or (size > 1 and batch.rank != dist.get_rank(self.group)):
            raise RuntimeError(
                f"{self.path}: the batch was cut for rank {batch.rank} of {batch.size}, but this layer is wired "
                f"to a CP group of {size} ranks (this rank: {dist.get_rank(self.group) if size > 1 else 0}); "
                "shard with the runtime this model was wired with"
            )
        strategy = self.strategy if self.strategy != "auto" else auto_strategy(size)
        if self.heads_up_to and strategy in STRATEGIES and batch.heads_rows(self.heads_up_to):
            strategy = HEADS
        return self.group, size, batch.layout, strategy

    def _fallback(self) -> str:
        return self.strategy if self.strategy in STRATEGIES else auto_strategy(self.size)

    @property
    def heads_up_to(self) -> int:
        """``auto``: the longest row this layer runs head-parallel (0: never), fixed at wire; the batch says, once per
        step on the host, whether its rows are that short (``CPBatch.heads_rows``: a compiled block reads a bool, not
        the row length, so a new length is no new graph)."""
        if not self.auto or self.cost is None:
            return 0
        return self.cost.heads_up_to(self._fallback())

    def choice(self) -> str | None:
        """What ``auto`` picks for this layer (None: ``auto`` was not asked)."""
        if not self.auto:
            return None
        return self._fallback() if self.cost is None else self.cost.describe(self._fallback())


def wired_kernel(namespace: dict, name: str, facts: Callable[[Callable], dict]) -> Callable[[], tuple[Callable, dict]]:
    """``current()`` -> ``(kernel, keywords)``: the kernel ``name`` resolves to in ``namespace`` when called (one
    swapped in later is used), and ``facts(kernel)`` (keywords saying what the kernel supports), decided once, now,
    for the kernel the name resolves to at wire: given only while that kernel is the one called, so nothing
    inspects a kernel in forward and a kernel swapped in later gets none."""
    wired = namespace.get(name)
    known = facts(wired) if wired is not None else {}

    def current() -> tuple[Callable, dict]:
        kernel = namespace[name]
        return kernel, (known if kernel is wired else {})
    return current


def check_call_kwargs(path: str, kwargs: dict) -> None:
    """Refuse packing metadata that describes the *local* shard or the full row in kernel terms
    (``cu_seqlens``/``seq_idx``): under CP the document structure comes from the global document
    ids of the ``ringmaster_batch`` kwarg (see :class:`DocumentSegment`); these would be ambiguous."""
    for key in ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{path}: {key} reached the recurrent kernel under CP; pass packed rows through "
                "context_parallel_region / ContextParallelContextManager (position_ids restarting per document, "
                "or cu_seq_lens in the full batch), which carry the global document boundaries to every layer"
            )


def call_guard(ctx: LayerContext) -> Callable[[tuple, dict], None]:
    """Checks before every forward of a wired layer ``forward(hidden_states, cache, attention_mask)``:
    no cache under CP (training runs use_cache=False), and a padding mask cut like the shard."""
    def guard(args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
        if cache is not None and ctx.size > 1:
            raise RuntimeError(f"{ctx.path}: the model was called with a cache under CP; "
                               "run it with use_cache=False in training")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if isinstance(mask, torch.Tensor) and isinstance(hidden, torch.Tensor) and mask.dim() == 2 \
                and mask.shape[-1] != hidden.shape[1]:
            raise ValueError(f"{ctx.path}: the padding mask has {mask.shape[-1]} positions but the shard has "
                             f"{hidden.shape[1]}; shard the attention_mask with the batch")
    return guard


def decode_only_without_cp(ctx: LayerContext, namespace: dict, name: str):
    """Cached single-token decoding kernels: the original at CP size 1, refused under CP."""
    def call(*args, **kwargs):
        if ctx.size > 1:
            raise RuntimeError(f"{ctx.path}: {name} (cached decoding) is not supported under CP; "
                               "run the model with use_cache=False")
        return namespace[name](*args, **kwargs)
    return call


def drop_local_segments(ctx: LayerContext, kwargs: dict, key: str = "segments") -> None:
    """axolotl's packed-row documents (``PackedSegments``, from the *shard's* position_ids: a document
    continuing from the previous shard looks like a new one) are dropped from ``kwargs`` under
    ringmaster (CP, or a ``ringmaster_batch``): the CP kernels reset at the batch's *global* document
    starts instead. Refuses a shard with several local documents but no global document ids (they would
    disagree). Without ringmaster, axolotl's own per-document path stays."""
    segments = kwargs.get(key)
    batch = ctx.carrier.batch(kwargs)
    if segments is None or (batch is None and ctx.size == 1 and ctx.probe is None):
        return
    seq_idx = getattr(segments, "seq_idx", None)
    several = seq_idx is not None and seq_idx.shape[-1] > 1 and bool((seq_idx[:, 1:] != seq_idx[:, :-1]).any())
    if several and getattr(batch, "doc_ids", None) is None:
        raise RuntimeError(f"{ctx.path}: axolotl found several documents in this shard's position_ids, but the "
                           "ringmaster_batch carries no document ids; shard packed rows with "
                           "context_parallel_region / ContextParallelContextManager on the full batch")
    kwargs.pop(key)
