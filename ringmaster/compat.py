"""Version gates and the few experimental torch APIs ringmaster touches, isolated here."""

from __future__ import annotations

import importlib.util

import torch

MIN_TORCH = (2, 11)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def require_torch(minimum: tuple[int, int] = MIN_TORCH) -> None:
    """Raise a clear ImportError when the installed torch is older than ringmaster supports."""
    have = _version_tuple(torch.__version__)
    if have < minimum:
        raise ImportError(
            f"ringmaster needs torch>={minimum[0]}.{minimum[1]}, found {torch.__version__}; "
            f"upgrade with `pip install 'torch>={minimum[0]}.{minimum[1]}'`"
        )


def has_module(name: str) -> bool:
    """True when ``name`` can be imported, without importing it (optional extras)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_transformers() -> None:
    if not has_module("transformers"):
        raise ImportError(
            "this ringmaster feature wraps Hugging Face attention and needs transformers; "
            "install it with `pip install 'axolotl-ringmaster[hf]'`"
        )


def all_gather_single(output, input, group=None):
    """``dist.all_gather_single`` (torch>=2.13) or its older name ``all_gather_into_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


def reduce_scatter_single(output, input, group=None):
    """``dist.reduce_scatter_single`` (torch>=2.13) or its older name ``reduce_scatter_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group)


def config_device_types(config: str) -> tuple[str, ...]:
    """Device types named by a backend config string: ``"cpu:gloo,cuda:nccl"`` -> ``("cpu", "cuda")``."""
    types: list[str] = []
    for part in (config or "").split(","):
        device, sep, _backend = part.strip().partition(":")
        if sep and device and device not in types:
            types.append(device)
    return tuple(types)


def backend_for(group, device_type: str) -> str | None:
    """The backend name ``group`` uses for tensors of ``device_type`` (``"gloo"``, ``"nccl"``, ...), from the
    public ``dist.get_backend_config``; None when torch recorded no config for the group."""
    import torch.distributed as dist

    try:
        config = dist.get_backend_config(group)
    except TypeError:
        return None
    for part in (config or "").split(","):
        device, sep, backend = part.strip().partition(":")
        if sep and device == device_type:
            return backend
    return None


def group_device_types(group=None) -> tuple[str, ...]:
    """The device types ``group`` has a backend for: ``("cpu", "cuda")`` for a plain gloo group or
    ``"cpu:gloo,cuda:nccl"``, ``("cuda",)`` for ``init_process_group("nccl")`` or ``"cuda:gloo"``.

    Read from the public ``dist.get_backend_config(group)`` string. A group whose config names no
    device types (a custom backend registered without any) falls back to the private
    ``ProcessGroup._device_types``, the only other place torch keeps them (torch 2.13); that
    attribute is read here and nowhere else."""
    import torch.distributed as dist

    try:
        types = config_device_types(dist.get_backend_config(group))
    except TypeError:   # torch recorded no config for this group (not built by init_process_group/new_group)
        types = ()
    if not types:
        pg = group if group is not None else dist.group.WORLD
        types = tuple(d.type for d in getattr(pg, "_device_types", ()))  # private: no public copy in torch
    return types


def current_device(device_type: str):
    """This process's current device of ``device_type`` (``cuda`` -> ``cuda:<current index>``), or
    None when there is none (a CPU-only build, no visible GPU)."""
    if device_type == "cpu":
        return torch.device("cpu")
    backend = getattr(torch, device_type, None)   # torch.cuda, torch.xpu, torch.mps, ...
    available = getattr(backend, "is_available", None)
    current = getattr(backend, "current_device", None)
    if available is None or current is None or not available():
        return None
    return torch.device(device_type, current())


def has_compiled_blocks(model) -> bool:
    """Whether any module of ``model`` is compiled (``module.compile()``, or a ``torch.compile`` wrapper)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)
               for m in model.modules())


