"""The step sizes (``dt`` discretisation) the Mamba kernels compute, which ringmaster's Mamba1 / Mamba2
segments recompute to build their affine maps.

The fp64 references in ``tests/standins/naive.py`` keep their own copy on purpose: a reference that shared
this code could not catch a mistake in it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# a raw step size whose softplus is exactly 0 in every float dtype (exp(-1e4) underflows): padding tokens that leave
# a Mamba state as it is (no decay, no input; recurrent.documents.PiecesSegment)
PAD_DT = -1e4


def pad_step(softplus: bool) -> float:
    """The raw step size (Mamba2's ``dt``, Mamba1's ``delta``) the padding of a segment's pieces takes: a step of 0
    (``exp(0 * A) = 1``, no input): :data:`PAD_DT` before a softplus, else 0."""
    return PAD_DT if softplus else 0.0


def step_pads_neutrally(softplus: bool, bias, low: float = 0.0) -> bool:
    """Whether :func:`pad_step` gives a step of exactly 0, so the padding leaves any state as it is: not where a bias
    is added that no softplus takes back to 0, nor where the kernel clamps the step up (``low > 0``: Mamba2's
    ``dt_limit``)."""
    return low <= 0 and (softplus or bias is None)


def mamba2_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
              dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """The step size the Mamba2 kernels use: ``clamp(softplus(dt + dt_bias), *dt_limit)``."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def mamba1_dt(delta: torch.Tensor, delta_bias: torch.Tensor | None = None, delta_softplus: bool = False) -> torch.Tensor:
    """The step size of a Mamba1 selective scan, ``softplus(delta + delta_bias)`` (``delta [b, d, l]``,
    ``delta_bias [d]``), as transformers' torch fallback and mamba-ssm's ``selective_scan_fn`` compute it."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[..., None]
    return F.softplus(delta) if delta_softplus else delta
