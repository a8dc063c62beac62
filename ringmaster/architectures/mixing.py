"""The token-mixing probe: every module ``rm.wire`` does not route must be shown per-token.

CP is exact when everything that mixes tokens goes through what ringmaster routes: the attention
modules, the recurrent layers it wires, the declared self-attention sites, the absolute position
tables it numbers, the vision towers it leaves whole. Everything else on the path from the embeddings
to the head runs on the rank's shard alone, so it must be per-token. A module nobody registered (a
remote-code attention that calls ``F.scaled_dot_product_attention`` itself, a wrapper that adds a
running mean over the sequence, a norm over the sequence, a position computed from the local length)
would otherwise train silently wrong.

``rm.wire`` lists the **candidates**: the largest subtrees of the model that hold no routed module,
minus the layers known to be per-token (``nn.Linear``, ``nn.Embedding``, the norms and activations
of ``torch.nn``, dropout). On the first CP forward each candidate's forward hook re-runs it on the
first :data:`TOKENS` positions of its real input and on two pieces of them
(:func:`ringmaster.per_token.split_probe`, no grad, eval mode: the probe ``rm.tiled_mlp`` uses), inside
the candidate's own forward (so an FSDP2 unit's parameters are gathered). Its verdicts are agreed over
the CP group (one all-reduce of a flag per candidate, once), and a module that mixes tokens, or that
cannot run on a piece of its input, raises on every rank before any backward, naming its path, class
and the fix. That first forward's compiled blocks run eagerly (:func:`ringmaster.compat.run_eagerly`, as
for the attention accounting). The cost is three forwards of :data:`TOKENS` tokens per candidate, once; the wiring
report says how many modules were probed and how long it took.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import compat, per_token
from ..comm import collective_device
from ..errors import UnsupportedLayerError

TOKENS, SPLIT = 16, 5
_SEQUENCE_SOFTMAX = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)
_PER_TOKEN = tuple(cls for cls in vars(nn.modules.activation).values()
                   if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module
                   and not issubclass(cls, _SEQUENCE_SOFTMAX)) + (
    nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Identity, nn.modules.dropout._DropoutNd)


def per_token_leaf(module: nn.Module) -> bool:
    """A torch layer that is per-token by construction (its class's forward is torch's own)."""
    forward = type(module).forward
    return isinstance(module, _PER_TOKEN) and getattr(forward, "__module__", "").startswith("torch.nn.modules.")


def _lineage(path: str):
    while path:
        yield path
        path = path.rpartition(".")[0]


def candidates(model: nn.Module, routed: Iterable[str]) -> dict[str, nn.Module]:
    """The largest subtrees of ``model`` holding no ``routed`` path (nor inside one), minus per-token
    torch layers; containers without a forward of their own and the blocks of a layer list are looked into
    (their children are candidates)."""
    routed = set(routed)
    holders = {p for r in routed for p in _lineage(r.rpartition(".")[0])}
    lists: set[str] = set()
    out: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if not path or any(p in routed or p in out for p in _lineage(path)):
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            lists.add(path)
            continue
        # a block of a layer list is looked into (its attention, MLP, norms: the error names the one that mixes)
        block = path.rpartition(".")[0] in lists and next(module.children(), None) is not None
        if path in holders or block or per_token_leaf(module):
            continue
        out[path] = module
    return out


class MixingProbe:
    """The first CP forward's per-token check of ``candidates`` (path -> module) of one wired model."""

    def __init__(self, candidates: dict[str, nn.Module], group, carrier, report=None):
        self.candidates, self.group, self.carrier, self.report = candidates, group, carrier, report
        self.armed = False
        self.length: int | None = None      # this forward's local length while a first CP forward runs
        self.results: dict[str, tuple[float, float] | str] = {}
        self.handles: list = []           # the model's hooks, until the first CP forward passes
        self.module_handles: list = []    # the candidates' hooks, during a first CP forward only
        self.stance = None
        self._inside = False
        self._spent = 0.0                 # seconds inside the probe's re-runs, this forward

    # ---- per candidate, inside its own forward
    def check(self, path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.length is None or self._inside or path in self.results:
            return
        length = self.length
        if per_token.sequence_dim(args, kwargs, length) is None:
            return   # no sequence-shaped input (a vision projector, a config lookup): not on the token path
        tokens = min(TOKENS, length)
        if tokens <= SPLIT:
            return
        started = time.perf_counter()
        modes = [(m, m.training) for m in module.modules()]
        module.eval()
        self._inside = True
        devices = sorted({t.device.index or 0 for t in per_token.tensors((args, kwargs)) if t.device.type == "cuda"})
        try:
            # the random state as it was: a checkpoint's recomputation (no probe then) draws the same masks
            with torch.random.fork_rng(devices=devices):
                err, whole, _ = per_token.split_probe(module, args, kwargs, length, tokens, SPLIT)
            dtype = next((t.dtype for t in whole if t.is_floating_point()), torch.float32)
            self.results[path] = (err, per_token.tolerance(dtype))
        except Exception as exc:   # cannot run on a piece of its input: not shown per-token
            self.results[path] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        finally:
            self._inside = False
            for m, mode in modes:
                m.training = mode
            self._spent += time.perf_counter() - started

    def problems(self, paths: list[str]) -> list[str]:
        out = []
        for path in paths:
            module = self.candidates[path]
            found = self.results.get(path)
            if isinstance(found, tuple):
                why = (f"its output on {TOKENS} tokens differs from its outputs on two pieces of them (relative "
                       f"{found[0]:.1e}): it mixes tokens (attention computed in the module, a running statistic or "
                       "norm over the sequence, a convolution) or numbers them from the local length")
            elif isinstance(found, str):
                why = f"it does not run on a piece of its input ({found}), so it cannot be shown per-token"
            else:
                why = "another rank of the CP group found it mixes tokens"
            out.append(f"module {path!r} ({type(module).__name__}): {why}")
        return out

    def failed(self) -> list[str]:
        return [p for p, r in self.results.items()
                if isinstance(r, str) or (isinstance(r, tuple) and not r[0] <= r[1])]

    # ---- the model's hooks
    def begin(self, model: nn.Module, kwargs: dict) -> None:
        batch = self.carrier.batch(kwargs)
        if batch is None:
            return   # a forward without CP: the probe waits for the first CP one
        self.length = batch.seq_len // batch.size
        self.results.clear()
        self._spent = 0.0
        if self.stance is None:
            self.stance = compat.run_eagerly(model)
        if not self.module_handles:   # the candidates are hooked for this forward only
            for path, module in self.candidates.items():
                def hook(module, args, kwargs, output, path=path):
                    self.check(path, module, args, kwargs)
                self.module_handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def end_forward(self) -> None:
        """After a first CP forward (passed, refused or raised): the candidates unhooked, the stance back."""
        self.length = None
        for handle in self.module_handles:
            handle.remove()
        self.module_handles = []
        self.compile_again()

    def finish(self) -> None:
        if self.length is None:
            return
        self.length = None
        paths = list(self.candidates)
        failed = set(self.failed())
        flags = torch.tensor([1 if p in failed else 0 for p in paths], dtype=torch.int32)
        if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1 and paths:
            flags = flags.to(collective_device(self.group))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)   # every rank refuses alike
            flags = flags.cpu()
        bad = [p for p, f in zip(paths, flags.tolist()) if f]
        if bad:
            problems = self.problems(bad)
            self.results.clear()
            self.end_forward()
            raise UnsupportedLayerError(
                "ringmaster's token-mixing probe (first CP forward, before any backward; the loss must not be used): "
                + "; ".join(problems) + ". Under CP each rank runs such a module on its shard alone, so the result "
                "is not the single-device one. Fix: make the module per-token, or register the family with an "
                "ArchitectureSpec that routes it (rm.register_architecture(spec, override=True): its attention "
                "classes, a declared self-attention site, a recurrent kind), or refuse it (ArchitectureSpec(refuse=...))")
        probed = len(self.results)
        if self.report is not None:
            self.report.token_probe = (f"{probed} of {len(paths)} unrouted modules shown per-token on {TOKENS} tokens "
                                       f"in {1e3 * self._spent:.0f} ms")
        self.disarm()

    def compile_again(self) -> None:
        if self.stance is not None:
            stance, self.stance = self.stance, None
            stance.__exit__(None, None, None)

    def disarm(self) -> None:
        self.armed = False
        self.end_forward()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def arm(probe: MixingProbe, model: nn.Module) -> None:
    """Hook ``model``'s first CP forward (its pre-hook first of all, its restoring post-hook last of all, so
    the eager stance nests around the attention accounting's); the candidates are hooked during that forward."""

    @torch.compiler.disable
    def pre(module, args, kwargs):
        if probe.armed:
            probe.begin(module, kwargs)

    @torch.compiler.disable
    def post(module, args, kwargs, output):
        if probe.armed:
            probe.finish()

    @torch.compiler.disable
    def restore(module, *args):   # always: a forward that raised leaves no hook and the stance as it found it
        probe.end_forward()

    probe.handles = [model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
                     model.register_forward_hook(post, with_kwargs=True),
                     model.register_forward_hook(restore, always_call=True)]
    probe.armed = bool(probe.candidates)
    if not probe.armed:
        probe.disarm()
