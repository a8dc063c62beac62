"""Jobs for tests/test_devices.py: run on a 2-rank pool whose default group is ``cuda:gloo``, a
CUDA-only group on this CPU build (the stand-in for NCCL, which has no CPU backend either).

``FakeTensorMode`` makes ``device="cuda"`` tensors without a GPU; a ``TorchDispatchMode`` above it
records every ``c10d.*`` op (every collective dispatches as one, e.g. ``c10d.allreduce_``) with
the devices of its tensor arguments. Under fake mode nothing is sent, so each rank runs alone and
no collective can hang. Two things fake CUDA tensors cannot do on a CPU-only build: read values
back on the host (``.tolist()``, ``int(...)``: :func:`until_host_read` stops a site there, after
its collective was recorded, and only there), and anything that needs the CUDA runtime (python
indexing, autograd edges), so the sites run forward only and the model's own forward is not run.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)   # an indexed device: fake mode resolves a bare "cuda" through the CUDA runtime


class CollectiveRecorder(TorchDispatchMode):
    """Every ``c10d.*`` op dispatched inside the block: ``(site, op name, device types of its tensors)``."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, list[str]]] = []
        self.site = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            devices: list[str] = []

            def walk(x):
                if isinstance(x, torch.Tensor):
                    devices.append(x.device.type)
                elif isinstance(x, (list, tuple)):
                    for y in x:
                        walk(y)

            walk(args)
            walk(list(kwargs.values()))
            self.ops.append((self.site, str(func), devices))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def at(self, site: str):
        """Attribute the ops issued inside the block to ``site``."""
        self.site = site
        try:
            yield
        finally:
            self.site = ""

    def of(self, site: str) -> list[tuple[str, list[str]]]:
        return [(op, devices) for s, op, devices in self.ops if s == site]


def until_host_read(rec: CollectiveRecorder, site: str, fn, *args, **kwargs):
    """Run ``fn`` as ``site``; a fake-mode refusal to read values back on the host ends it, but only
    once ``site`` has issued a collective (the data-dependent step comes after the collective)."""
    with rec.at(site):
        try:
            return fn(*args, **kwargs)
        except DataDependentOutputException:
            if not rec.of(site):
                raise
            return "stopped at a host read"


class StopForward(Exception):
    """Raised by a pre-hook registered after the manager's: the kwargs the manager produced, and no
    model forward (python indexing of a fake CUDA tensor needs the CUDA runtime, which this build lacks)."""

    def __init__(self, kwargs):
        super().__init__("stopped after the pre-hooks")
        self.kwargs = kwargs


def _stop(module, args, kwargs):
    raise StopForward(kwargs)


class DecaySegment:
    """The simplest recurrent Segment (``h_t = a·h_{t-1} + x_t`` per channel), written without python
    indexing so the scan engine's collectives run on fake CUDA tensors. ``x [B, L, H]``, ``a [H]``."""

    def __init__(self, x, a):
        self.x, self.a = x, a

    def run(self, state_in):
        h = torch.zeros_like(self.x.select(1, 0)) if state_in is None else state_in
        outs = []
        for xt in self.x.unbind(1):
            h = self.a * h + xt
            outs.append(h)
        return torch.stack(outs, 1), h

    def local_map(self):
        _, b = self.run(None)
        A = (self.a ** self.x.shape[1]).expand_as(b)
        return torch.stack([A, b]), None

    def combine(self, state, packed):
        A, b = packed.unbind(0)
        return b if state is None else A * state + b

    def finish(self, aux, state_in):
        return self.run(state_in)[0]

    def state_meta(self):
        return (self.x.shape[0], self.x.shape[2]), self.x.dtype, self.x.device


def _tiny_llama():
    from ringmaster_tools.parity import tiny_model

    return tiny_model("llama")


def _collator_cut(model, S: int, rank: int, size: int) -> dict:
    """A batch the collator already cut (``_cp_shard``), built for real on CPU: its shapes and metadata."""
    from ringmaster.sharding.batch import shard_collated_batch
    from ringmaster_tools.parity import tiny_batch

    return shard_collated_batch(tiny_batch(model.config.vocab_size, S), rank, size)


def _fake_like(batch: dict, device) -> dict:
    """Fake tensors of ``batch``'s shapes and dtypes on ``device`` (values are unknown under fake mode)."""
    return {k: torch.zeros(v.shape, dtype=v.dtype, device=device) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


@contextlib.contextmanager
def _cuda_present(yes: bool):
    """``yes``: ringmaster sees a current CUDA device (cuda:0), as on a GPU rank; needed only where a CPU
    tensor must move to the group's device. Patches ``current_device`` where ``ringmaster.comm`` looks it
    up (patching ``torch.cuda.is_available`` instead would change how fake mode builds tensors)."""
    if not yes:
        yield
        return
    from unittest import mock

    def current(device_type: str):
        return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, 0)

    with mock.patch("ringmaster.comm.current_device", current):
        yield


