"""The token-mixing check: the computation CP runs, shown per-token outside what ringmaster routes.

CP is exact when everything that mixes tokens goes through what ringmaster routes: the attention
modules, the recurrent layers it wires, the declared self-attention sites, the position tables it
numbers. Everything else on the path from the embeddings to the loss runs on the rank's shard alone, so
it must be per-token: a module nobody registered, code in a decoder layer's own ``forward``, a
position or a scale computed from the local length, a loss that is not a sum over tokens would
otherwise train silently wrong.

**What runs.** On the first CP forward of each mode (training, eval), after the model's forward and before
anything can use its loss, each rank re-runs its own **decoder** (the module that takes the shard and feeds
the head: the base model, a VLM's language model) on its real inputs, at its real length, in the real mode,
with what ringmaster routes standing in per token: CP attention answers each token from its own q, k, v
(``CPBatch.stand_in``: the attention module around the call runs as it is); modules that compute attention
themselves, recurrent layers and towers are swapped out for ``tanh`` of their token input (plus a per-token
function of their other floating inputs: the rotary they are given), shaped as their real output; position
and rotary tables replay their real outputs. With routed work taken out, the decoder must be per-token. Three tests, no collective, no grad:

- **before/after the cut** (two runs at the real length): the tokens of ``[0, c)`` are changed, and the
  outputs on ``[c, S)`` must not move; then ``[c, S)`` changed and ``[0, c)`` must not move (``c = S // 2``,
  ``S`` the rank's own shard length: uneven under ``load_balance="documents"``). Any lag, any direction, any
  length-conditional or training-only path is seen; a per-token decoder gives bit-equal rows (a GEMM row
  does not read other rows), so the tolerance is tight;
- **a suffix** (one run on ``[c, S)``): a position or scale read from the local length moves its outputs;
- **the loss** (the model's head and loss on the first :data:`LOSS_WINDOW` tokens and on two pieces of
  them, the decoder replayed by its real output): the loss must be a sum over tokens (the pieces add up to
  the whole, with ``num_items_in_batch`` as ringmaster passes it) and the logits per-token.

Dropout functions are the identity during the check (:class:`_NoDropout`: a per-element mask is per-token;
draws shared along the sequence are :mod:`.generic`'s concern) and every run starts from the step's random
state, so other draws repeat. The verdicts are agreed over the CP group (one all-reduce of a flag): a failure
raises on every rank, naming the innermost module whose inputs agree and whose outputs do not (or the
decoder's own code), its class and source line, what was measured and the fix. The check's runs are eager
(:class:`ringmaster.compat.Eager`), so its runs at other lengths never compile; where the blocks are
compiled, the first forward of a mode runs compiled and the check records an eager replay of it
(:func:`ringmaster.compat.eager_replay`) before its runs. The report says what was checked, at which length, in how long.
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import compat, per_token
from ..comm import collective_device
from ..errors import UnsupportedLayerError
from ..sharding.carrier import holding
from ..sharding.documents import BATCH_KWARG, CPBatch

LOSS_WINDOW = 64       # tokens the loss check runs the head and loss on (one target lost at a cut: 1/64 off)
TRACE_POSITIONS = 8    # positions a failure is traced at, module by module
# the surrounded run differs from the shard's by GEMM blocking only (the same rows, more of them)
SURROUND_TOL, SURROUND_TOL_16 = 1e-3, 5e-2
LOSS_TOL, LOSS_TOL_16 = 1e-5, 5e-3

_DROPOUTS = frozenset(f for f in (
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
    getattr(torch, "native_dropout", None)) if f is not None)


class _LossProblem(str):
    """What the loss test found: its refusal names the loss's keys and their fix, not the token-mixing one."""


MIXING_FIX = ("Fix: make it per-token (positions from the position_ids ringmaster passes, no statistic over the "
              "sequence), or register the family with an ArchitectureSpec that routes it "
              "(rm.register_architecture(spec, override=True): its attention classes, a declared self-attention "
              "site, a recurrent kind), or refuse it (ArchitectureSpec(refuse=...))")
LOSS_FIX = ("Fix: the model's forward must hand its loss the shift_labels and num_items_in_batch ringmaster puts in "
            "each shard's kwargs (the full row's targets cut for the rank, and the group's target count / CP size), "
            "and the loss must be a sum over those targets divided by num_items_in_batch: do not shift labels "
            "inside the shard nor take a mean over it. A forward that wraps the head and loss (a fused or custom "
            "loss, Liger's fused linear cross entropy, a patched forward) must pass both keys through")


