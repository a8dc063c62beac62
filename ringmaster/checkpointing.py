"""Activation-checkpoint recomputation replays the step carrier's value of *its own* forward.

The step context reaches most CP layers as the ``ringmaster_batch`` kwarg, which a checkpoint captures
with the layer's call. Where transformers drops kwargs the layers read the model's step carrier
(:class:`ringmaster.sharding.carrier.StepCarrier`), which the shard step sets for the forward and
clears after it. A recomputation in backward runs after that, and with two forwards before one
backward (micro-batches summed, a policy forward in between) the carrier would hold another forward's
context anyway. So the one place that sees both the forward and its recomputation, the checkpoint
function, carries the value across: :class:`Replaying` reads ``holder.current`` when the checkpoint is
taken and hands the checkpoint a function that puts that value back while the checkpointed function
runs (at the forward, where it is already the value, and at the recomputation), restoring the previous
value afterwards.

Why the checkpoint function and not a hook: transformers 5.24's ``GradientCheckpointingLayer``
checkpoints ``partial(forward, self, **kwargs)``, not ``__call__`` ("so module hooks (e.g. FSDP2's)
stay outside the checkpoint"), so no hook of the checkpointed layer runs at the recomputation, and a
block called without kwargs (Mamba's, RWKV's) carries nothing the recomputation could key on. Only
torch's ``checkpoint_wrapper`` recomputes through ``__call__``.

Two per-instance attributes hold a checkpoint function in practice (:data:`CHECKPOINT_ATTRS`):
``_gradient_checkpointing_func`` (``GradientCheckpointingLayer``: HF's ``gradient_checkpointing_enable``
/ ``activation_checkpointing_enable``, reentrant or not, ``offload=True``; FSDP2 keeps it) and
``checkpoint_fn`` (torch's ``CheckpointWrapper``, what accelerate's FSDP activation checkpointing
applies). Both are set after ``rm.wire`` in the usual order (the Trainer enables checkpointing in
``train()``, accelerate wraps in ``prepare``), with no event to hook, so :func:`arm` runs when the step
sets the carrier: it wraps a function the first time it sees it and finds it wrapped afterwards (an
identity check per module per step; nothing is rewritten per forward). :func:`disarm` puts every
original back. A checkpoint the model does not hold (a user's own ``torch.utils.checkpoint.checkpoint(layer,
...)``) is not seen, and a layer reading the carrier raises at its recomputation rather than guess.

A leaf: ``holder`` is anything with a ``current`` attribute.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

CHECKPOINT_ATTRS = ("_gradient_checkpointing_func", "checkpoint_fn")


def _replayed(holder, value, function, /, *args, **kwargs):
    before = holder.current
    holder.current = value
    try:
        return function(*args, **kwargs)
    finally:
        holder.current = before


class Replaying:
    """A module's checkpoint function that runs the checkpointed function with ``holder.current`` as it
    was when the checkpoint was taken (the forward), also when it is recomputed in backward."""

    def __init__(self, inner, holder):
        self.inner = inner
        self.holder = holder

    def __call__(self, function, /, *args, **kwargs):
        return self.inner(functools.partial(_replayed, self.holder, self.holder.current, function), *args, **kwargs)


def checkpoint_functions(model) -> Iterator[tuple[Any, str, Any]]:
    """``(module, attribute, function)`` for every checkpoint function an instance of ``model`` holds."""
    for module in model.modules():
        for attr in CHECKPOINT_ATTRS:
            fn = module.__dict__.get(attr)
            if fn is None or not callable(fn):
                continue
            if attr == "checkpoint_fn" and "_checkpoint_wrapped_module" not in module._modules:
                continue   # only torch's CheckpointWrapper holds its checkpoint function under this name
            yield module, attr, fn


def _replays(fn, holder) -> bool:
    while isinstance(fn, Replaying):
        if fn.holder is holder:
            return True
        fn = fn.inner
    return False


def arm(model, holder) -> None:
    """Wrap every checkpoint function of ``model`` not yet replaying ``holder`` (idempotent)."""
    for module, attr, fn in checkpoint_functions(model):
        if not _replays(fn, holder):
            module.__dict__[attr] = Replaying(fn, holder)


def _without(fn, holder):
    if not isinstance(fn, Replaying):
        return fn
    if fn.holder is holder:
        return _without(fn.inner, holder)
    fn.inner = _without(fn.inner, holder)
    return fn


def disarm(model, holder) -> None:
    """Put back every checkpoint function :func:`arm` wrapped for ``holder``."""
    for module, attr, fn in list(checkpoint_functions(model)):
        module.__dict__[attr] = _without(fn, holder)