def collective_sites(ctx, batch_device: str = "cuda", force_cpu: bool = False) -> dict:
    """Every collective ringmaster issues on its own tensors, on the CUDA-only group, with the batch on
    ``batch_device`` ("cuda": fake CUDA tensors; "cpu": a batch still on CPU while the model is on
    CUDA). Returns ``{site: [(op, devices), ...]}`` plus what each site finished with.

    ``force_cpu``: the control. The input check gets ``device=cpu`` as ringmaster did before this
    fix; the recorder must flag it."""
    import ringmaster as rm
    from ringmaster.adapters.accelerate import cp_num_items_in_batch
    from ringmaster.comm import all_gather, all_to_all
    from ringmaster.recurrent.scan import scan_pass, sequential_pass
    from ringmaster.sharding.batch import ContextParallelContextManager, gather_sequence
    from ringmaster.sharding.documents import BATCH_KWARG
    from ringmaster.sharding.loss import reduce_mean
    from ringmaster.validation import check_agreement, fingerprint, validate_batch

    group = dist.group.WORLD
    model = _tiny_llama()
    cut = _collator_cut(model, 16, ctx.rank, ctx.world)
    rec = CollectiveRecorder()
    finished: dict[str, str] = {}
    dev = CUDA if batch_device == "cuda" else torch.device("cpu")
    with _cuda_present(batch_device == "cpu"), FakeTensorMode(), rec:
        local = _fake_like(cut, dev)
        meta = local.pop("_cp_shard")
        for validate in (True, False):
            runtime = rm.wire(model, rm.RingmasterConfig(size=ctx.world, backend="ulysses", validate_inputs=validate))
            if validate and force_cpu:
                values = fingerprint(meta, runtime.config, None, local)
                finished["validation"] = until_host_read(rec, "validation", check_agreement, values, group,
                                                         device=torch.device("cpu"))
            elif validate:
                finished["validation"] = until_host_read(rec, "validation", validate_batch, runtime, meta,
                                                         local=local)
            # the manager's pre-hook on a collator-cut batch: input check (validate) or token-count all_reduce
            site = "pre_hook_validate" if validate else "pre_hook_token_count"
            handles = ContextParallelContextManager([model], group).install()
            handles.append(model.register_forward_pre_hook(_stop, with_kwargs=True))
            try:
                with rec.at(site):
                    model(**local, _cp_shard=meta)
            except StopForward as stop:
                kwargs = stop.kwargs
                finished[site] = (f"num_items_in_batch on {kwargs['num_items_in_batch'].device.type}, "
                                  f"{BATCH_KWARG}={type(kwargs[BATCH_KWARG]).__name__}")
            except DataDependentOutputException:
                if not rec.of(site):
                    raise
                finished[site] = "stopped at a host read"
            finally:
                for h in handles:
                    h.remove()
                rm.unwire(model)
        trainer = SimpleNamespace(args=SimpleNamespace(average_tokens_across_devices=False))
        count = until_host_read(rec, "accelerate_count", cp_num_items_in_batch, trainer, [dict(local, _cp_shard=meta)],
                                dev, group, ctx.world)
        finished["accelerate_count"] = f"on {count.device.type}"
        mean = until_host_read(rec, "reduce_mean", reduce_mean, torch.ones((), device=dev), group)
        finished["reduce_mean"] = f"on {mean.device.type}"

        # activations: the recurrent state (scan maps, sequential p2p) and attention's collectives stay on
        # the activations' device. Forward only: autograd records a CUDA stream per edge, which aborts
        # the process on a CPU-only build, so the backward collectives (on the gradients' device) are
        # not run here.
        with torch.no_grad():
            for strategy, fn in (("scan", scan_pass), ("sequential", sequential_pass)):
                x = torch.randn(2, 4, 3, device=CUDA)
                a = torch.full((3,), 0.9, device=CUDA)
                with rec.at(f"recurrent_{strategy}"):
                    out = fn([DecaySegment(x, a)], group, "contiguous")[0]
                finished[f"recurrent_{strategy}"] = f"output on {out.device.type}"
            q = torch.randn(ctx.world, 2, 3, device=CUDA)
            with rec.at("attention_activations"):
                y = all_to_all(q, group, tag="qkv") + all_gather(q, group).sum(0)
                z = gather_sequence(torch.randn(1, 8, 5, device=CUDA), dim=1, group=group, layout="contiguous")
            finished["attention_activations"] = f"outputs on {y.device.type}, {z.device.type}"
    return {"ops": [(site, op, devices) for site, op, devices in rec.ops], "finished": finished}


def _try(fn, *args, **kwargs) -> str:
    try:
        return str(fn(*args, **kwargs))
    except RuntimeError as exc:
        return f"error: {exc}"


def group_devices(ctx) -> dict:
    """``collective_device`` on groups of every kind this build can make (new groups over the pool's
    ranks, each built collectively), for no tensor, a CPU tensor and a CUDA tensor, without and with
    a current CUDA device."""
    from ringmaster.comm import collective_device
    from ringmaster.compat import group_device_types

    groups = {backend: dist.new_group(list(range(ctx.world)), backend=backend)
              for backend in ("cuda:gloo", "gloo", "cpu:gloo", "cpu:gloo,cuda:gloo")}
    out = {}
    with FakeTensorMode():
        cpu, cuda = torch.zeros(1), torch.zeros(1, device=CUDA)
        for backend, group in groups.items():
            row = {"types": group_device_types(group)}
            for present in (False, True):
                with _cuda_present(present):
                    for name, like in (("none", None), ("cpu", cpu), ("cuda", cuda)):
                        row[f"{name}{'+gpu' if present else ''}"] = _try(collective_device, group, like=like)
            out[backend] = row
    return out


def proxy_is_faithful(ctx) -> dict:
    """The pool's group is CUDA-only, like NCCL's: torch itself refuses a CPU tensor collective on it."""
    from ringmaster.compat import group_device_types

    types = group_device_types(dist.group.WORLD)
    try:
        dist.all_reduce(torch.ones(1))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"config": dist.get_backend_config(), "types": types, "cpu_error": error}
