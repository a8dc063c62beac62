"""What one module saves for backward, measured: the check behind each layer kind's formula in
``ringmaster_tools.memory_kinds`` (tests/test_memory_kinds.py, benchmarks/memory_plan.py).

``saved_tensors`` runs the module's forward under ``torch.autograd.graph.saved_tensors_hooks``
and lists every storage the autograd graph keeps (parameters and buffers excluded, each storage
once): exactly the bytes the forward leaves alive for the backward. ``step_peak`` adds what the
module's backward creates on top of them (``profiling.track_tensor_memory``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Saved:
    bytes: int = 0
    tensors: list[tuple[tuple[int, ...], str, int]] = field(default_factory=list)  # (shape, dtype, storage bytes)

    def table(self) -> str:
        rows = sorted(self.tensors, key=lambda t: -t[2])
        return "\n".join(f"{n:>12} {dt:<14} {tuple(shape)}" for shape, dt, n in rows)


def weight_storages(*modules) -> set[int]:
    """The storages (data pointers) of the modules' parameters and buffers: not activations."""
    return {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}


def new_storage_hook(skip: set[int], on_new):
    """A ``saved_tensors_hooks`` pack hook that calls ``on_new(tensor, storage)`` once per storage the graph
    saves, leaving out ``skip`` (the weights) and storages already seen."""
    seen: dict[int, object] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = st.data_ptr()
        if key and key not in skip and key not in seen:
            seen[key] = st          # kept alive: a freed storage's address may be reused
            on_new(t, st)
        return t

    return pack


def saved_tensors(module, *args, **kwargs) -> tuple[Saved, object]:
    """(what ``module(*args, **kwargs)``'s graph saves for backward, the output)."""
    import torch

    out = Saved()

    def add(t, st):
        out.bytes += st.nbytes()
        out.tensors.append((tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes()))

    pack = new_storage_hook(weight_storages(module), add)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = module(*args, **kwargs)
    return out, result


def _first_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next(t for t in (_first_tensor(v) for v in x) if t is not None)
    if hasattr(x, "values"):
        return _first_tensor(list(x.values()))
    return None


def step_peak(module, *args, **kwargs) -> dict:
    """Forward + backward of one module (the output's gradient: ones): the bytes alive at the end
    of its forward and the peak of its backward, both counting only tensors created here."""
    import torch

    from .profiling import track_tensor_memory

    with track_tensor_memory(skip_aliases=True) as mem:
        out = _first_tensor(module(*args, **kwargs))
        forward_end = mem.live_bytes
        forward_peak = mem.peak_bytes
        out.backward(torch.ones_like(out))
    return {"forward_end": forward_end, "forward_peak": forward_peak, "peak": mem.peak_bytes, "peak_op": mem.peak_op}


def saved_per_module(modules: dict[str, object], fn) -> tuple[dict[str, int], object]:
    """Run ``fn()`` (a model's forward, sharded or not) and attribute every storage its autograd
    graph saves to the innermost of ``modules`` (path -> module) running when it was saved; what
    none of them saves goes to ``""``. Parameters and buffers of the modules are not counted; each
    storage counts once. Works under CP (inside ``context_parallel_region``) on each rank."""
    import torch

    stack: list[str] = []
    totals = {path: 0 for path in modules}
    totals[""] = 0

    def add(t, st):
        totals[stack[-1] if stack else ""] += st.nbytes()

    pack = new_storage_hook(weight_storages(*modules.values()), add)

    def enter(path):
        def hook(module, args):
            stack.append(path)
        return hook

    def leave(module, args, output):
        stack.pop()   # returns None: the output stays the module's

    handles = []
    for path, m in modules.items():
        handles.append(m.register_forward_pre_hook(enter(path)))
        handles.append(m.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = fn()
    finally:
        for h in handles:
            h.remove()
    return totals, result
