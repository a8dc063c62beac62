"""Dropout under CP: each rank's forward draws from a random state forked per CP rank.

Without a fork every rank of a CP group starts its forward from the same generator state (same seed,
same draws so far), so rank r's dropout masks are rank 0's masks laid on other tokens (and, under
Ulysses, on other heads): the shards reuse one pattern and the step is not a sample of the
single-device step. Megatron keeps a model-parallel RNG tracker for the same reason; ringmaster forks
per forward, from the step:

- the step's first forward in training mode draws one 63-bit seed from the default CPU generator
  (``CPBatch.rng_seed``, kept for the step's other forwards: :func:`step_seed`; it advances the main stream
  identically on every rank, so consecutive steps differ and ``torch.manual_seed(s)`` reproduces them; a
  step that only evaluates draws nothing);
- the wired model's forward (the language model's, for a VLM: its vision tower runs replicated on every
  rank and keeps the shared stream) runs under a state seeded by :func:`fork_seed` of (that seed, the CP
  rank, the index of this forward within the step), on the CPU and on every accelerator the forward's
  tensors live on; the previous states are put back when the forward ends (raising or not), so nothing
  outside the forward sees the fork;
- activation-checkpoint recomputation replays it: ``torch.utils.checkpoint`` (``preserve_rng_state``, its
  default; HF's gradient checkpointing and ``checkpoint_wrapper`` use it) stashes the generator states
  when a block's forward starts, inside the fork, and restores them for the recomputation.

What this makes exact: per-element dropout (``nn.Dropout``, ``F.dropout`` on activations, router jitter,
attention-probability dropout under Ulysses, where each rank holds whole rows of its heads) draws an
independent Bernoulli per element on every rank, which is the single-device distribution of masks; the
CP step equals the single-device step *with the same masks*. Not the same masks as one device draws
(no per-position generator exists), so dropout runs are reproducible from the seed at a fixed CP size.
Draws shared along the sequence (LayerDrop, drop path, feature dropout) and Ring attention's
probability dropout are refused (:mod:`ringmaster.architectures.generic`, ``attention/ring/hf.py``).
With dropout off nothing draws: loss and gradients are bit-for-bit those without the fork.
"""

from __future__ import annotations

import torch

from .documents import BATCH_KWARG

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit over the output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def step_seed() -> int:
    """The step's base seed: one draw from the default CPU generator (the shard step calls it once per batch,
    on the host, before any forward; every rank of a CP group with the same seed draws the same value)."""
    return int(torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64))


def fork_seed(base: int, rank: int, index: int) -> int:
    """The seed of CP rank ``rank``'s ``index``-th forward of a step whose base seed is ``base``: distinct
    ranks (and forwards) get unrelated generator seeds; the same triple always the same seed."""
    x = _mix64((base & _MASK64) ^ _mix64(0x9E3779B97F4A7C15 * (rank + 1) & _MASK64))
    return _mix64(x ^ _mix64(0xD1B54A32D192ED03 * (index + 1) & _MASK64)) & ((1 << 63) - 1)


def _devices(module, kwargs) -> dict[str, list[int]]:
    """The accelerators (type -> indices) whose generators the forward may draw from: its parameters' and
    its tensor arguments'."""
    found: dict[str, set[int]] = {}

    def add(t) -> None:
        d = t.device
        if d.type not in ("cpu", "meta"):
            found.setdefault(d.type, set()).add(d.index if d.index is not None else 0)

    param = next(module.parameters(), None)
    if param is not None:
        add(param)
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            add(value)
    return {k: sorted(v) for k, v in found.items()}


class _Fork:
    """The saved generator states of one forked forward; :meth:`restore` puts them back."""

    def __init__(self, seed: int, devices: dict[str, list[int]]):
        self.cpu = torch.get_rng_state()
        self.devices = []
        for kind, indices in devices.items():
            mod = getattr(torch, kind)
            for index in indices:
                self.devices.append((mod, index, mod.get_rng_state(index)))
        try:
            torch.default_generator.manual_seed(seed)
            for mod, index, _ in self.devices:
                generators = getattr(mod, "default_generators", None)
                if generators is not None and index < len(generators):
                    generators[index].manual_seed(seed)
                else:
                    with mod.device(index):
                        mod.manual_seed(seed)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for mod, index, state in self.devices:
            mod.set_rng_state(state, index)


class RankFork:
    """The forward pre-hook and (always-called) forward hook that run one wired model's CP forwards under
    its rank's forked random state. Per model, closed over its step carrier; nothing global."""

    def __init__(self, carrier):
        self.carrier = carrier
        self._open: list[_Fork | None] = []

    def pre(self, module, args, kwargs):
        batch = kwargs.get(BATCH_KWARG) or self.carrier.current
        if batch is None or not module.training:
            self._open.append(None)   # not a CP forward, or nothing draws (eval): the shared stream
            return None
        base = getattr(batch, "rng_seed", None)
        if base is None:   # the step's first training forward draws the step's seed (a CPU read, no device sync)
            base = batch.rng_seed = step_seed()
        index = self.carrier.forks
        self.carrier.forks += 1
        self._open.append(_Fork(fork_seed(base, batch.rank, index), _devices(module, kwargs)))
        return None

    def post(self, module, args, kwargs, output):
        fork = self._open.pop() if self._open else None
        if fork is not None:
            fork.restore()
        return None


def install(module, carrier) -> list:
    """Fork the random state per CP rank around ``module``'s forwards (the model; a VLM's language model).
    Returns the hook handles (``remove()`` undoes). The restoring hook is ``always_call``: a forward that
    raises still gets the shared stream back."""
    fork = RankFork(carrier)
    return [module.register_forward_pre_hook(fork.pre, with_kwargs=True),
            module.register_forward_hook(fork.post, with_kwargs=True, always_call=True)]
