"""Version gates and the few experimental torch APIs ringmaster touches, isolated here."""

from __future__ import annotations

import importlib.util

import torch

MIN_TORCH = (2, 11)


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def require_torch(minimum: tuple[int, int] = MIN_TORCH) -> None:
    """Raise a clear ImportError when the installed torch is older than ringmaster supports."""
    have = _version_tuple(torch.__version__)
    if have < minimum:
        raise ImportError(
            f"ringmaster needs torch>={minimum[0]}.{minimum[1]}, found {torch.__version__}; "
            f"upgrade with `pip install 'torch>={minimum[0]}.{minimum[1]}'`"
        )


def has_module(name: str) -> bool:
    """True when ``name`` can be imported, without importing it (optional extras)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_transformers() -> None:
    if not has_module("transformers"):
        raise ImportError(
            "this ringmaster feature wraps Hugging Face attention and needs transformers; "
            "install it with `pip install 'axolotl-ringmaster[hf]'`"
        )


def all_gather_single(output, input, group=None):
    """``dist.all_gather_single`` (torch>=2.13) or its older name ``all_gather_into_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group)


def reduce_scatter_single(output, input, group=None):
    """``dist.reduce_scatter_single`` (torch>=2.13) or its older name ``reduce_scatter_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group)