class _NoDropout(TorchFunctionMode):
    """Dropout functions return their input (``native_dropout`` its input and an all-true mask)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            x = args[0] if args else kwargs["input"]
            return (x, torch.ones_like(x, dtype=torch.bool)) if func is getattr(torch, "native_dropout", None) else x
        return func(*args, **kwargs)


class _Stop(Exception):
    def __init__(self, value):
        super().__init__("stopped")
        self.value = value


def seq_dim(t: torch.Tensor, n: int) -> int | None:
    """The sequence dimension of a tensor of a call over ``n`` tokens: ``[B, n, ...]``, ``[n, ...]`` or a
    multimodal rope's ``[3|4, B, n]``; None when it has none."""
    if t.dim() >= 2 and t.shape[1] == n:
        return 1
    if t.dim() >= 1 and t.shape[0] == n:
        return 0
    if t.dim() == 3 and t.shape[0] in (3, 4) and t.shape[2] == n:
        return 2
    return None


def take(obj: Any, n: int, segments) -> Any:
    """Every tensor of ``obj`` over ``n`` tokens, cut to ``segments`` (``[(start, stop), ...]``) along its
    sequence dimension, the pieces concatenated in that order."""
    def one(t):
        d = seq_dim(t, n)
        if d is None:
            return t
        if len(segments) == 1 and segments[0] == (0, n):
            return t
        parts = [t.narrow(d, a, b - a) for a, b in segments]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=d)
    return per_token.map_tensors(obj, one)


def _outputs(obj: Any, n: int) -> list[tuple[torch.Tensor, int]]:
    """The floating tensors of an output over ``n`` tokens, each with its sequence dimension."""
    out = []
    for t in per_token.tensors(obj):
        d = seq_dim(t, n)
        if d is not None and t.is_floating_point():
            out.append((t, d))
    return out


def _loss_of(output) -> Any:
    """A model output's ``loss`` (a ModelOutput, a dict or any object with the attribute), else None."""
    return output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)


def _where(fn) -> str:
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", repr(fn))


@dataclass
class _Meta:
    """A routed module's real output tensor over the shard: what its stand-in must look like."""
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    dim: int


def _primary(args: tuple, kwargs: dict, n: int) -> tuple[torch.Tensor, int] | tuple[None, None]:
    """A routed module's token input: ``hidden_states`` (or ``x``) when passed by name, else the first
    floating tensor over ``n`` tokens."""
    named = [kwargs[k] for k in ("hidden_states", "hidden_state", "x", "input") if isinstance(kwargs.get(k), torch.Tensor)]
    for t in named + per_token.tensors(args) + per_token.tensors(kwargs):
        if t.is_floating_point() and seq_dim(t, n) in (0, 1):
            return t, seq_dim(t, n)
    return None, None


def _side_inputs(args: tuple, kwargs: dict, n: int, x: torch.Tensor | None) -> torch.Tensor | None:
    """``[n]``: a per-token function of a routed call's other floating inputs over its tokens (the rotary
    ``(cos, sin)`` it is given), so that what the model feeds a routed module from the local length shows."""
    total = None
    for t in per_token.tensors(args) + per_token.tensors(kwargs):
        if t is x or not t.is_floating_point():
            continue
        d = seq_dim(t, n)
        if d not in (0, 1):
            continue
        z = torch.tanh(t.detach().float().movedim(d, 0).reshape(n, -1).mean(-1))
        total = z if total is None else total + z
    return total


def _per_token_like(meta: _Meta, x: torch.Tensor | None, xdim: int | None, n: int) -> torch.Tensor:
    """A tensor shaped as ``meta`` over ``n`` tokens whose every token is a function of that token's ``x``."""
    shape = list(meta.shape)
    shape[meta.dim] = n
    if not meta.dtype.is_floating_point or x is None:
        return torch.zeros(shape, dtype=meta.dtype, device=meta.device)
    if list(x.shape) == shape and xdim == meta.dim:
        return torch.tanh(x).to(meta.dtype)
    z = torch.tanh(x.float().flatten(xdim + 1).mean(-1))          # [B, n] or [n]
    if xdim == 1 and meta.dim == 1 and z.shape[0] == shape[0]:
        z = z.view(shape[0], n, *[1] * (len(shape) - 2))
    else:
        z = (z.reshape(-1, n).mean(0) if xdim == 1 else z.reshape(n))
        z = z.view(*[1] * meta.dim, n, *[1] * (len(shape) - meta.dim - 1))
    return z.expand(shape).to(meta.dtype).contiguous()


