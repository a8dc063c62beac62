"""Attention modules whose decoder layer does not pass ``**kwargs`` on: fed from the model's step carrier.

The step context reaches a CP attention call as the ``ringmaster_batch`` kwarg, which the model's
forward hands down to each decoder layer in ``**kwargs``. Some decoder layers then call their
attention with an explicit argument list (stablelm, nemotron in transformers 5.24:
``self.self_attn(hidden_states=..., position_embeddings=...)``), so the kwarg stops there although the
attention's own forward would pass it on to the kernel.

A layer is found from its source (:func:`drops_kwargs`: it receives ``**kwargs`` but calls the
attention without a ``**`` argument), and ``rm.wire`` gives each such attention module a forward
pre-hook that adds the model's step carrier's value (:mod:`ringmaster.sharding.carrier`: set by the
shard step, replayed by a checkpoint's recomputation) when the call carries no ``ringmaster_batch``.
The first-forward accounting still proves every attention call got the batch.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache

from ..sharding.carrier import StepCarrier, carrier_of
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


def _feed(carrier: StepCarrier):
    """The pre-hook of a bridged attention module: the step's ``ringmaster_batch`` when the call has none."""
    def attention_pre(module, args, kwargs):
        if BATCH_KWARG in kwargs or carrier.current is None:
            return None
        return args, {**kwargs, BATCH_KWARG: carrier.current}
    return attention_pre


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
    """Feed every attention layer of ``attention_paths`` whose parent drops ``**kwargs`` from the model's
    step carrier (``rm.wire`` attached it). Returns the bridged paths and the hook handles (``rm.unwire``
    removes them)."""
    modules = dict(model.named_modules())
    paths = bridge_paths(model, attention_paths)
    carrier = carrier_of(model)
    if paths and carrier is None:
        raise RuntimeError(f"{type(model).__name__} has no step carrier; rm.wire attaches one before bridging")
    return paths, [modules[path].register_forward_pre_hook(_feed(carrier), with_kwargs=True) for path in paths]
