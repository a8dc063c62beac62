"""The recurrent-kind registry. Adding a kind: one module that defines ``KIND`` (a
:class:`~.kind.RecurrentKind`) and one entry here (or ``register_kind`` from user code)."""

from __future__ import annotations

from ..errors import UnsupportedLayerError
from . import dynamic_conv, gated_deltanet, kda, lightning, mamba1, mamba2, mlstm, rglru, rwkv, short_conv
from .kind import RecurrentKind

_KINDS: dict[str, RecurrentKind] = {}


def register_kind(kind: RecurrentKind, *, override: bool = False) -> RecurrentKind:
    if not isinstance(kind, RecurrentKind):
        raise TypeError(f"register_kind needs a RecurrentKind, got {type(kind).__name__}")
    if kind.name in _KINDS and not override and _KINDS[kind.name] is not kind:
        raise ValueError(f"recurrent kind {kind.name!r} is already registered; pass override=True to replace it")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> RecurrentKind:
    if name not in _KINDS:
        raise UnsupportedLayerError(f"recurrent kind {name!r} is unknown; ringmaster knows {sorted(_KINDS)}")
    return _KINDS[name]


def known_kinds() -> list[str]:
    return sorted(_KINDS)


register_kind(mamba2.KIND)
register_kind(gated_deltanet.KIND)
register_kind(lightning.KIND)
register_kind(kda.KIND)
register_kind(rglru.KIND)
register_kind(rwkv.KIND)
register_kind(rwkv.CHANNEL_MIX)
register_kind(short_conv.KIND)
register_kind(dynamic_conv.KIND)
register_kind(mamba1.KIND)
register_kind(mlstm.KIND)
