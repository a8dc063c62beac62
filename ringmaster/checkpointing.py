"""Activation checkpointing replays each layer with the per-step state of *its own* forward.

Most CP layers get the batch's global structure (``ringmaster_batch``) as a kwarg, which a
checkpoint captures with the layer's call, so a recomputation in backward sees the same batch.
Some cannot: a layer called with a fixed argument list (Mamba's and RWKV's blocks, attention modules
that compute attention themselves, decoder layers that drop ``**kwargs`` before a recurrent mixer)
reads the batch from a *slot* a forward pre-hook filled (``LayerContext.batch``,
``attention.selfattn.BatchSlot``). A slot holds the **last** forward's batch: with two forwards
before one backward (two micro-batches summed, a pipeline schedule, a policy forward between) the
recomputation of the first would read the second's documents and layout. Measured before this
module: Mamba2 under reentrant checkpointing, gradients 87% off with no error; non-reentrant: a
``CheckpointError`` on mismatching shapes.

So the checkpoint function of every checkpointed module is wrapped, per instance, by
:class:`Replaying`: at the forward it snapshots the slots and hands the checkpoint a function that
puts that snapshot back while the layer runs (the forward and its recomputation) and restores the
slots afterwards. Two per-instance attributes hold a checkpoint function in practice:
``_gradient_checkpointing_func`` (transformers' ``GradientCheckpointingLayer``: HF
``gradient_checkpointing_enable``, reentrant or not, ``offload=True``) and ``checkpoint_fn`` (torch's
``checkpoint_wrapper``, what accelerate's FSDP activation checkpointing applies). Both are set
after ``rm.wire`` in the usual order (the Trainer enables checkpointing in ``train()``), so the
wrapping happens in a forward pre-hook of the model, idempotently, every forward; ``restore()``
puts the original functions back. A checkpoint the model does not hold (a user's own
``torch.utils.checkpoint.checkpoint(layer, ...)``) is not seen: one forward per backward is
exact there (the slot still holds that forward's batch); two are not supported.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

CHECKPOINT_ATTRS = ("_gradient_checkpointing_func", "checkpoint_fn")
_FIELDS = ("batch", "kwargs")


def _snapshot(slots) -> list[dict]:
    return [{f: getattr(s, f) for f in _FIELDS if hasattr(s, f)} for s in slots]


def _put(slots, state) -> None:
    for slot, values in zip(slots, state):
        for name, value in values.items():
            setattr(slot, name, value)


def _replayed(function, slots, state, /, *args, **kwargs):
    before = _snapshot(slots)
    _put(slots, state)
    try:
        return function(*args, **kwargs)
    finally:
        _put(slots, before)


class Replaying:
    """A module's checkpoint function, run with the slots as they were at the forward."""

    def __init__(self, inner: Callable, slots: list):
        self.inner = inner
        self.slots = list(slots)

    def __call__(self, function, /, *args, **kwargs):
        state = _snapshot(self.slots)
        return self.inner(functools.partial(_replayed, function, self.slots, state), *args, **kwargs)


class SlotReplay:
    """Keeps every checkpoint function of ``model`` wrapped for ``slots`` (objects with a ``batch``
    attribute, and optionally ``kwargs``)."""

    def __init__(self, model, slots: Iterable):
        self.model = model
        self.slots = list(slots)
        self.handle = model.register_forward_pre_hook(self.wrap)

    def _mine(self, wrapper: Replaying) -> bool:
        return any(s is mine for s in wrapper.slots for mine in self.slots)

    def wrap(self, *_):
        for module in self.model.modules():
            for attr in CHECKPOINT_ATTRS:
                fn = module.__dict__.get(attr)
                if fn is None or not callable(fn):
                    continue
                if attr == "checkpoint_fn" and "_checkpoint_wrapped_module" not in module._modules:
                    continue   # only torch's CheckpointWrapper holds its checkpoint function under this name
                if isinstance(fn, Replaying):
                    if not self._mine(fn):
                        fn.slots.extend(self.slots)
                else:
                    module.__dict__[attr] = Replaying(fn, self.slots)

    def restore(self) -> None:
        self.handle.remove()
        for module in self.model.modules():
            for attr in CHECKPOINT_ATTRS:
                fn = module.__dict__.get(attr)
                if isinstance(fn, Replaying):
                    fn.slots = [s for s in fn.slots if not any(s is mine for mine in self.slots)]
                    if not fn.slots:
                        module.__dict__[attr] = fn.inner


def replay_slots(model, slots: Iterable) -> Callable[[], None]:
    """Install :class:`SlotReplay` on ``model``; returns its undo."""
    return SlotReplay(model, slots).restore
