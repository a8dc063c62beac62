"""A per-instance ``model.forward`` with a ringmaster head mode, shared by the trl adapters.

``CPSFTTrainer``'s chunked loss and ``CPGRPOTrainer``'s token log-probs both replace the LM head step
of a causal LM, not the model: the call still goes through the top module (so FSDP2's root hooks and
ringmaster's pre-hooks run), trl's head kwargs are dropped, the backbone runs on the shard, and the
head computation gets the shard's shifted labels. Only that computation differs, so it is the one
argument here.
"""

from __future__ import annotations

import functools
from typing import Callable

from ..sharding.batch import shift_labels as _shift_labels

# trl / transformers head kwargs a backbone does not take
_HEAD_KWARGS = ("fused_lm_head", "logits_to_keep")


def install_head_forward(model, flag: str, head: Callable, options: tuple[str, ...] = ()) -> Callable[[], None]:
    """Give ``model.forward`` a ``flag=True`` mode: ``head(model, backbone_out, shift_labels, kwargs,
    num_items, **opts)``, where ``kwargs`` are the backbone's (its ``ringmaster_batch`` included) and
    ``opts`` the call's keyword ``options`` (default False; taken off every call, like ``flag``).
    Without the flag the original forward runs. Per instance (like trl's fused head). Returns
    ``restore()``."""
    had = "forward" in vars(model)
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(*args, **kwargs):
        on = kwargs.pop(flag, False)
        opts = {name: kwargs.pop(name, False) for name in options}
        if not on:
            return original(*args, **kwargs)
        labels = kwargs.pop("labels", None)
        shift = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        for key in _HEAD_KWARGS:
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        if shift is None:
            if labels is None:
                raise ValueError(f"{flag} needs labels or shift_labels")
            shift = _shift_labels(labels)
        backbone = getattr(model, model.base_model_prefix, None) or model.get_decoder()
        return head(model, backbone(*args, **kwargs), shift, kwargs, num_items, **opts)

    model.forward = forward

    def restore():
        if had:
            model.forward = original
        else:
            del model.forward

    return restore
