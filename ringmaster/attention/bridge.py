"""Carry ``ringmaster_batch`` past a decoder layer that does not pass ``**kwargs`` to its attention.

The batch's global structure reaches a CP attention call only as the ``ringmaster_batch`` kwarg,
which the model's forward hands down to each decoder layer in ``**kwargs``. Some decoder layers
then call their attention with an explicit argument list (stablelm, nemotron in transformers
5.24: ``self.self_attn(hidden_states=..., position_embeddings=...)``), so the kwarg stops there
although the attention's own forward would pass it on to the kernel.

For such a layer ``rm.wire`` installs a bridge: the layer's forward pre-hook keeps the
``ringmaster_batch`` of *this call* (a stack local to the layer, popped by its post-hook, which
also runs when the forward raises), and the attention module's pre-hook adds it to its kwargs when
the call did not carry one. Nothing is process-global: each bridge is bound to one layer of one
wired model, holds the batch only while that layer's forward runs, and is removed by ``rm.unwire``.
Gradient checkpointing replays the layer through its ``__call__``, so the hooks run again on
recomputation. A layer is bridged only when its source shows the drop (:func:`drops_kwargs`); the
first-forward accounting still proves every attention call got the batch.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache

from ..sharding.documents import BATCH_KWARG


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
    """The ``ringmaster_batch`` of the bridged layer's calls in progress (innermost last)."""

    def __init__(self):
        self.stack: list = []

    def layer_pre(self, module, args, kwargs):
        self.stack.append(kwargs.get(BATCH_KWARG))

    def layer_post(self, module, args, kwargs, output):
        if self.stack:
            self.stack.pop()

    def attention_pre(self, module, args, kwargs):
        if BATCH_KWARG in kwargs or not self.stack or self.stack[-1] is None:
            return None
        return args, {**kwargs, BATCH_KWARG: self.stack[-1]}


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
        bridge = Bridge()
        parent = modules[path.rpartition(".")[0]]
        handles.append(parent.register_forward_pre_hook(bridge.layer_pre, with_kwargs=True))
        handles.append(parent.register_forward_hook(bridge.layer_post, with_kwargs=True, always_call=True))
        handles.append(modules[path].register_forward_pre_hook(bridge.attention_pre, with_kwargs=True))
    return paths, handles
