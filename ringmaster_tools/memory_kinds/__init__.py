"""What each layer kind saves for backward, per kernel: the memory planner's per-kind terms.

One module per kind (``attention``, ``mlp``, ``moe`` and each recurrent kind of
``ringmaster.recurrent.registry``), each with:

* ``NAME``: the kind (the name ``rm.wire``'s classifier gives the module);
* ``dims(module) -> dict``: every size the formula needs, read from the module itself (works on the
  meta device, so ``ringmaster plan --config`` reads a 35B model without memory);
* ``saved(d, b, kernel="torch", P=1, backend="ulysses") -> Bytes``: bytes the module's forward
  leaves for its backward on one rank, per local token and fixed per layer, in activation dtype
  ``b`` bytes, for ``kernel`` "torch" (transformers' pure-torch fallback: what runs on CPU and
  without the GPU packages) or "fast" (flash-linear-attention / mamba-ssm / causal-conv1d on GPU),
  at CP degree ``P`` with ``backend``; ``Bytes.source`` names the function the count is read from;
* ``CASES``: tiny models ``[(model_type, config overrides)]`` on which ``tests/test_memory_kinds.py``
  compares ``saved`` with what the module's graph saves (``memory_probe.saved_per_module``).

A module's count includes its input when its first op saves it (the norm's output, saved by the
first projection) and excludes the decoder layer's norms (``norm_bytes``) and residual adds.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

KERNELS = ("torch", "fast")


@dataclass(frozen=True)
class Bytes:
    per_token: float              # saved for backward, per local token
    fixed: float = 0.0            # saved for backward, per layer, independent of the sequence
    backward: float = 0.0         # per local token: what the module's backward holds at its peak beyond the
                                  # saved tensors (its input gradient, recomputed temporaries)
    source: str = ""              # "<package> <function>" the count is read from

    def at(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed


# kind -> module name in this package (several ringmaster kinds share one formula module)
_MODULES = {
    "attention": "attention", "mlp": "mlp", "moe": "moe",
    "gated_deltanet": "gated_deltanet", "kda": "kda", "lightning": "lightning",
    "mamba2": "mamba2", "mamba1": "mamba1",
    "rglru": "rglru", "rwkv": "rwkv", "rwkv_channel_mix": "rwkv", "mlstm": "mlstm",
    "short_conv": "short_conv", "dynamic_short_conv": "short_conv",
}


def kind_model(kind: str):
    """The formula module of ``kind``; ``KeyError`` naming the known kinds when none models it."""
    if kind not in _MODULES:
        raise KeyError(f"the memory planner has no formula for layer kind {kind!r}; it models {sorted(_MODULES)}")
    return importlib.import_module(f".{_MODULES[kind]}", __name__)


def ring_chunks(P: int, backend: str) -> int:
    """Kernel calls a rank makes (chunks it holds): 2 under pure Ring's ``head_tail`` layout, else 1."""
    return 2 if P > 1 and backend in ("ring", "ring-allgather") else 1


def cp_layout(P: int, backend: str, strategy: str | None = None) -> tuple[int, str]:
    """(kernel calls per rank, state passing) as ``RingmasterConfig.resolve`` picks them by default
    (``strategy``: ``RingmasterConfig.recurrent`` when set): sequential up to P=2, else scan; P=1:
    ``(1, "none")``."""
    if P <= 1:
        return 1, "none"
    if strategy in (None, "auto"):
        strategy = "sequential" if P <= 2 else "scan"
    return ring_chunks(P, backend), strategy


def stored_chunks(P: int, backend: str) -> int:
    """Chunks a rank stores, as the conv / RG-LRU / RWKV / mLSTM formulas count them: 0 without CP, 1 under
    Ulysses, else 2 (Ring balances with ``head_tail``; USP is counted the same)."""
    if P <= 1:
        return 0
    return 1 if backend == "ulysses" else 2


def receiving_share(P: int, backend: str, worst: bool) -> float:
    """Share of a rank's chunks that take a state in: rank 0 (what the benchmark measures) none, or its
    second chunk under Ring's head_tail; ``worst``: every chunk (a middle rank)."""
    if P <= 1:
        return 0.0
    return 1.0 if worst else (0.0 if ring_chunks(P, backend) == 1 else 0.5)


def norm_bytes(width: int, b: int) -> float:
    """HF RMSNorm saves its input upcast to fp32 (pow, mul) and the normalised value in the
    activation dtype (the weight multiply): (4 + b) bytes per channel; rsqrt adds one fp32 per token."""
    return (4 + b) * width + 4


__all__ = ["Bytes", "KERNELS", "cp_layout", "kind_model", "norm_bytes", "receiving_share", "ring_chunks",
           "stored_chunks"]