@dataclass
class _Routed:
    """What one routed module did in the real forward: per call, its output (replayed tables) or the shape of
    its output (stand-ins)."""
    module: nn.Module
    replay: bool
    calls: list = field(default_factory=list)
    index: int = 0


class _StandIn(nn.Module):
    """A routed module's place during a check run: ``fn`` instead of its forward and its hooks (a position
    table's steering, FSDP's or DeepSpeed's gathers); its other attributes read through to it."""

    def __init__(self, original: nn.Module, fn: Callable):
        super().__init__()
        object.__setattr__(self, "_original", original)   # not a child: no parameters of its own
        object.__setattr__(self, "_fn", fn)

    def forward(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


class _StandIns:
    """During a check run: every routed module swapped, in every parent that holds it, for its stand-in (and
    put back)."""

    def __init__(self, root: nn.Module, routed: dict[str, _Routed], length: int):
        self.root, self.routed, self.length = root, routed, length
        self.segments = [(0, length)]

    def _forward(self, entry: _Routed, path: str) -> Callable:
        def forward(*args, **kwargs):
            n = sum(b - a for a, b in self.segments)
            call = entry.calls[min(entry.index, len(entry.calls) - 1)] if entry.calls else None
            entry.index += 1
            if entry.replay:
                if call is None:
                    raise RuntimeError(f"{path}: not called in the CP forward, so it cannot be replayed")
                return take(call, self.length, self.segments)
            x, xdim = _primary(args, kwargs, n)
            if call is None:
                if x is None:
                    raise RuntimeError(f"{path}: not called in the CP forward and no token input to stand in from")
                return torch.tanh(x)
            signal = _side_inputs(args, kwargs, n, x)

            def like(m):
                if not isinstance(m, _Meta):
                    return m
                out = _per_token_like(m, x, xdim, n)
                if signal is not None and out.is_floating_point():
                    out = out + signal.view(*[1] * m.dim, n, *[1] * (out.dim() - m.dim - 1)).to(out.dtype)
                return out
            return per_token.map_leaves(call, like)
        return forward

    def __enter__(self):
        by_id = {}
        for path, entry in self.routed.items():
            entry.index = 0
            by_id[id(entry.module)] = _StandIn(entry.module, self._forward(entry, path))
        self.swapped = [(parent, name, child) for parent in self.root.modules()
                        for name, child in parent.named_children() if id(child) in by_id]
        for parent, name, child in self.swapped:
            setattr(parent, name, by_id[id(child)])
        return self

    def __exit__(self, *exc):
        for parent, name, child in self.swapped:
            setattr(parent, name, child)
        self.swapped = []


class MixingCheck:
    """The first CP forward's token-mixing check of one wired model (per mode)."""

    def __init__(self, model: nn.Module, decoder: str, routed: dict[str, nn.Module], replayed: set[str],
                 group, carrier, report=None, loss: bool = True, surround: bool = True):
        """``routed``: path -> module of what ringmaster routes that the check swaps out (recurrent layers,
        self-attention sites, towers), ``replayed`` the paths among them replayed (tables). Attention modules
        that call the attention interface are not among them: they run, and CP attention answers per token."""
        # loss: run the loss test (not for a VLM, nor a loss ringmaster rescales itself); surround: run the
        # decoder on the shard among other tokens (not for a VLM's language model, whose image features are
        # gathered per shard, nor a family whose per-row count a declared batch rule makes exact: xlm)
        self.loss, self.surround = loss, surround
        self.model, self.decoder_path, self.group, self.carrier, self.report = model, decoder, group, carrier, report
        self.decoder = model.get_submodule(decoder) if decoder else model
        prefix = decoder + "." if decoder else ""
        # the routed modules inside the decoder, outermost only
        inside = {p: m for p, m in routed.items() if (p.startswith(prefix) or not decoder) and p != decoder}
        self.routed = {p: _Routed(m, replay=p in replayed) for p, m in inside.items()
                       if not any(q != p and p.startswith(q + ".") for q in inside)}
        self.done: set[bool] = set()       # the modes checked
        self.handles: list = []            # the model's hooks, until both modes are checked
        self.step_handles: list = []       # during a first CP forward of a mode only
        self.active: dict | None = None    # that forward's record
        self.eager = compat.Eager()        # the model's compiled blocks run eagerly during a first CP forward
        self.results: dict[bool, str] = {}
        self.seconds: dict[bool, float] = {}   # the check's wall time per mode (the report rounds it)
        self.loss_seconds: dict[bool, float] = {}   # of it, the loss test's (benchmarks/token_mixing.py)

    # ---- the first CP forward of a mode: record
    def begin(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if model.training in self.done:
            return
        batch = self.carrier.batch(kwargs)
        if batch is None:
            return   # a forward without CP: the check waits for the first CP one
        length = batch.local_len   # uneven over the group under load_balance="documents"
        self.active = {"mode": model.training, "batch": batch, "length": length, "model_call": (args, dict(kwargs)),
                       "decoder_call": None, "decoder_out": None, "deferred": compat.has_compiled_blocks(model)}
        if self.active["deferred"]:
            return   # the forward runs compiled: finish() records an eager replay of it (no hook in a compiled block)
        self.eager.start(model)
        self._record_step(length)

    def _record_step(self, length: int) -> None:
        """Hook the routed modules (and the decoder) to record the first CP forward's calls."""
        for path, entry in self.routed.items():
            def record(module, args, output, entry=entry):
                if self.active is None or self.active.get("inside"):
                    return
                if entry.replay:
                    entry.calls.append(per_token.map_tensors(output, lambda t: t.detach()))
                else:
                    def meta(t):
                        d = seq_dim(t, length)
                        return _Meta(tuple(t.shape), t.dtype, t.device, d) if d is not None else t.detach()
                    entry.calls.append(per_token.map_tensors(output, meta))
            self.step_handles.append(entry.module.register_forward_hook(record))
        if self.decoder is not self.model:
            def pre(module, args, kwargs):
                if self.active is not None and not self.active.get("inside") and self.active["decoder_call"] is None:
                    self.active["decoder_call"] = (args, dict(kwargs))

            def post(module, args, kwargs, output):
                if self.active is not None and not self.active.get("inside") and self.active["decoder_out"] is None:
                    self.active["decoder_out"] = output
            self.step_handles += [self.decoder.register_forward_pre_hook(pre, with_kwargs=True),
                                  self.decoder.register_forward_hook(post, with_kwargs=True)]

    def end_forward(self) -> None:
        """After a first CP forward (passed, refused or raised): the step's hooks off, the stance back."""
        self.active = None
        for handle in self.step_handles:
            handle.remove()
        self.step_handles = []
        for entry in self.routed.values():
            entry.calls = []
        self.eager.stop()

    # ---- after it: check, agree, refuse or record
    def finish(self, output) -> None:
        rec = self.active
        if rec is None:
            return
        started = time.perf_counter()
        if rec["deferred"]:   # the forward ran compiled: record it again, eagerly, without grad
            self.eager.start(self.model)   # the check's runs at other lengths never compile
            self._record_step(rec["length"])
            args, kwargs = rec["model_call"]
            compat.eager_replay(self.model, args, kwargs)
        rec["inside"] = True
        problem, bad = self._check(rec, output)
        spent = time.perf_counter() - started
        if bad:
            self.end_forward()
            why = problem if problem is not None else f"rank {bad - 1} of the CP group found token mixing (see its error)"
            raise UnsupportedLayerError(
                "ringmaster's token-mixing check (first CP forward in "
                f"{'training' if rec['mode'] else 'eval'} mode, before any backward; the loss must not be used): "
                f"{why}. Under CP each rank runs it on its shard alone, so the result is not the single-device one. "
                + (LOSS_FIX if isinstance(problem, _LossProblem) else MIXING_FIX))
        self.done.add(rec["mode"])
        note = (f"{self._name(self.decoder_path, self.decoder)} shown per-token at its {rec['length']}-token shard in "
                f"{'training' if rec['mode'] else 'eval'} mode (CP attention answering per token, {len(self.routed)} "
                f"routed modules swapped out) in "
                f"{1e3 * spent:.0f} ms")
        self.results[rec["mode"]], self.seconds[rec["mode"]] = note, spent
        if self.report is not None:
            self.report.token_probe = "; ".join(self.results[m] for m in sorted(self.results, reverse=True))
        self.end_forward()
        if len(self.done) == 2:
            self.disarm()

    def _agree(self, failed: bool) -> int:
        """0 when no rank of the group failed, else 1 + the highest failing rank (one all-reduce)."""
        flag = torch.tensor([self._rank() + 1 if failed else 0], dtype=torch.int32)
        if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            flag = flag.to(collective_device(self.group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)   # every rank refuses alike
            flag = flag.cpu()
        return int(flag.item())

    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None and dist.is_initialized() else 0

    @staticmethod
    def _name(path: str, module: nn.Module) -> str:
        return f"{path or 'the model'!r} ({type(module).__name__})"

    # ---- the runs
    def _devices(self, obj) -> list[int]:
        return sorted({t.device.index or 0 for t in per_token.tensors(obj) if t.device.type == "cuda"})

    def _run(self, fn: Callable, segments: list, length: int, state, routed: dict | None = None) -> Any:
        """``fn()`` with the routed modules (or ``routed``) standing in over ``segments`` of the shard, dropout
        off, from the step's random state."""
        torch.set_rng_state(state[0])
        for d, s in state[1]:
            torch.cuda.set_rng_state(s, d)
        stand = _StandIns(self.model, self.routed if routed is None else routed, length)
        stand.segments = segments
        with stand, _NoDropout():
            return fn()

    def _check(self, rec: dict, output) -> tuple[str | None, int]:
        """Every rank runs the same runs whatever it finds (a run may gather parameters: FSDP2, ZeRO-3), agrees,
        and when any rank failed every rank runs one trace of two runs. Returns this rank's finding and the
        agreed flag."""
        length = rec["length"]
        if self.decoder is self.model or rec["decoder_call"] is None:
            call, decoder, path = rec["model_call"], self.model, ""
        else:
            call, decoder, path = rec["decoder_call"], self.decoder, self.decoder_path
        rec["per_token"] = rec["batch"].per_token()
        args, kwargs = self._per_token_batch(call, rec["per_token"])
        key, token = self._token_input(args, kwargs, length)
        devices = self._devices((args, kwargs))
        with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings(), \
                holding([self.carrier], rec["per_token"]):
            warnings.simplefilter("ignore")
            state = (torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices])
            if token is None:
                return None, self._agree(False)
            other = self._changed(token)
            d = 1 if token.dim() > 1 else 0

            def run(plan):
                """The decoder over ``plan``: shard segments ``(start, stop, changed)`` one after another, the
                changed ones with other tokens."""
                segments = [(a, b) for a, b, _ in plan]
                a, k = take((args, kwargs), length, segments)
                tokens = torch.cat([(other if changed else token).narrow(d, s, e - s) for s, e, changed in plan], d)
                a, k = self._with_token(a, k, key, tokens)

                def fn():
                    try:
                        return decoder.forward(*a, **k)
                    except _Stop as stop:
                        return stop.value
                return _outputs(self._run(fn, segments, length, state), sum(e - s for s, e in segments))
            head = self._head_stop(decoder)
            try:
                found, trace = self._tests(run, length, decoder, path)
                if self.loss and isinstance(_loss_of(output), torch.Tensor) and decoder is not self.model \
                        and rec["decoder_out"] is not None:
                    started = time.perf_counter()
                    loss = self._loss_test(rec, length, state)
                    self.loss_seconds[rec["mode"]] = time.perf_counter() - started
                    found = found if found is not None else loss
                bad = self._agree(found is not None)
                if bad:   # every rank traces (its own failure, or the shard against itself): the same runs
                    try:
                        where = self._trace(run, *(trace or ([(0, length, False)], [0], 0, per_token.TOL)), decoder,
                                            path)
                    except Exception as exc:   # the finding stands; only its place is unknown
                        where = f"the decoder {self._name(path, decoder)} (not traced: {type(exc).__name__})"
                    if found is not None and trace is not None:
                        found = f"{where}: {found}"
            finally:
                if head is not None:
                    head.remove()
        return found, bad

    @staticmethod
    def _per_token_batch(call: tuple, batch: CPBatch) -> tuple:
        """The call with its ``ringmaster_batch`` (if it passes one) replaced by the check's ``batch``
        (``CPBatch.per_token``): CP attention then answers per token, and the attention module's own code runs as
        it is."""
        args, kwargs = call
        if isinstance(kwargs.get(BATCH_KWARG), CPBatch):
            kwargs = dict(kwargs)
            kwargs[BATCH_KWARG] = batch
        return args, kwargs

    def _head_stop(self, decoder: nn.Module):
        """With the whole model as the decoder: stop its forward at the head's input (no logits)."""
        if decoder is not self.model or not hasattr(self.model, "get_output_embeddings"):
            return None
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Module):
            return None

        def pre(module, args):
            raise _Stop(args[0] if args else None)
        return head.register_forward_pre_hook(pre)

    @staticmethod
    def _token_input(args: tuple, kwargs: dict, length: int):
        for key in ("input_ids", "inputs_embeds"):
            t = kwargs.get(key)
            if isinstance(t, torch.Tensor) and seq_dim(t, length) == 1:
                return key, t
        for i, t in enumerate(args):
            if isinstance(t, torch.Tensor) and seq_dim(t, length) in (0, 1):
                return i, t
        return None, None

    def _vocab(self) -> int | None:
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        return getattr(emb, "num_embeddings", None) or getattr(getattr(self.model, "config", None), "vocab_size", None)

    def _special_ids(self) -> set[int]:
        """The config's special token ids (``*_token_id``, ``*_index``): padding, BOS/EOS, image placeholders."""
        found: set[int] = set()
        configs = [getattr(self.model, "config", None)]
        configs += [getattr(configs[0], k, None) for k in ("text_config", "decoder")] if configs[0] is not None else []
        for config in configs:
            for name, value in (vars(config).items() if config is not None else ()):
                if name.endswith(("_token_id", "_token_ids", "_index", "_id")) and not isinstance(value, bool):
                    for v in value if isinstance(value, (list, tuple)) else [value]:
                        if isinstance(v, int):
                            found.add(v)
        return found

    def _changed(self, token: torch.Tensor) -> torch.Tensor:
        """Other tokens at every position: the next ordinary id (special ids, such as padding that a model counts
        over the row, stay as they are and are never made), embeddings random at their scale."""
        if token.is_floating_point():
            scale = float(token.float().std()) if token.numel() > 1 else 1.0
            g = torch.Generator(device="cpu").manual_seed(1234)
            return torch.randn(token.shape, generator=g).to(token) * max(scale, 1e-3)
        vocab = self._vocab() or int(token.max()) + 2
        special = torch.tensor(sorted(self._special_ids()), dtype=token.dtype, device=token.device)
        out = token.clone()
        todo = ~torch.isin(token, special)
        for k in range(1, len(special) + 2):   # the first ordinary id after it
            candidate = (token + k) % vocab
            ok = todo & ~torch.isin(candidate, special)
            out = torch.where(ok, candidate, out)
            todo = todo & ~ok
        return out

    @staticmethod
    def _with_token(args, kwargs, key, value):
        if isinstance(key, int):
            args = tuple(value if i == key else a for i, a in enumerate(args))
        else:
            kwargs = dict(kwargs)
            kwargs[key] = value
        return args, kwargs

    def _tests(self, run, length: int, decoder: nn.Module, path: str) -> tuple[str | None, tuple | None]:
        """The base run and the three test runs, all of them; the first failure and what its trace needs."""
        c = length // 2
        base = [(0, length, False)]
        tests = [
            ([(0, c, True), (c, length, False)], 1, True,
             f"with the tokens of [0, {c}) of the rank's {length}-token shard changed, its outputs on [{c}, {length}) "
             "moved"),
            ([(0, c, False), (c, length, True)], 0, True,
             f"with the tokens of [{c}, {length}) of the rank's {length}-token shard changed, its outputs on [0, {c}) "
             "moved"),
            ([(0, length, True), (0, length, False), (0, length, True)], 1, False,
             f"run on the rank's {length}-token shard between two other {length}-token stretches (as one device runs "
             "it, among the other ranks' tokens), its outputs on the shard moved"),
        ][:3 if self.surround else 2]
        outputs = []
        for plan in [base] + [t[0] for t in tests]:
            try:
                outputs.append(run(plan))
            except Exception as exc:   # every run is tried: each rank runs the same ones
                outputs.append(exc)
        whole = outputs[0]
        for out in outputs:
            if isinstance(out, Exception):
                return (f"the decoder {self._name(path, decoder)} does not run on the check's inputs "
                        f"({type(out).__name__}: {str(out).splitlines()[0][:200] if str(out) else ''}), so it cannot "
                        "be shown per-token"), None
        if not whole:
            return None, None
        dtype = whole[0][0].dtype
        for (plan, kept, tight, what), moved in zip(tests, outputs[1:]):
            tol = per_token.tolerance(dtype) if tight else (
                SURROUND_TOL if dtype in (torch.float32, torch.float64) else SURROUND_TOL_16)
            offset = sum(e - s for s, e, _ in plan[:kept])
            span = plan[kept][:2]
            err, where = _compare(whole, moved, span, offset)
            if not err <= tol:
                return (f"{what} (relative {err:.1e}, tolerance {tol:.0e}): it mixes tokens (a statistic, scan, "
                        "convolution, window or attention over the sequence, at any lag or only above some length), or "
                        "numbers or scales them by the local length (arange(seq_len), a length-dependent scale)"), \
                    (plan, where, offset - span[0], tol)
        return None, None

    def _loss_test(self, rec: dict, length: int, state) -> str | None:
        """The model's own head and loss on a window of the shard, the decoder replayed by its real output."""
        args, kwargs = self._per_token_batch(rec["model_call"], rec["per_token"])
        if not _outputs(rec["decoder_out"], length):
            return None
        if "_ringmaster_router" in vars(self.model):
            # the MoE router loss is a statistic of the whole sequence by design, which rm.wire sums over the group
            # (sharding/router.py: this model's forward is re-bound for it); what must be a sum over tokens is the
            # rest of the loss. A router loss rm.wire did not route stays in the test (and fails it)
            kwargs = {**kwargs, "output_router_logits": False}
        w = min(length, LOSS_WINDOW)
        if w < 2:
            return None
        c = w // 2
        # the decoder replays its real output, as the tables do
        decoder = {self.decoder_path: _Routed(self.decoder, replay=True,
                                              calls=[per_token.map_tensors(rec["decoder_out"], lambda t: t.detach())])}
        results = []
        for lo, hi in ((0, w), (0, c), (c, w)):
            a, k = take((args, kwargs), length, [(lo, hi)])
            try:   # every run is tried: each rank runs the same ones
                o = self._run(lambda: self.model.forward(*a, **k), [(lo, hi)], length, state, routed=decoder)
            except Exception as exc:
                results.append(exc)
                continue
            # the decoder's router logits pass through the head replayed ([tokens, experts]: a token dim that the
            # expert count may equal), so they are not the head's outputs
            head = {k: v for k, v in o.items() if k != "router_logits"} if isinstance(o, dict) else o
            results.append((_loss_of(o), _outputs(head, hi - lo)))
        where = vars(self.model).get("forward") or type(self.model).forward   # an instance's patched forward
        for r in results:
            if isinstance(r, Exception):
                return (f"the head and loss of {self._name('', self.model)} (forward at {_where(where)}) do not run on a "
                        f"piece of the shard ({type(r).__name__}: {str(r).splitlines()[0][:200] if str(r) else ''}), so "
                        "the loss cannot be shown to be a sum over tokens")
        (whole_loss, whole), (l1, p1), (l2, p2) = results
        fp32 = whole[0][0].dtype in (torch.float32, torch.float64) if whole else True
        if whole and p1 and p2:
            pieces = [(torch.cat([u, v], dim=d), d) for (u, d), (v, _) in zip(p1, p2)]
            err, _ = _compare(whole, pieces, (0, w), 0)
            tol = per_token.tolerance(whole[0][0].dtype)
            if not err <= tol:
                return (f"the head of {self._name('', self.model)} (forward at {_where(where)}): its outputs on "
                        f"{w} tokens differ from those on two pieces of them (relative {err:.1e}): the head mixes "
                        "tokens or numbers them from the local length")
        if isinstance(whole_loss, torch.Tensor) and isinstance(l1, torch.Tensor) and isinstance(l2, torch.Tensor):
            total, parts = whole_loss.double(), l1.double() + l2.double()
            if not (torch.isfinite(total) or torch.isfinite(l1) or torch.isfinite(l2)):
                return None   # no target to weigh (0/0 everywhere): nothing to compare
            err = float((total - parts).abs()) / max(float(total.abs()), 1e-12)
            tol = LOSS_TOL if fp32 else LOSS_TOL_16
            if not err <= tol:
                return _LossProblem(
                    f"the loss of {self._name('', self.model)} (forward at {_where(where)}): on the first {w} "
                    f"tokens of the shard it is {float(total):.6g}, on two pieces of them {float(l1):.6g} + "
                    f"{float(l2):.6g} (relative {err:.1e}, tolerance {tol:.0e}): under CP the rank losses add up to "
                    "the model's loss only if it is a sum over tokens divided by the num_items_in_batch ringmaster "
                    "passes, with the shift_labels it passes (a mean over the shard, labels shifted inside the "
                    "shard, or a statistic over the sequence in the loss is not)")
        return None

    def _trace(self, run, plan, where: list[int], shift: int, tol: float, decoder: nn.Module, path: str) -> str:
        """Re-run the base and the failing plan recording every module's inputs and outputs at the row positions
        ``where`` (``p + shift`` in the failing run): the innermost module whose inputs agree and whose outputs
        do not, else the decoder's own code."""
        modules = {}
        for name, m in decoder.named_modules():
            full = f"{path}.{name}" if path and name else (name or path)
            if not name or any(full == r or full.startswith(r + ".") for r in self.routed):
                continue
            modules[full] = m

        def traced(plan, positions):
            n = sum(e - s for s, e, _ in plan)
            pos = torch.tensor(positions)
            seen: dict[tuple[str, int], tuple] = {}
            counts: dict[str, int] = {}

            def digest(obj):
                return [t.index_select(d, pos.to(t.device)).double().cpu()
                        for t in per_token.tensors(obj) if (d := seq_dim(t, n)) is not None]
            handles = []
            for name, m in modules.items():
                def hook(module, args, kwargs, output, name=name):
                    k = counts.get(name, 0)
                    counts[name] = k + 1
                    seen[(name, k)] = (digest((args, kwargs)), digest(output))
                handles.append(m.register_forward_hook(hook, with_kwargs=True))
            try:
                run(plan)
            finally:
                for h in handles:
                    h.remove()
            return seen
        base_plan = [(0, max(e for _, e, _ in plan), False)]
        a, b = traced(base_plan, where), traced(plan, [p + shift for p in where])

        def same(x, y):
            if len(x) != len(y):
                return False
            for u, v in zip(x, y):
                if u.shape != v.shape:
                    return False
                if u.numel() and float((u - v).abs().max()) > tol * max(float(u.abs().max()), 1e-30):
                    return False
            return True
        culprits = [name for (name, k) in a if (name, k) in b and same(a[(name, k)][0], b[(name, k)][0])
                    and not same(a[(name, k)][1], b[(name, k)][1])]
        names = set(culprits)
        inner = [n for n in dict.fromkeys(culprits) if not any(o != n and o.startswith(n + ".") for o in names)]
        if not inner:
            return f"the decoder {self._name(path, decoder)}, in its own forward at {_where(type(decoder).forward)}"
        parts = []
        for n in inner[:3]:
            m = modules[n]
            leaf = not any(o.startswith(n + ".") for o in modules if o != n)
            kind = "forward" if leaf else "own forward, between its children"
            parts.append(f"module {n!r} ({type(m).__name__}, {kind} at {_where(type(m).forward)})")
        return "; ".join(parts)

    # ---- hooks
    def disarm(self) -> None:
        self.end_forward()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _compare(whole: list, other: list, span: tuple[int, int], offset: int) -> tuple[float, list[int]]:
    """The worst relative difference of ``other``'s outputs at ``offset...`` against ``whole``'s on the row
    positions ``span``, and the row positions it is worst at."""
    a, b = span
    worst, where = 0.0, [a]
    for (u, d), (v, _) in zip(whole, other):
        uu = u.narrow(d, a, b - a).double()
        if v.dim() <= d or v.shape[d] < offset + b - a:
            return float("inf"), [a]
        vv = v.narrow(d, offset, b - a).double()
        if uu.shape != vv.shape:
            return float("inf"), [a]
        diff = (uu - vv).abs()
        err = float(diff.max()) / max(float(u.abs().max()), 1e-30) if diff.numel() else 0.0
        if err > worst:
            worst = err
            per_pos = diff.movedim(d, 0).reshape(diff.shape[d], -1).amax(-1)
            top = per_pos.topk(min(TRACE_POSITIONS, per_pos.numel())).indices
            where = sorted(a + int(i) for i in top)
    return worst, where


def decoder_path(model: nn.Module, spec) -> str:
    """The module that takes the shard and feeds the head: a VLM's language model, the base model, else the
    model itself ("")."""
    if spec.multimodal:
        return spec.language_model
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for path, m in model.named_modules():
        if m is base:
            return path
    return ""


def arm(check: MixingCheck, model: nn.Module) -> None:
    """Hook ``model``'s first CP forward of each mode (its pre-hook first of all, its post-hook last of all, so
    the eager stance nests around the attention accounting's and the check runs after its ledger closed)."""

    @torch.compiler.disable
    def pre(module, args, kwargs):
        if check.active is None:
            check.begin(module, args, kwargs)

    @torch.compiler.disable
    def post(module, args, kwargs, output):
        if check.active is not None:
            check.finish(output)

    @torch.compiler.disable
    def restore(module, *args):   # always: a forward that raised leaves no step hook and the stance as it found it
        check.end_forward()

    check.handles = [model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
                     model.register_forward_hook(post, with_kwargs=True),
                     model.register_forward_hook(restore, always_call=True)]
