"""A hidden-state-conditioned relative position bias under CP (Inkling's attention).

Inkling adds to every score of query ``q`` on key ``k`` the bias ``(states[q] @ proj)[q - k]`` for row
distances ``0 <= q - k < E`` (zero elsewhere): ``states`` ``[B, S, H, d]`` are per-token features of the
*query's* hidden state, ``proj`` ``[d, E]`` a trained bank of bias-vs-distance profiles. The model builds it
as a dense ``[B, H, q, kv]`` tensor from ``torch.arange`` over the *local* shard, which under CP gives only
the diagonal block, and with the shard's own distances.

Because the bias depends on the key only through the distance, everything a rank needs travels with its
*queries*:

* wire re-binds each declared attention instance's bias module (:class:`~ringmaster.architectures.spec.
  RelativeBiasSite`) to return its per-token ``states`` ``[B, H, S/P, d]`` instead of the dense bias; the
  model passes them on as ``position_bias`` (a per-query row scale such as Inkling's log scaling, applied by
  the model to that tensor, commutes with the profile projection, so it stays correct);
* :func:`take` (called by :mod:`.layer_rules` before any collective) turns that kwarg into a
  :class:`RelativeBias` and rescales queries and states scaled by a *local* index to the global one;
* Ulysses all-to-alls the states with q/k/v and builds the bias for its head slice from global positions
  (dense ``[B, H/P, S, S]``, for the eager kernel it runs, as the unwired model's own ``[B, H, S, S]`` bias);
* Ring keeps the states local (queries never move), forms this rank's ``[B, H, S/P, E]`` profiles (the
  same ``rel_logits`` the unwired model computes for its rows) and adds ``profile[i, q_pos - k_pos]`` inside
  every block tile from the block's global offset; the block kernel returns the bias's gradient
  (:mod:`.ring.masks`, :mod:`.ring.math_kernel`), so ``proj`` and the states get theirs through autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..errors import UnsupportedLayerError
from .. import intercept
from ..sharding import balancers

_TAG = "_ringmaster_relative_bias"   # instance attribute: the RelativeBiasSite this module was wired with
KWARG = "relative_bias"              # the CP attention's kwarg carrying a RelativeBias to the backends


@dataclass(frozen=True)
class RelativeBias:
    """``states`` ``[B, H, n, d]`` of the call's query rows, ``proj`` ``[d, E]``: bias(i, j) =
    ``(states[i] @ proj)[pos_i - pos_j]`` for ``0 <= pos_i - pos_j < E``."""

    states: torch.Tensor
    proj: torch.Tensor

    @property
    def extent(self) -> int:
        return self.proj.shape[-1]

    def logits(self) -> torch.Tensor:
        """The per-query profiles ``[B, H, n, E]``."""
        return torch.matmul(self.states, self.proj.to(self.states.dtype))

    def heads(self, start: int, count: int) -> "RelativeBias":
        return replace(self, states=self.states[:, start:start + count])

    def dense(self, positions: torch.Tensor) -> torch.Tensor:
        """The bias ``[B, H, n, n]`` for rows at global ``positions`` (``[n]``, the rows of ``states``)
        against keys at the same positions: Ulysses' eager kernel, which is dense itself."""
        logits = self.logits()
        d = positions[:, None] - positions[None, :]
        keep = (d >= 0) & (d < self.extent)
        index = d.clamp(0, self.extent - 1).expand(*logits.shape[:2], -1, -1)
        return logits.gather(-1, index) * keep.to(logits.dtype)


def wire(spec, modules: dict) -> Callable[[], None]:
    """Re-bind the bias module of every attention instance in ``modules`` (path -> module) whose class
    ``spec.relative_bias`` declares; returns the undo (also run here when a step fails)."""
    undos: list = []
    try:
        for path, module in modules.items():
            site = spec.relative_bias.get(type(module).__name__)
            if site is None:
                continue
            child = getattr(module, site.module, None)
            if not isinstance(child, torch.nn.Module) or not isinstance(getattr(child, site.proj, None), torch.Tensor):
                raise UnsupportedLayerError(
                    f"{path} ({type(module).__name__}) declares a relative position bias in `{site.module}` with a "
                    f"`{site.proj}` profile bank, but has no such module/tensor (another transformers version?); "
                    "ringmaster cannot rebuild its bias under CP: use a CP size of 1")

            def forward(*args, _child=child, _site=site, **kwargs):
                return _site.states(_child, *args, **kwargs).transpose(1, 2)

            undos.append(intercept.rebind_attributes(child, f"{path}.{site.module}", {"forward": forward}))
            setattr(module, _TAG, site)
            undos.append(lambda m=module: m.__dict__.pop(_TAG, None))
    except BaseException:
        for step in reversed(undos):
            step()
        raise

    def restore() -> None:
        for step in reversed(undos):
            step()
    return restore


def _log_scales(t: torch.Tensor, alpha: float, n_floor: float, dtype) -> torch.Tensor:
    """Inkling's ``1 + alpha * log(max((t + 1) / n_floor, 1))``, in fp32 as the model computes it (so the
    ratio below turns the model's local-index scale into exactly its global-index one), then ``dtype``."""
    return (1.0 + alpha * torch.log(((t + 1).float() / n_floor).clamp(min=1.0))).to(dtype)


def log_scaled(module) -> bool:
    """A wired relative-bias module whose queries and states the model log-scales by the *local* index (CP
    attention moves that to the global index)."""
    site = getattr(module, _TAG, None)
    return site is not None and site.log_scale is not None


def take(module, query: torch.Tensor, cpb, kwargs: dict, where: str):
    """Pop ``position_bias``: for a wired relative-bias module, ``(query, RelativeBias)`` with a local-index
    log scaling moved to the global index; for any other module a bias tensor is refused (it was built for the
    local shard). ``(query, None)`` when the call has no bias."""
    bias = kwargs.pop("position_bias", None)
    site = getattr(module, _TAG, None)
    if site is None:
        if isinstance(bias, torch.Tensor):
            raise NotImplementedError(
                f"{where} passes an attention bias `position_bias` built for the local shard; ringmaster CP cannot "
                "rebuild it from global positions. Use a model without ALiBi/relative position bias, or no CP")
        return query, None
    n = query.shape[2]
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4 or bias.shape[:3] != query.shape[:3]:
        raise RuntimeError(
            f"{where}: expected the relative-bias states [B, H, {n}, d] from its wired `{site.module}` as "
            f"position_bias, got {None if bias is None else tuple(bias.shape)}; the module's forward changed")
    child = getattr(module, site.module)
    rel = RelativeBias(states=bias, proj=getattr(child, site.proj))
    scale = site.log_scale(module) if site.log_scale is not None else None
    if scale is not None and cpb.seq_len > scale[1]:   # below n_floor every token's scale is 1
        alpha, n_floor = scale
        dt = torch.promote_types(query.dtype, torch.float32)
        glob = balancers.shard_positions(cpb.seq_len, cpb.size, cpb.rank, cpb.layout, device=query.device)
        ratio = (_log_scales(glob, alpha, n_floor, dt)
                 / _log_scales(torch.arange(n, device=query.device), alpha, n_floor, dt)).view(1, 1, n, 1)
        query = (query.to(dt) * ratio).to(query.dtype)
        rel = replace(rel, states=(rel.states.to(dt) * ratio).to(rel.states.dtype))
    return query, rel
