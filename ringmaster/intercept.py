"""Kernel interception, in one place: a wired layer instance gets a copy of its class forward whose
module-level kernel names (``causal_conv1d_fn``, ``mamba2_chunk_scan``, ...) resolve to
ringmaster's CP versions. Nothing shared (the class, the transformers module) is patched. A known
instance-level forward another tool installed around the class forward (:data:`COMPOSABLE_FORWARDS`:
axolotl's default-backend Mamba mixers) is copied the same way, its wrappers kept, and put back by the undo.

Used by the recurrent kinds (their kernel names) and by ``attention/selfattn.py`` (torch's SDPA name at a
self-attention site), so it sits below both (the runtime layer of tools/import_graph.py).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import types
from typing import Callable, Sequence

from .errors import UnsupportedLayerError



class _Overlay(dict):
    """Globals for a re-bound forward: our replacements over the module namespace as it is at wire time,
    then (``__missing__``) names the module defines later. A copy, not a lookup per call: ``torch.compile``
    reads a function's globals as a plain dict (a name only ``__missing__`` finds is unknown to it), so
    a wired layer's forward traces like the class forward does. Without ``__name__``: dynamo reads the
    globals of a function whose namespace names a module from that module (importing it by name), which
    would see the class forward's kernels, not ours; a namespace without a name it reads as it is."""

    def __init__(self, base: dict, replacements: dict):
        super().__init__(base)
        self.update(replacements)
        self.pop("__name__", None)
        self._base = base
        self.setdefault("__builtins__", base.get("__builtins__", builtins))

    def __missing__(self, key):
        if key == "__name__":
            raise KeyError(key)
        return self._base[key]


def _rebuild_chain(fn: Callable, innermost_globals: dict) -> Callable:
    """Copy ``fn`` (a chain of functools.wraps decorators around a plain function) so the innermost
    function looks up its globals in ``innermost_globals``; each wrapper is copied with its closure
    cell that held the next function replaced. Nothing shared (the class, the module) is touched."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, innermost_globals, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__module__ = fn.__module__   # the namespace carries no __name__ (_Overlay)
        new.__dict__.update(fn.__dict__)
        return new
    new_inner = _rebuild_chain(inner, innermost_globals)
    cells = fn.__closure__ or ()
    hits = [i for i, cell in enumerate(cells) if cell.cell_contents is inner]
    if len(hits) != 1:
        raise TypeError(f"cannot see through the decorator {fn.__qualname__} around {inner.__qualname__}")
    closure = tuple(types.CellType(new_inner) if i == hits[0] else cell for i, cell in enumerate(cells))
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    new.__wrapped__ = new_inner
    return new


# Instance-level forwards ringmaster composes with (the bound function's module name and code qualname):
# a ``functools.wraps`` chain, bound to the layer itself, around the layer's own class forward, whose
# extra work ringmaster knows and handles per call. axolotl 0.21's ``mamba_backend: transformers``
# (its default) gives every MambaMixer / Mamba2Mixer one: ``_native_forward`` adds a ``segments`` kwarg
# (axolotl's packed-row documents from the *shard's* position_ids), which :func:`composed_forward`'s
# callers drop under CP in favour of the global documents of the ``ringmaster_batch``.
COMPOSABLE_FORWARDS = {("axolotl.model_support.mamba.modeling", "_native_forward.<locals>.forward")}


# Wrappers (module name, code qualname) that take axolotl's ``segments`` kwarg: its default-backend
# instance forward and its sample-packing patch of the Mamba / Mamba2 / FalconMamba mixer classes
# (``_patch_mixer``: with segments it turns them into ``seq_idx`` or a per-document split of the *shard*)
SEGMENT_WRAPPERS = COMPOSABLE_FORWARDS | {("axolotl.monkeypatch.models.mamba.modeling", "_patch_mixer.<locals>.patched_forward")}


def _identity(fn) -> tuple | None:
    """(module name, code qualname) of a function: ``functools.wraps`` copies ``__module__`` and
    ``__qualname__`` from the wrapped function, the code object and globals keep the wrapper's own."""
    code = getattr(fn, "__code__", None)
    return None if code is None else (getattr(fn, "__globals__", {}).get("__name__"), code.co_qualname)


def takes_local_segments(forward: Callable) -> bool:
    """Whether ``forward``'s ``functools.wraps`` chain has a wrapper in :data:`SEGMENT_WRAPPERS`."""
    fn = getattr(forward, "__func__", forward)
    while fn is not None:
        if _identity(fn) in SEGMENT_WRAPPERS:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def composed_forward(module) -> Callable | None:
    """The function of ``module``'s instance-level forward if it is one ringmaster composes with
    (:data:`COMPOSABLE_FORWARDS`: bound to this module, wrapping a forward of the layer's own class
    hierarchy; or the class forward itself bound on the instance, as a trainer may leave it), else None."""
    bound = vars(module).get("forward")
    fn = getattr(bound, "__func__", None)
    if fn is None or getattr(bound, "__self__", None) is not module:
        return None
    if fn is type(module).forward:   # the class forward itself, bound on the instance (a trainer's re-binding)
        return fn
    if _identity(fn) not in COMPOSABLE_FORWARDS:
        return None
    inner = inspect.unwrap(fn)
    own = {inspect.unwrap(vars(c)["forward"]) for c in type(module).__mro__ if "forward" in vars(c)}
    return fn if inner is not fn and inner in own else None


