"""The one per-model carrier of the step context, for the modules the ``ringmaster_batch`` kwarg cannot reach.

The step context (a :class:`~.documents.CPBatch`) travels as the ``ringmaster_batch`` kwarg: transformers
passes unknown kwargs from the model down to its decoder layers and on to the attention and
linear-attention layers, and a checkpoint captures it with the layer's call. Some modules never get it:

- an attention module whose decoder layer calls it with a fixed argument list (stablelm, nemotron:
  :mod:`ringmaster.attention.bridge` finds them in the source);
- an attention module that computes attention itself (a self-attention site, :mod:`ringmaster.attention.selfattn`);
- a recurrent layer called without kwargs by its decoder layer (gated DeltaNet in qwen3.5) or inside a
  block that gets no kwargs at all (Mamba's, RWKV's blocks).

Those read one :class:`StepCarrier`, created when the model is wired (:func:`attach`) and bound then to
each of them (``LayerContext.carrier``, a site's closure, a bridged attention's pre-hook); nothing reads
a process global, walks frames or copies the batch from hook to hook. Its life is the shard step's:

- **set** by the shard step, with the same ``CPBatch`` it puts in the kwarg: ``context_parallel_region``
  on enter (the carriers of ``model``, else of the runtime: :attr:`Runtime.carriers`), the
  ``ContextParallelContextManager``'s pre-hook (the hooked model's carrier);
- **cleared** when the step ends: region exit, the manager's post-hook (``always_call``);
- **replayed** by activation-checkpoint recomputation, which runs in backward after the clear, possibly
  after another forward: the step arms the model's checkpoint functions (:mod:`ringmaster.checkpointing`),
  which carry each checkpoint's value from its forward to its recomputation.

A layer gets the kwarg when its call carries it (:meth:`StepCarrier.batch`), else the carrier's value; a
CP layer that finds neither raises (never a stale batch). Two models wired in one process have a carrier
each, so a policy and a reference model never see each other's step.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

import torch

from .. import checkpointing
from .documents import BATCH_KWARG, CPBatch

_ATTR = "_ringmaster_carrier"


class StepCarrier:
    """The step context (``CPBatch``) of the forward in flight, for one wired model."""

    def __init__(self, model=None):
        self.current: CPBatch | None = None
        self.forks = 0   # forwards of this step run under a forked random state (sharding.rng): their index
        self._model = weakref.ref(model) if model is not None else None

    def batch(self, kwargs: dict | None = None, pop: bool = False) -> CPBatch | None:
        """The call's ``ringmaster_batch`` when it carries one (removed from ``kwargs`` with ``pop``),
        else the step's."""
        if kwargs is not None:
            found = kwargs.pop(BATCH_KWARG, None) if pop else kwargs.get(BATCH_KWARG)
            if found is not None:
                return found
        return self.current

    def set(self, batch: CPBatch | None) -> CPBatch | None:
        """Hold ``batch`` for the forward that starts now; returns the value it replaces. With grad on,
        the model's checkpoint functions are armed first, so a recomputation gets this forward's batch."""
        model = self._model() if self._model is not None else None
        if model is not None and torch.is_grad_enabled():
            checkpointing.arm(model, self)
        previous, self.current = self.current, batch
        self.forks = 0
        return previous

    def clear(self, previous: CPBatch | None = None) -> None:
        """End the step: back to ``previous`` (what :meth:`set` returned; None outside any step)."""
        self.current = previous

    def detach(self) -> None:
        """Unbind from the model: its checkpoint functions put back, nothing held."""
        model = self._model() if self._model is not None else None
        if model is not None:
            checkpointing.disarm(model, self)
        self.current = None


def carrier_of(model) -> StepCarrier | None:
    """The carrier ``model`` was wired with (looked through DDP-style ``.module`` wrappers), or None."""
    while model is not None:
        found = getattr(model, "__dict__", {}).get(_ATTR)
        if found is not None:
            return found
        if hasattr(model, "config") or not hasattr(model, "module"):
            return None
        model = model.module
    return None


def attach(model, runtime=None) -> tuple[StepCarrier, Any]:
    """The model's carrier, created (and registered with ``runtime``, whose region sets it) if it has none.
    Returns ``(carrier, undo)``; the undo detaches it only if this call created it."""
    found = carrier_of(model)
    if found is not None:
        return found, lambda: None
    carrier = StepCarrier(model)
    model.__dict__[_ATTR] = carrier
    carriers = getattr(runtime, "carriers", None)
    if carriers is not None:
        carriers.append(carrier)

    def undo() -> None:
        carrier.detach()
        if model.__dict__.get(_ATTR) is carrier:
            del model.__dict__[_ATTR]
        if carriers is not None and any(c is carrier for c in carriers):
            carriers[:] = [c for c in carriers if c is not carrier]

    return carrier, undo


@contextlib.contextmanager
def holding(carriers: Iterable[StepCarrier], batch: CPBatch):
    """Set every carrier of ``carriers`` to ``batch`` for the block; clear them after it."""
    carriers = list(carriers)
    previous = [c.set(batch) for c in carriers]
    try:
        yield
    finally:
        for c, p in zip(carriers, previous):
            c.clear(p)
