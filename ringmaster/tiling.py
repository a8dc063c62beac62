"""Run per-token layers (MLP, MoE blocks, norms) over sequence tiles, recomputed in backward.

With attention sharded, a decoder layer's MLP is what holds the most memory per token: autograd
keeps its intermediates (gate, up, the activation and their product: about ``4 x S x I`` values for
a SwiGLU MLP with intermediate size ``I``, 3-4x the hidden size) until backward. A per-token module
gives each token's output from that token's input alone, so it can run over the sequence in tiles
of ``tile_size`` tokens, each tile under ``torch.utils.checkpoint`` (non-reentrant): the forward
keeps only the tile's input (a view of the layer input) and output, and the backward recomputes one
tile's intermediates at a time. The intermediates then cost ``O(tile_size x I)`` instead of
``O(S x I)``; the price is one more MLP forward per step (the recomputation). This is ALST's tiled
MLP, done per module instance:

    handle = rm.tiled_mlp(model)                  # every decoder layer's MLP / MoE block
    handle = rm.tiled_mlp(model, tile_size=1024, modules=["model.layers.0.mlp", "model.norm"])
    handle.restore()

It is exact (the same per-token arithmetic; only matmul blocking over fewer rows may differ in the
last bit) and optional. Under CP each rank tiles its own shard (the tile is a slice of the local
sequence); inside a checkpointed decoder layer the tiles nest in the layer's recomputation.

**Fail closed.** ``tiled_mlp`` only wraps a module it proved per-token: a probe forward (no grad,
eval mode) of a random input of 8 tokens must equal the concatenation of the module run on two
tiles of it (relative max error <= 1e-4; 3e-2 in 16-bit dtypes: :func:`ringmaster.per_token.split_probe`,
the probe ``rm.wire`` runs on every module it does not route). Attention, a convolution, a scan, a router with a
per-sequence capacity, anything that mixes tokens fails the probe and raises, naming the module;
so does a module whose output is not ``[batch, seq, ...]`` (or a tuple of such tensors and
non-tensors). Parameters on the meta device (deferred init) are refused: probe before sharding
(wrap before ``fully_shard``). The default ``tile_size`` is the hidden size (ALST's rule: one
tile's intermediates are the size of one weight matrix). Not yet run on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import per_token
from .errors import UnsupportedLayerError

_TAG = "_ringmaster_tiled"
DEFAULT_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")
PROBE_TOKENS, PROBE_SPLIT = 8, 3


@dataclass
class TiledHandle:
    """What :func:`tiled_mlp` did: the wrapped module paths and the undo."""

    paths: list[str] = field(default_factory=list)
    tile_size: int = 0
    _undo: list = field(default_factory=list, repr=False)

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _split_input(args: tuple, kwargs: dict):
    """The hidden states (first positional arg, or ``hidden_states``/``x``/``input``) and a rebuild."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key], lambda x, key=key: (args, {**kwargs, key: x})
    return None, None


def _cat(pieces: list, length: int):
    """Concatenate the tiles' outputs along the sequence dim (dim 1)."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces, dim=1)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([p[i] for p in pieces], length) for i in range(len(first)))
    return first   # None, or a non-tensor the module returns unchanged per tile


def _check_output(path: str, out, tile: int) -> None:
    items = out if isinstance(out, (tuple, list)) else (out,)
    for item in items:
        if isinstance(item, torch.Tensor) and (item.dim() < 2 or item.shape[1] != tile):
            raise UnsupportedLayerError(
                f"tiled_mlp: module {path!r} returns a tensor of shape {tuple(item.shape)} for a {tile}-token "
                "input, not [batch, seq, ...]: its outputs cannot be put back together by sequence tile; "
                "leave it out of `modules=`")


def tiled_call(forward: Callable, tile_size: int, path: str = "") -> Callable:
    """``forward`` run over sequence tiles of ``tile_size`` tokens, each under a non-reentrant checkpoint
    when grad is on (no tile's intermediates are kept for backward)."""

    def call(*args, **kwargs):
        x, rebuild = _split_input(args, kwargs)
        if x is None or x.dim() < 3 or x.shape[1] <= tile_size:
            return forward(*args, **kwargs)
        S = x.shape[1]
        pieces = []
        for start in range(0, S, tile_size):
            piece = x[:, start:start + tile_size]   # a view: what the checkpoint keeps costs nothing
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_run, forward, rebuild, piece, use_reentrant=False))
            else:
                pieces.append(_run(forward, rebuild, piece))
        return _cat(pieces, S)

    return call


