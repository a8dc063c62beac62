"""First-forward accounting: prove, once, that every attention module went through CP attention.

What ``rm.wire`` cannot see statically it checks on the first CP forward of a wired model: every
attention module must call the runtime's CP attention function at least once, every call with the
batch's global structure (``ringmaster_batch``) and without a mask the model built itself. A
decoder layer that drops ``**kwargs`` (the batch never reaches the attention), an attention
computed outside the interface (never called), or a mask built from the local ``cache_position``
or from the layer's own states (doge's dynamic mask; the CP kernels would ignore it) all raise
right after that forward, before any loss is backpropagated, naming the module and the fix.

A module may call the CP function several times per forward: differential attention calls it
twice per layer (diffllama, on the two halves of V), a recurrent-depth model runs the same layers
several times (hrm_text's H/L cycles). Each call is an ordinary CP attention over the rank's
shard (``require_batch`` and ``layer_rules`` check that per call, before any collective: the
batch, a call over the shard's length), so the composition is exact; the counts are kept in
``Ledger.repeated`` for the wiring report.

Absolute position tables are position-dependent modules too: each one ``rm.wire`` found
(:mod:`ringmaster.architectures.positions`) must be looked up exactly once in that forward, with
this shard's positions in the model's own numbering plus the table's offset
(:mod:`ringmaster.sharding.positions`); a table the shard step did not steer (positions from
the local length) raises the same way.

The ledger is bound at wire time to the runtime (the attention function is closed over it
through its :class:`~ringmaster.attention.binding.AttentionBinding`); nothing is a process
global. After the first forward passes, the hooks are removed and the CP function pays one
attribute read per call.

Where blocks are compiled, the first CP forward runs compiled too (forward and backward): a compiled block never
records (recording per module would specialise the block's graph on each layer, past dynamo's recompile limit
at the ninth block, and on the armed flag). The model's post-hook then replays that forward once, eagerly,
without grad and with the random state kept (:func:`ringmaster.compat.eager_replay`), and the ledger records
the replay: the same modules, calls, masks and table lookups, decided before the loss can be used.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import compat
from ..errors import UnsupportedLayerError
from ..sharding.documents import BATCH_KWARG


class Ledger:
    """Per-runtime record of which attention modules called the CP function in the current forward."""

    def __init__(self):
        self.armed = False
        self.paths: dict[int, str] = {}      # id(module) -> path, for the wired attention modules
        self.calls: dict[int, int] = {}
        self.masks: dict[int, str] = {}     # id(module) -> what it passed as attention_mask
        self.handles: list = []
        self.unexpected: list[str] = []
        self.repeated: dict[str, int] = {}  # path -> calls per forward, for modules called more than once
        self.positions = None                 # the PositionConvention of the model's absolute position tables
        self.tables: dict[int, tuple[str, nn.Module, int]] = {}   # id(table) -> (path, table, offset)
        self.lookups: dict[int, list] = {}    # id(table) -> what each call looked up (index, or output)
        self.eager = compat.Eager()           # the model's compiled blocks run eagerly while a first forward runs
        self.deferred = False                 # the first CP forward runs compiled: recorded by an eager replay

    # ---- called by the CP attention function (only while armed)
    def record(self, module, attention_mask) -> None:
        key = id(module)
        if key not in self.paths:
            self.unexpected.append(type(module).__name__)
            return
        self.calls[key] = self.calls.get(key, 0) + 1
        if attention_mask is not None:
            self.masks[key] = type(attention_mask).__name__

    def name(self, module) -> str:
        path = self.paths.get(id(module))
        return f"attention module {path!r} ({type(module).__name__})" if path else type(module).__name__

    # ---- the model's hooks
    def begin(self) -> None:
        self.deferred = False
        self.calls.clear()
        self.masks.clear()
        self.unexpected.clear()
        self.lookups.clear()

    def looked_up(self, table, args, output) -> None:
        """A position table's forward hook: keep the index (a plain nn.Embedding's input) or, for a
        subclass that builds its index inside (OPT's), the output; checked in :meth:`finish`."""
        if type(table).forward is nn.Embedding.forward and args and isinstance(args[0], torch.Tensor):
            seen = ("index", args[0].detach())
        else:
            seen = ("output", output.detach() if isinstance(output, torch.Tensor) else output)
        self.lookups.setdefault(id(table), []).append(seen)

    def position_problems(self, kwargs) -> list[str]:
        """Each table looked up once, with this shard's positions in the model's numbering + its offset."""
        problems = []
        if not self.tables:
            return problems
        batch = kwargs.get(BATCH_KWARG)
        given = kwargs.get("position_ids")
        for key, (path, table, offset) in self.tables.items():
            seen = self.lookups.get(key, [])
            if len(seen) != 1:
                problems.append(f"position table {path!r} was looked up {len(seen)} times (once expected)")
                continue
            device = table.weight.device
            expected = self.positions.local(batch, device) if batch is not None else None
            if expected is None:
                expected = given
            if not isinstance(expected, torch.Tensor):
                problems.append(f"position table {path!r}: the forward got no position_ids to check it against")
                continue
            kind, value = seen[0]
            target = expected.to(device) + offset
            if kind == "index":
                ok = value.shape[-1] == target.shape[-1] and bool((value.to(device) == target).all())
            else:
                ok = isinstance(value, torch.Tensor) and value.shape[:-1] == target.shape and torch.equal(
                    value, nn.Embedding.forward(table, target))
            if not ok:
                problems.append(
                    f"position table {path!r} ({type(table).__name__}) was not looked up with this shard's positions "
                    f"in the model's own numbering ({self.positions.rule}, offset {offset}): positions from the local "
                    "shard, or a batch that did not go through ringmaster's shard step "
                    "(context_parallel_region / ContextParallelContextManager)")
        return problems

    def finish(self, kwargs=None) -> None:
        """Raise naming every module that broke the contract; on success, disarm and drop the hooks."""
        problems = self.position_problems(kwargs or {})
        self.repeated = {}
        for key, path in self.paths.items():
            n = self.calls.get(key, 0)
            if n == 0:
                problems.append(
                    f"{path!r} never called ringmaster's CP attention function: its attention is computed outside "
                    "transformers' attention interface, or the layer was skipped")
            elif n > 1:
                self.repeated[path] = n
            if key in self.masks:
                problems.append(
                    f"{path!r} passed its own attention mask ({self.masks[key]}) instead of one from transformers' "
                    "mask interface (e.g. built from the local cache_position); ringmaster builds masks from global "
                    "positions and would ignore it")
        if self.unexpected:
            problems.append(f"CP attention was called by modules rm.wire did not classify as attention: "
                            f"{sorted(set(self.unexpected))}")
        if problems:
            self.begin()
            raise UnsupportedLayerError(
                "ringmaster's first-forward accounting failed (raised before backward, the model's loss must not be "
                "used): " + "; ".join(problems) + ". Fix: register the family with an ArchitectureSpec that matches "
                "its attention (rm.register_architecture(spec, override=True)) or refuse it "
                "(ArchitectureSpec(refuse=...)); a decoder layer must pass **kwargs down to its attention")
        self.disarm()

    def disarm(self) -> None:
        self.armed = False
        self.eager.stop()   # back to the compiled blocks and the stance before the first forward
        self.lookups.clear()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def missing_batch(self, module) -> str:
        if not self.armed:
            return ""
        return (f" ({self.name(module)} got no `ringmaster_batch`: if the batch was sharded by ringmaster, its decoder "
                "layer does not pass **kwargs down to the attention; register the family with an override or refuse "
                "it)")


def arm(ledger: Ledger, model, attention: dict[str, object], positions=None, tables=None) -> None:
    """Bind ``ledger`` to ``model``'s attention modules (path -> module), and to its absolute position
    ``tables`` (path -> module, numbered by ``positions``, a PositionConvention), and hook its first
    CP forward."""
    ledger.paths = {id(m): p for p, m in attention.items()}
    ledger.positions = positions
    offsets = dict(positions.modules) if positions is not None else {}
    ledger.tables = {id(m): (p, m, offsets[p]) for p, m in (tables or {}).items()}
    ledger.begin()

    @torch.compiler.disable   # under torch.compile(model): a graph break, only while armed
    def pre(module, args, kwargs):
        ledger.begin()
        if ledger.armed:
            if compat.has_compiled_blocks(module):
                ledger.deferred = True   # the forward runs compiled; post replays it eagerly for the record
            else:
                ledger.eager.start(module)

    @torch.compiler.disable
    def post(module, args, kwargs, output):
        if ledger.armed and ledger.deferred and BATCH_KWARG in kwargs:
            ledger.begin()   # what the compiled forward left (table lookups outside its blocks)
            compat.eager_replay(module, args, kwargs)
        if ledger.armed and (ledger.calls or BATCH_KWARG in kwargs or ledger.unexpected):
            ledger.finish(kwargs)   # disarms (and compiles again) when it passes

    @torch.compiler.disable
    def restore(module, *args):   # always: a forward that raised, or one without CP (no batch)
        ledger.eager.stop()

    def lookup(table, args, output):
        if ledger.armed:
            ledger.looked_up(table, args, output)

    ledger.handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
                      model.register_forward_hook(post, with_kwargs=True),
                      model.register_forward_hook(restore, always_call=True)]
    ledger.handles += [m.register_forward_hook(lookup) for _, m, _ in ledger.tables.values()]
    ledger.armed = True