def eager_replay(model, args: tuple, kwargs: dict):
    """``model.forward(*args, **kwargs)`` again, its compiled blocks running their eager code, without grad and
    with the random state restored after: what a first CP forward that ran compiled is recorded by (its
    one-time checks record per module, which a compiled block must not do). Every CP rank replays alike."""
    devices = sorted({t.device.index or 0 for t in tensors((args, kwargs)) if t.device.type == "cuda"})
    eager = Eager()
    eager.start(model)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            return model.forward(*args, **kwargs)
    finally:
        eager.stop()


def tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists, dicts and transformers ``ModelOutput`` s (``ringmaster.per_token``
    re-exports it)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors(o)]
    if hasattr(obj, "to_tuple"):   # a transformers ModelOutput
        return tensors(obj.to_tuple())
    return []


class Eager:
    """The one holder of "``model``'s compiled blocks run their eager code", from :meth:`start` until :meth:`stop`
    (both idempotent: a second start while running, or a stop while stopped, does nothing). The first CP forward
    runs so: its one-time checks (:mod:`ringmaster.attention.accounting`, :mod:`ringmaster.architectures.mixing`,
    each holding one) record per module, which inside a compiled block would specialise its graph on every layer;
    :func:`eager_replay` too.

    The blocks a model compiled (``module.compile()``: their ``_compiled_call_impl``) run their eager code; a block
    compiled by wrapping (``torch.compile(block)`` in the layer list) can only be reached through torch.compile's
    ``force_eager`` stance, which also runs a kernel's own compiled function eagerly (flex attention: its dense
    scores), so it is entered only then. Kernels that compile themselves otherwise stay compiled."""

    def __init__(self):
        self.running = False
        self.stashed: list = []
        self.stance = None

    def start(self, model) -> None:
        if self.running:
            return
        from torch._dynamo.eval_frame import OptimizedModule

        self.running = True
        self.stashed = [(m, m._compiled_call_impl) for m in model.modules()
                        if getattr(m, "_compiled_call_impl", None) is not None]
        for m, _ in self.stashed:
            m._compiled_call_impl = None
        wrapped = any(isinstance(m, OptimizedModule) for m in model.modules())
        self.stance = torch.compiler.set_stance("force_eager") if wrapped else None

    def stop(self) -> None:
        """Back to the compiled code and the stance from before :meth:`start`."""
        if not self.running:
            return
        self.running = False
        for m, compiled in self.stashed:
            m._compiled_call_impl = compiled
        self.stashed = []
        if self.stance is not None:
            stance, self.stance = self.stance, None
            stance.__exit__(None, None, None)


def zero3_partitioned(module) -> list:
    """``module``'s parameters that DeepSpeed ZeRO-3 holds partitioned (``ds_id`` set, this rank's piece only: the
    parameter itself an empty placeholder), or ``[]`` (no DeepSpeed, no ZeRO-3, or gathered already)."""
    import sys

    if "deepspeed" not in sys.modules:
        return []
    return [p for p in module.parameters() if hasattr(p, "ds_id") and p.data.numel() < getattr(p, "ds_numel", 0)]


def zero3_engine_holds(module) -> bool:
    """DeepSpeed's ZeRO-3 engine has hooked ``module`` (``deepspeed.initialize`` ran): its forward hooks gather and
    release the parameters, and a gather of our own beside them would leave them in a state they refuse."""
    return bool(zero3_partitioned(module)) and any(hasattr(m, "ds_grads_remaining") for m in module.modules())


def zero3_gathered(module):
    """A context in which ``module``'s ZeRO-3 partitioned parameters are whole on every rank (DeepSpeed's
    ``GatheredParameters``, read-only), for what ``rm.wire`` runs of the model at wire time, outside DeepSpeed's
    forward (a recurrent layer's probe, on a model HF built partitioned under ``zero.Init``); nothing when none are
    partitioned. One module at a time: a layer's parameters, never the model's."""
    import contextlib
    import sys

    params = zero3_partitioned(module)
    if not params:
        return contextlib.nullcontext()
    return sys.modules["deepspeed"].zero.GatheredParameters(params, modifier_rank=None)
