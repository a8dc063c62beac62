"""Kernel interception, in one place: a wired layer instance gets a copy of its class forward whose
module-level kernel names (``causal_conv1d_fn``, ``mamba2_chunk_scan``, ...) resolve to
ringmaster's CP versions. Nothing shared (the class, the transformers module) is patched.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import types
from typing import Callable, Sequence

from ..errors import UnsupportedLayerError



class _Overlay(dict):
    """Globals for a re-bound forward: our replacements first, then the live module namespace."""

    def __init__(self, base: dict, replacements: dict):
        super().__init__(replacements)
        self._base = base
        self.setdefault("__builtins__", base.get("__builtins__", builtins))

    def __missing__(self, key):
        return self._base[key]


def _rebuild_chain(fn: Callable, innermost_globals: dict) -> Callable:
    """Copy ``fn`` (a chain of functools.wraps decorators around a plain function) so the innermost
    function looks up its globals in ``innermost_globals``; each wrapper is copied with its closure
    cell that held the next function replaced. Nothing shared (the class, the module) is touched."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, innermost_globals, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
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


def interceptable(module, path: str, required: Sequence[str]) -> Callable:
    """The class forward of ``module`` if it calls every kernel in ``required`` by module-global name
    (so re-binding those names reaches it); raises naming the layer otherwise."""
    cls = type(module)
    if "forward" in vars(module):
        raise UnsupportedLayerError(
            f"layer {path!r} ({cls.__name__}) has an instance-level forward (a hub kernel via kernelize(), or "
            "another patch) that would bypass ringmaster's state passing; load the model without use_kernels / "
            "that patch, or unwire the other tool first"
        )
    forward = cls.forward
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
    names resolve to ``replacements`` first, then to ``fn``'s own namespace (looked up per call). For a
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
