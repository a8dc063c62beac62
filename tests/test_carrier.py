"""One carrier of per-step state (ringmaster/sharding/carrier.py): the ``ringmaster_batch`` kwarg where
transformers passes kwargs on, else the model's one ``StepCarrier``, set and cleared by the shard step and
replayed by a checkpoint's recomputation (ringmaster/checkpointing.py). No frame walks, no per-layer hooks
copying the batch, no process global; tests/test_checkpointing.py holds the parity matrix and its mutations."""

import functools
import os
import re

import jobs_carrier as jobs
import pytest
import torch
import torch.nn as nn

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ringmaster")


def _sources():
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    yield os.path.relpath(path, ROOT), fh.read()


def test_no_frame_walks():
    """Nothing in ringmaster reads a caller's frame to find per-step state."""
    pattern = re.compile(r"_getframe|currentframe\(|\.f_back\b|\.f_locals\b|inspect\.stack\(")
    found = [(path, m.group()) for path, src in _sources() for m in pattern.finditer(src)]
    assert found == [], found


def test_the_old_carriers_are_gone():
    """The batch slot, the recurrent layers' batch hooks and the per-slot checkpoint replay are gone: only
    sharding/carrier.py defines a holder of the step context."""
    pattern = re.compile(r"class BatchSlot\b|def _batch_hook\b|def replay_slots\b|class SlotReplay\b")
    found = [(path, m.group()) for path, src in _sources() for m in pattern.finditer(src)]
    assert found == [], found
    holders = [path for path, src in _sources() if re.search(r"self\.current\s*(:[^=]*)?=", src)]
    assert holders == [os.path.join("sharding", "carrier.py")], holders


class _Reader(nn.Module):
    """A layer called without kwargs that reads the step carrier (a float scale here)."""

    def __init__(self, carrier):
        super().__init__()
        self.carrier = carrier
        self.w = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, x):
        return self.w * x * self.carrier.current


def _block(carrier):
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Block(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.reader = _Reader(carrier)

        def forward(self, x):
            return torch.tanh(self.reader(x))

    return Block()


def _model(carrier, mode):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(_block(carrier))
    if mode == "torch":
        model[0] = checkpoint_wrapper(model[0], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    else:
        model[0].gradient_checkpointing = True
        model[0]._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=mode == "hf_reentrant")
    return model


@pytest.mark.parametrize("mode", ["hf_reentrant", "hf", "torch"])
@pytest.mark.parametrize("replay", [True, False])
def test_two_forwards_one_backward(mode, replay):
    """Two steps (scales 2 and 3, the carrier cleared after each) then one backward: with the checkpoint
    functions armed each recomputation gets its own forward's value, the gradient of ``w`` is exact; not
    armed, the recomputation finds the carrier empty and raises (never another forward's value)."""
    from ringmaster.sharding.carrier import StepCarrier

    carrier = StepCarrier()
    model = _model(carrier, mode)
    if replay:
        carrier._model = lambda: model   # what attach(model) binds
    x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)   # reentrant checkpoints need one
    losses = []
    for scale in (2.0, 3.0):
        previous = carrier.set(scale)
        losses.append(model(x).sum())
        carrier.clear(previous)
    if not replay:
        with pytest.raises(TypeError):
            sum(losses).backward()
        return
    sum(losses).backward()
    expected = sum((x * s * (1 - torch.tanh(x * s) ** 2)).sum() for s in (2.0, 3.0))
    assert torch.allclose(model[0].reader.w.grad if mode != "torch" else
                          model[0]._checkpoint_wrapped_module.reader.w.grad, expected, rtol=1e-12, atol=0)
    from ringmaster import checkpointing

    checkpointing.disarm(model, carrier)
    assert not [m for m in model.modules() for a in checkpointing.CHECKPOINT_ATTRS
                if isinstance(m.__dict__.get(a), checkpointing.Replaying)]


@pytest.mark.parametrize("family", ["jamba", "mamba2", "falcon", "stablelm"])
def test_carrier_set_cleared_and_unwired(pool, family):
    """Per wired model: one carrier, registered with its runtime; no submodule hooked except a bridged
    attention (stablelm); the region and the manager hold the step's batch during the forward and clear it
    after; HF checkpointing enabled after rm.wire is armed by the step; rm.unwire leaves nothing."""
    r = pool.run(jobs.carrier_life, family)[0]
    assert r["registered"] == [True], r
    assert r["hooked"] == sorted(set(r["before"]) | set(r["bridged"])), r
    assert (family == "stablelm") == bool(r["bridged"]), r
    assert r["region"]["during"] and r["region"]["after"] and r["region"]["after_backward"], r
    assert r["region"]["wrapped"] > 0, r
    assert r["manager"]["during"] and r["manager"]["after"], r
    assert r["left"] == {"carrier": False, "wrapped": 0, "hooked": r["before"], "registered": 0}, r


def test_two_models_two_carriers(pool):
    r = pool.run(jobs.two_models)[0]
    assert r == {"distinct": True, "a_during_b": None, "b_during_b": True, "runtimes": (1, 1)}, r
