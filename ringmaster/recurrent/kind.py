"""A recurrent layer kind: the kernels its layers call and how one layer instance is wired."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RecurrentKind:
    """``kernels``: the module-level names a layer's forward must call (each is intercepted;
    a family spec may override them per kind). ``wire(module, ctx) -> undo`` routes one layer
    instance through exact CP. ``document_aware``: packed/padded rows reset state and halo."""

    name: str
    kernels: tuple[str, ...]
    wire: Callable
    document_aware: bool = True
    description: str = ""