def _run(forward, rebuild, piece):
    # contiguous inside the checkpoint (modules .view() their input), so the copy is not kept either
    args, kwargs = rebuild(piece.contiguous())
    return forward(*args, **kwargs)


def _probe(path: str, module: nn.Module, forward: Callable, width: int) -> None:
    param = next(module.parameters(), None)
    if param is None:
        raise UnsupportedLayerError(f"tiled_mlp: module {path!r} ({type(module).__name__}) has no parameters: "
                                    "nothing to tile")
    if param.device.type == "meta" or type(param).__name__ == "DTensor":
        raise UnsupportedLayerError(
            f"tiled_mlp: module {path!r} has parameters on {param.device.type!r} / sharded: call rm.tiled_mlp "
            "before deferred init is materialised into shards (before fully_shard), so its probe can run")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, PROBE_TOKENS, width, generator=g, dtype=torch.float64).to(param.device, param.dtype)
    training = module.training
    module.eval()
    try:
        err, whole, first = per_token.split_probe(forward, (x,), {}, PROBE_TOKENS, PROBE_TOKENS, PROBE_SPLIT, dim=1)
    except Exception as exc:  # a module that cannot run on [batch, seq, hidden] alone
        raise UnsupportedLayerError(
            f"tiled_mlp: module {path!r} ({type(module).__name__}) did not run on a [2, {PROBE_TOKENS}, {width}] "
            f"input alone ({type(exc).__name__}: {exc}); only modules called with the hidden states can be tiled"
        ) from exc
    finally:
        module.train(training)
    _check_output(path, whole, PROBE_TOKENS)
    _check_output(path, first, PROBE_SPLIT)
    if not err <= per_token.tolerance(param.dtype):
        raise UnsupportedLayerError(
            f"tiled_mlp: module {path!r} ({type(module).__name__}) is not per-token: its output on a sequence "
            f"differs from its outputs on two tiles of it (relative error {err:.1e}); it mixes tokens "
            "(attention, a convolution, a scan, a per-sequence router capacity) and cannot be tiled")


def _default_paths(model: nn.Module) -> list[str]:
    return [path for path, _ in model.named_modules() if path.rpartition(".")[2] in DEFAULT_NAMES]


def _width(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None)


def tiled_mlp(model: nn.Module, tile_size: int | None = None, modules: Iterable[str] | None = None,
              hidden_size: int | None = None) -> TiledHandle:
    """Run ``modules`` (paths; default: every submodule named ``mlp``, ``feed_forward``,
    ``block_sparse_moe``, ``moe`` or ``ffn``) of ``model`` over sequence tiles of ``tile_size``
    tokens (default: the hidden size), recomputed in backward. Each module is proved per-token by a
    probe first; any failure raises :class:`UnsupportedLayerError` before anything changes.
    ``hidden_size``: the modules' input width when the model has no ``config.hidden_size``."""
    width = hidden_size or _width(model)
    if width is None:
        raise ValueError("tiled_mlp: the model has no config.hidden_size; pass hidden_size=<input width>")
    tile = int(tile_size) if tile_size is not None else int(width)
    if tile < 1:
        raise ValueError(f"tiled_mlp: tile_size={tile_size!r} must be a positive number of tokens")
    named = dict(model.named_modules())
    paths = list(modules) if modules is not None else _default_paths(model)
    if not paths:
        raise UnsupportedLayerError(
            f"tiled_mlp: no module of {type(model).__name__} is named one of {DEFAULT_NAMES}; pass modules=[paths]")
    missing = [p for p in paths if p not in named]
    if missing:
        raise ValueError(f"tiled_mlp: no module at {missing[:3]} in {type(model).__name__}")
    for path in paths:
        module = named[path]
        if getattr(module, _TAG, False):
            raise RuntimeError(f"tiled_mlp: module {path!r} is already tiled; restore() the first handle first")
        _probe(path, module, module.forward, width)
    handle = TiledHandle(tile_size=tile)
    for path in paths:
        module = named[path]
        previous = module.__dict__.get("forward")   # an instance-level forward someone else set, kept
        module.forward = tiled_call(module.forward, tile, path)
        setattr(module, _TAG, True)
        handle.paths.append(path)
        handle._undo.append(functools.partial(_untile, module, previous))
    return handle


def _untile(module: nn.Module, previous) -> None:
    module.__dict__.pop(_TAG, None)
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = previous
