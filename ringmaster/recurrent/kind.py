"""A recurrent layer kind: the kernels its layers call and how one layer instance is wired."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class RecurrentKind:
    """``kernels``: role -> the module-level name a layer's forward must call (each is intercepted
    and probed; roles ``"conv"`` and ``"scan"``); ``optional``: role -> names that are intercepted
    when the forward calls them (fused kernels, cached decoding). A family spec may rename any
    of them (``ArchitectureSpec.recurrent_kernels``). ``wire(module, ctx, names) -> undo`` routes
    one layer instance through exact CP. ``document_aware``: packed/padded rows reset state and halo.
    ``probe_kwargs``: keyword arguments ``wire``'s probe forward passes to a layer whose forward needs
    more than the hidden states (MiniMax's lightning attention takes ``position_embeddings`` and
    ``attention_mask`` positionally; Griffin's recurrent block ``position_ids``): a callable
    ``(x [1, L, hidden]) -> dict``."""

    name: str
    kernels: dict
    wire: Callable
    optional: dict = field(default_factory=dict)
    document_aware: bool = True
    description: str = ""
    probe_kwargs: Callable | None = None
    # ``probe_width(module, hidden) -> int``: the input width of ``wire``'s probe forward for a layer
    # whose input is not the model's hidden size (Inkling's k/v short convs); None: the hidden size
    probe_width: Callable | None = None
    # strategies besides ``scan``/``sequential`` this kind offers (``"fla_cp"``: FLA's own CP; ``"heads"``: head-
    # parallel, :mod:`ringmaster.recurrent.heads`)
    strategies: tuple = ()
