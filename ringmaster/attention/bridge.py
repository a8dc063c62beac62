"""Carry ``ringmaster_batch`` past a decoder layer that does not pass ``**kwargs`` to its attention.

The batch's global structure reaches a CP attention call only as the ``ringmaster_batch`` kwarg,
which the model's forward hands down to each decoder layer in ``**kwargs``. Some decoder layers
then call their attention with an explicit argument list (stablelm, nemotron in transformers
5.24: ``self.self_attn(hidden_states=..., position_embeddings=...)``), so the kwarg stops there
although the attention's own forward would pass it on to the kernel.

For such a layer ``rm.wire`` installs a bridge: a forward pre-hook on the attention module that,
when a call carries no ``ringmaster_batch``, takes the one of the decoder layer's call it is
running in, read from that call's own frame (the frame of the layer's ``forward``, matched by its
code object and its ``self``; its ``**kwargs`` dict holds the batch). Nothing is stored anywhere:
no process global, no per-layer slot, so a recomputation by gradient checkpointing, which in
transformers 5.24 re-runs the layer's ``forward`` *inside* the checkpoint without its module hooks,
finds the batch of exactly the forward it recomputes. A layer is bridged only when its source shows
the drop (:func:`drops_kwargs`); the first-forward accounting still proves every attention call got
the batch. Not meant for ``torch.compile``d layers (the frame walk is Python-level).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from functools import lru_cache

from ..sharding.documents import BATCH_KWARG


_MAX_DEPTH = 12   # frames from the attention's pre-hook up to its caller's forward (module __call__ machinery)


def _forward_function(parent_cls: type):
    """The layer's own ``forward`` function under its decorators (``functools.wraps`` chains)."""
    return inspect.unwrap(getattr(parent_cls, "forward"))


def _kwargs_name(parent_cls: type) -> str | None:
    """The name of the ``**kwargs`` parameter of ``parent_cls.forward`` (None if it has none)."""
    try:
        params = inspect.signature(_forward_function(parent_cls)).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)


@lru_cache(maxsize=None)
def drops_kwargs(parent_cls: type, child: str) -> bool:
    """Whether ``parent_cls.forward`` receives ``**kwargs`` but calls ``self.<child>(...)`` without a
    ``**`` argument (read from its source; False when the source is unavailable or shows no call)."""
    forward = getattr(parent_cls, "forward", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.args.kwarg is None:
        return False  # the layer itself never receives the batch: nothing to carry
    calls = [node for node in ast.walk(fn) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == child and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    return bool(calls) and all(all(k.arg is not None for k in call.keywords) for call in calls)


def _accepts_kwargs(module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class Bridge:
    """One bridged attention module: finds the ``ringmaster_batch`` of the parent layer's call it runs in."""

    def __init__(self, parent):
        self.parent = parent
        self.code = _forward_function(type(parent)).__code__
        self.kwargs_name = _kwargs_name(type(parent))

    def caller_batch(self):
        frame = sys._getframe(2)  # above attention_pre and this method
        for _ in range(_MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_code is self.code and frame.f_locals.get("self") is self.parent:
                extra = frame.f_locals.get(self.kwargs_name)
                return extra.get(BATCH_KWARG) if isinstance(extra, dict) else None
            frame = frame.f_back
        return None

    def attention_pre(self, module, args, kwargs):
        if BATCH_KWARG in kwargs:
            return None
        cpb = self.caller_batch()
        if cpb is None:
            return None
        return args, {**kwargs, BATCH_KWARG: cpb}


def bridge_paths(model, attention_paths) -> list[str]:
    """The attention layers whose parent drops ``**kwargs`` and whose own forward takes them."""
    modules = dict(model.named_modules())
    out = []
    for path in attention_paths:
        parent_path, _, child = path.rpartition(".")
        parent = modules.get(parent_path)
        if parent is not None and drops_kwargs(type(parent), child) and _accepts_kwargs(modules[path]):
            out.append(path)
    return out


def install(model, attention_paths) -> tuple[list[str], list]:
    """Bridge every attention layer of ``attention_paths`` whose parent drops ``**kwargs``. Returns
    the bridged paths and the hook handles (``rm.unwire`` removes them)."""
    modules = dict(model.named_modules())
    paths = bridge_paths(model, attention_paths)
    handles = []
    for path in paths:
        bridge = Bridge(modules[path.rpartition(".")[0]])
        handles.append(modules[path].register_forward_pre_hook(bridge.attention_pre, with_kwargs=True))
    return paths, handles
