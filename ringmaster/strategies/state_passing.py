"""Cross-rank state passing for recurrent layers (Mamba2, gated DeltaNet).

This build wires attention-only families; these entry points keep the public contract
(and axolotl's calls) working and fail closed on any recurrent layer instead of training
it silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..architectures import STATEFUL_PATTERN


def _stateful_layers(model) -> list[tuple[str, str]]:
    return [(path, type(m).__name__) for path, m in model.named_modules() if STATEFUL_PATTERN.search(type(m).__name__)]


def _fail(found: list[tuple[str, str]]) -> None:
    path, cls = found[0]
    raise NotImplementedError(
        f"layer {path!r} ({cls}) and {len(found) - 1} more carry recurrent state; cross-rank state passing is not "
        "in this ringmaster build, so CP would be silently wrong for this model. Use a CP size of 1 for it"
    )


def recurrent_plan(models, size: int):
    """``(fla_mixers, kda_mixers, mamba_mixers)`` that need state passing at CP ``size``."""
    if size > 1:
        for model in models:
            found = _stateful_layers(model)
            if found:
                _fail(found)
    return [], [], []


@dataclass
class RecurrentWiring:
    layers: list[str] = field(default_factory=list)
    _restores: list[Callable[[], None]] = field(default_factory=list)

    def restore(self) -> None:
        for undo in reversed(self._restores):
            undo()
        self._restores.clear()


def wire_recurrent_layers(model, group=None) -> RecurrentWiring:
    found = _stateful_layers(model)
    if found:
        _fail(found)
    return RecurrentWiring()