def interceptable(module, path: str, required: Sequence[str]) -> Callable:
    """The forward of ``module`` (its class forward, or an instance-level one in
    :data:`COMPOSABLE_FORWARDS`) if it calls every kernel in ``required`` by module-global name (so
    re-binding those names reaches it); raises naming the layer otherwise."""
    cls = type(module)
    forward = composed_forward(module)
    if forward is None and "forward" in vars(module):
        raise UnsupportedLayerError(
            f"layer {path!r} ({cls.__name__}) has an instance-level forward (a hub kernel via kernelize(), or "
            "another patch) that would bypass ringmaster's state passing; load the model without use_kernels / "
            "that patch, or unwire the other tool first"
        )
    forward = forward or cls.forward
    inner = inspect.unwrap(forward)
    names = set(inner.__code__.co_names)
    missing = [name for name in required if name not in names]
    if missing:
        raise UnsupportedLayerError(
            f"layer {path!r} ({cls.__name__}) does not call {missing} from its forward (a different transformers "
            "version or a replaced forward); ringmaster cannot route its sequence kernels through the state "
            "passing, so CP would be silently wrong. Declare it with another strategy or leave CP off"
        )
    if "__builtins__" not in inner.__globals__:
        raise UnsupportedLayerError(f"layer {path!r}: its forward has no module namespace to re-bind")
    return forward


def rebind_forward(module, path: str, replacements: dict[str, Callable], required: Sequence[str],
                   guard: Callable[[tuple, dict], None] | None = None,
                   tag: str = "_ringmaster_recurrent") -> Callable[[], None]:
    """Give ``module`` (this instance only) a copy of its class forward whose kernel names resolve to
    ``replacements``; returns the undo. ``guard(args, kwargs)`` runs before every call. ``tag``: the
    instance attribute that marks the module as re-bound (recurrent layers; ``attention.selfattn``
    uses its own)."""
    forward = interceptable(module, path, required)
    previous = vars(module).get("forward")   # a composed instance forward (axolotl's), put back by the undo
    inner = inspect.unwrap(forward)
    rebound = _rebuild_chain(forward, _Overlay(inner.__globals__, replacements))
    bound = types.MethodType(rebound, module)

    if guard is not None:
        @functools.wraps(rebound)
        def guarded(*args, **kwargs):
            guard(args, kwargs)
            return bound(*args, **kwargs)
        module.forward = guarded
    else:
        module.forward = bound
    setattr(module, tag, path)

    def restore() -> None:
        module.__dict__.pop("forward", None)
        module.__dict__.pop(tag, None)
        if previous is not None:
            module.__dict__["forward"] = previous

    return restore



def rebind_attributes(owner, path: str, replacements: dict[str, Callable]) -> Callable[[], None]:
    """Give one object (a layer instance, or a submodule of it) instance attributes that shadow its
    class's methods (``forward``, ``_rnn_scan``): for layers whose sequence math is a method or an inline
    loop rather than a module-level kernel name. Nothing shared is patched; returns the undo. Refuses an
    attribute the instance already overrides (another tool's patch would be silently dropped)."""
    taken = sorted(name for name in replacements if name in vars(owner))
    if taken:
        raise UnsupportedLayerError(
            f"layer {path!r} ({type(owner).__name__}) already has instance-level {taken} (a hub kernel via "
            "kernelize(), or another patch) that ringmaster's state passing would replace; load the model "
            "without that patch, or unwire the other tool first")
    for name, fn in replacements.items():
        setattr(owner, name, fn)

    def restore() -> None:
        for name in replacements:
            owner.__dict__.pop(name, None)

    return restore


def rebind_function(fn: Callable, replacements: dict[str, Callable]) -> Callable:
    """A copy of ``fn`` (a plain function, or a ``functools.wraps`` chain around one) whose module-global
    names resolve to ``replacements`` first, then to ``fn``'s own namespace (:class:`_Overlay`). For a
    function another tool already re-bound per instance (axolotl's FLA Mamba view clones
    flash-linear-attention's ``cuda_kernels_forward`` with the hub kernels as globals): the copy keeps
    that tool's bindings for every name not replaced. Nothing shared is touched."""
    return _rebuild_chain(fn, _Overlay(inspect.unwrap(fn).__globals__, replacements))


def compose_attributes(owner, path: str, replacements: dict[str, Callable]) -> Callable[[], None]:
    """Set instance attributes on ``owner`` *over* those another tool installed on this instance (its
    re-bound methods, its kernels): unlike :func:`rebind_attributes` an existing instance attribute is
    expected here, and the caller's replacement composes with it (it was read before this call).
    Returns the undo, which puts back exactly what the instance held (or removes what it did not)."""
    missing = object()
    before = {name: owner.__dict__.get(name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)

    def restore() -> None:
        for name, value in before.items():
            if value is missing:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = value

    return restore
