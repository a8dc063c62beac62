"""Is a module per-token? The split probe shared by ``rm.tiled_mlp`` and ``rm.wire``'s token-mixing probe.

A per-token module gives each token's output from that token's inputs alone: run on a sequence, or on
two consecutive pieces of it, it gives the same outputs. A module that mixes tokens (attention, a
convolution, a running mean, a norm over the sequence) or that numbers tokens by where they sit in its
input (a position from the local length) does not: the second piece's outputs move. :func:`split_probe`
runs ``call`` on the first ``tokens`` positions of an input and on its two pieces, ``[0, split)`` and
``[split, tokens)``, and returns the largest relative difference of the sequence-shaped outputs.

Every tensor of the call whose sequence dimension has the input's length is cut the same way (the
hidden states, ``position_ids``, the rotary ``(cos, sin)``); the sequence dimension is the first
tensor argument's dim 1 (``[batch, seq, ...]``), else its dim 0 (``[seq, batch, ...]``: sequence-first
remote code). A GEMM over fewer rows may block differently: last-bit differences (``~1e-2`` relative
in 16-bit types); a module that mixes tokens is off by ``O(1)``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .compat import tensors   # noqa: F401  (re-exported: the one tensor walker)

TOL, TOL_16 = 1e-4, 3e-2


def tolerance(dtype: torch.dtype) -> float:
    return TOL if dtype in (torch.float32, torch.float64) else TOL_16


def map_leaves(obj: Any, fn: Callable) -> Any:
    """``obj`` with every leaf (anything but a tuple, list or dict) mapped by ``fn``; namedtuples and transformers'
    ModelOutputs keep their type."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # a namedtuple
        return type(obj)(*(map_leaves(o, fn) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_leaves(o, fn) for o in obj)
    if isinstance(obj, dict):
        out = {k: map_leaves(v, fn) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(**out)
    return fn(obj)


def map_tensors(obj: Any, fn: Callable) -> Any:
    """``obj`` with every tensor mapped by ``fn``."""
    return map_leaves(obj, lambda o: fn(o) if isinstance(o, torch.Tensor) else o)




def sequence_dim(args: tuple, kwargs: dict, length: int) -> int | None:
    """The sequence dimension of a call whose tokens number ``length``: dim 1 of the first tensor argument
    when it has that size, else its dim 0; None when no argument is sequence-shaped."""
    for t in tensors(args) + tensors(kwargs):
        if t.dim() >= 2 and t.shape[1] == length:
            return 1
        if t.dim() >= 1 and t.shape[0] == length:
            return 0
        return None
    return None


def cut(obj: Any, dim: int, length: int, start: int, stop: int) -> Any:
    """Every tensor of ``obj`` with ``length`` positions along ``dim``, cut to ``[start, stop)``."""
    def one(t):
        if t.dim() > dim and t.shape[dim] == length:
            return t.narrow(dim, start, stop - start).contiguous()
        return t
    return map_tensors(obj, one)


def split_probe(call: Callable, args: tuple, kwargs: dict, length: int, tokens: int, split: int,
                dim: int | None = None) -> tuple[float, list, list]:
    """``call`` on the first ``tokens`` of a ``length``-token input and on its pieces ``[0, split)`` and
    ``[split, tokens)`` (no grad). Returns the worst relative difference of the whole run's sequence-shaped
    outputs against the pieces' (0.0 when none is sequence-shaped), and the whole run's and the first
    piece's outputs (tensors, for shape checks)."""
    dim = sequence_dim(args, kwargs, length) if dim is None else dim
    if dim is None:
        return 0.0, [], []
    whole_in = cut((args, kwargs), dim, length, 0, tokens)
    with torch.no_grad():
        whole = tensors(call(*whole_in[0], **whole_in[1]))
        parts = []
        for a, b in ((0, split), (split, tokens)):
            piece = cut((args, kwargs), dim, length, a, b)
            parts.append(tensors(call(*piece[0], **piece[1])))
    worst = 0.0
    for u, first, second in zip(whole, parts[0], parts[1]):
        if u.dim() <= dim or u.shape[dim] != tokens or first.shape[dim:dim + 1] != (split,):
            continue
        if not (u.is_floating_point() or u.is_complex()):
            continue
        v = torch.cat([first, second], dim=dim)
        if v.shape != u.shape:
            continue
        scale = max(float(u.abs().max()), 1e-30)
        worst = max(worst, float((u.double() - v.double()).abs().max()) / scale)
    return worst, whole, parts[0]
