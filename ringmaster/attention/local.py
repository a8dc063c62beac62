"""Attention-interface calls that mix nothing along the sequence: run the model's own kernel, untouched.

Inkling2's block (and, in the loop variant, message) attention residuals call the attention interface
for a per-token attention over *layer depth*: q ``[B, S, n, D]`` against the stacked outputs of earlier
blocks ``[B, S, L, D]`` (the sequence sits in the heads dim, no mask). Each token attends to its own
depth stack only, so a shard computes its rows exactly as one device does, with no collective. But the
call goes through ``config._attn_implementation``, which CP switched to its own name: the CP function
would take it for sequence attention over another length and refuse.

Wire marks every instance of the family's declared classes (``ArchitectureSpec.local_attention``) and the
CP function runs such a module's call through the kernel it wraps (the model's eager function for
``eager``), with the call's own arguments: no batch, no ledger entry, no collective.
"""

from __future__ import annotations

from typing import Callable

import torch

_TAG = "_ringmaster_local_attention"   # instance attribute: this module's attention calls run locally


def wire(spec, model: torch.nn.Module) -> Callable[[], None]:
    """Mark every instance of ``spec.local_attention``'s classes in ``model``; returns the undo."""
    marked = [m for m in model.modules() if type(m).__name__ in spec.local_attention]
    for m in marked:
        setattr(m, _TAG, True)

    def restore() -> None:
        for m in marked:
            m.__dict__.pop(_TAG, None)
    return restore


def is_local(module) -> bool:
    return bool(getattr(module, _TAG, False))
