"""Absolute position tables: find them, and find by a probe forward how the model numbers them.

A learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``, BERT/RoBERTa's
``embeddings.position_embeddings``) makes the model depend on where a token sits in the row, and
each family numbers the row its own way when it gets no ``position_ids`` (the rules are in
:mod:`ringmaster.sharding.positions`). Rather than a per-family table of conventions, ``rm.wire``
asks the model itself: a few tiny forwards of the *unwired* model (no grad, eval mode) with a
dense row, a row with left/right padding and a pad token inside, given ``position_ids``, and
``inputs_embeds``, recording the indices each table is looked up with (every lookup goes through
``torch.nn.functional.embedding``, also in nn.Embedding subclasses such as OPT's). From them:

- the offset ``c``: with ``position_ids`` given, the table must be indexed ``position_ids + c`` for
  one constant ``c`` (OPT, BioGPT: 2; the others: 0), else ringmaster cannot steer it;
- the rule: without ``position_ids``, the indices must be ``rule(row) + c`` for exactly one rule of
  :data:`~ringmaster.sharding.positions.RULES` on every probe row;
- equivalence: the model's output with ``position_ids = rule(row)`` passed must equal its output
  without them (at the real tokens), so nothing else in the model reads ``position_ids``
  differently (a RoPE beside the table would).

Under CP the shard step then passes ``position_ids = rule(full row)[this shard]``, and the model
builds exactly the single-device indices; the first CP forward checks each table saw them
(:mod:`ringmaster.attention.accounting`). Anything else is refused here, naming the table: a
table the probe cannot run (weights on the meta device or already sharded by FSDP2: wire first),
looked up more than once, not through ``F.embedding`` (a sinusoidal table computed on the fly),
or numbered by a rule ringmaster does not know.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UnsupportedLayerError
from ..sharding.positions import RULES, PositionConvention, rule_positions
from .spec import ArchitectureSpec, registered_architecture, text_config

# nn.Embedding modules indexed by a token's position
_POSITION_EMBEDDING = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings?|pos_embed(ding)?s?|embed_pos|"
                                 r"positional_embeddings?)$")
_POSITION_CLASS = re.compile(r"Positional?Embedding", re.I)
PROBE_LEN = 8


def position_tables(model, skip=()) -> list[tuple[str, nn.Module]]:
    """Every absolute position table of ``model`` outside ``skip`` (paths): an ``nn.Embedding`` named
    like one, or a module whose class is named ``*PositionalEmbedding`` (rotary ones excepted)."""
    out = []
    for path, module in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        cls = type(module).__name__
        if (isinstance(module, nn.Embedding) and _POSITION_EMBEDDING.search(path)) or (
                _POSITION_CLASS.search(cls) and "Rotary" not in cls):
            out.append((path, module))
    return out


class _Lookups(torch.overrides.TorchFunctionMode):
    """Record the index tensor of every ``F.embedding`` call on the watched weights (the probe only)."""

    def __init__(self, weights: dict[int, str]):
        super().__init__()
        self.weights, self.seen = weights, {path: [] for path in weights.values()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            path = self.weights.get(id(weight))
            if path is not None:
                index = args[0] if args else kwargs.get("input")
                self.seen[path].append(index.detach().clone())
        return func(*args, **kwargs)


def _refuse(path: str, module, why: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"layer {path!r} ({type(module).__name__}) is an absolute position embedding that ringmaster cannot number "
        f"for a CP shard: {why}. Each rank would embed the wrong positions; use a CP size of 1 for this model")


def _output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def _probe_inputs(config, device):
    """Two rows of ``PROBE_LEN`` tokens (never the pad id): row 1 of the padded copy has pad tokens,
    masked, at both ends, and one unmasked pad token inside (so the mask and pad-token rules differ)."""
    vocab, pad = config.vocab_size, config.pad_token_id
    tokens = [t for t in range(3, vocab) if t != pad][: 2 * PROBE_LEN]
    if len(tokens) < 2 * PROBE_LEN:
        tokens = (tokens * (2 * PROBE_LEN))[: 2 * PROBE_LEN]
    dense = torch.tensor(tokens, device=device).view(2, PROBE_LEN)
    mask = torch.ones(2, PROBE_LEN, dtype=torch.long, device=device)
    mask[1, :2] = 0
    mask[1, -1] = 0
    padded = dense.clone()
    if pad is not None:
        padded[1][mask[1] == 0] = pad
        padded[1, 4] = pad
    given = torch.stack([torch.arange(PROBE_LEN) + 3, torch.arange(PROBE_LEN) + 5]).to(device)
    return dense, padded, mask, given


def position_convention(model, spec: ArchitectureSpec, skip=()) -> PositionConvention | None:
    """How ``model`` numbers its absolute position tables (None: it has none, or its family is
    registered and vouched for by its own parity tests); raises :class:`UnsupportedLayerError`
    naming the table when no rule reproduces the model's own numbering. Runs tiny forwards of the
    unwired model: call before anything is switched."""
    if registered_architecture(model) is spec or spec.multimodal:
        return None
    tables = position_tables(model, tuple(spec.vision_modules) + tuple(skip))
    if not tables:
        return None
    path0, module0 = tables[0]
    weights = {}
    for path, module in tables:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise _refuse(path, module, "it has no lookup weight (a table computed on the fly, e.g. sinusoidal)")
        if weight.device.type == "meta" or type(weight).__name__ == "DTensor" or \
                type(getattr(weight, "data", None)).__name__ == "DTensor":
            raise _refuse(path, module, "its weights are not materialized on this rank (meta device, or already "
                                        "sharded by FSDP2), so its numbering cannot be probed; call rm.wire before "
                                        "fully_shard, on a model with real weights")
        weights[id(weight)] = path
    config = text_config(model.config)
    pad = config.pad_token_id
    device = module0.weight.device
    dense, padded, mask, given = _probe_inputs(config, device)

    modes = [(m, m.training) for m in model.modules()]   # restored one by one (frozen parts may be in eval)
    model.eval()
    try:
        with torch.no_grad():
            def run(**kw):
                try:
                    with _Lookups(weights) as lookups:
                        out = model(**kw, use_cache=False)
                except Exception as exc:  # noqa: BLE001 - any failure of the probe is a refusal naming the table
                    raise _refuse(path0, module0, f"the probe forward ({sorted(kw)}) failed: {type(exc).__name__}: "
                                                  f"{exc}") from exc
                return lookups.seen, _output(out)

            try:
                embeds = model.get_input_embeddings()(padded)
            except Exception as exc:  # noqa: BLE001
                raise _refuse(path0, module0, f"its input embeddings cannot be probed ({type(exc).__name__}: {exc})"
                              ) from exc

            runs = {"dense": (dict(input_ids=dense), (dense, None)),
                    "padded": (dict(input_ids=padded, attention_mask=mask), (padded, mask)),
                    "embeds": (dict(inputs_embeds=embeds, attention_mask=mask), (None, mask))}
            seen, outs = {}, {}
            for name, (kw, _) in runs.items():
                seen[name], outs[name] = run(**kw)
            given_seen, _ = run(input_ids=dense, position_ids=given)
            rules = [r for r in RULES if r != "pad_cumsum" or pad is not None]
            found: dict[str, str] = {}
            offsets: dict[str, int] = {}
            for path, module in tables:
                counts = {name: len(s[path]) for name, s in (*seen.items(), ("given", given_seen))}
                if any(n != 1 for n in counts.values()):
                    raise _refuse(path, module, f"it is looked up {counts} times in the probe forwards (once each "
                                                "expected)")
                shift = given_seen[path][0] - given
                if shift.shape != given.shape or not bool((shift == shift.flatten()[0]).all()):
                    raise _refuse(path, module, "with position_ids given it is not indexed by position_ids plus a "
                                                f"constant (saw {given_seen[path][0].tolist()} for position_ids "
                                                f"{given.tolist()})")
                c = int(shift.flatten()[0])
                matches = [r for r in rules if all(_matches(seen[name][path][0], r, ids, m, pad, c, device)
                                                   for name, (_, (ids, m)) in runs.items())]
                if len(matches) != 1:
                    raise _refuse(path, module, (f"its numbering without position_ids (padded row: "
                                                 f"{seen['padded'][path][0][-1].tolist()}) follows "
                                                 f"{'none' if not matches else 'more than one'} of the rules "
                                                 f"ringmaster knows ({', '.join(RULES)})"))
                found[path], offsets[path] = matches[0], c
            if len(set(found.values())) > 1:
                raise _refuse(path0, module0, f"the model's position tables follow different rules: {found}")
            rule = found[path0]
            for name in ("padded", "embeds"):
                kw, (ids, m) = runs[name]
                _, out = run(**kw, position_ids=rule_positions(rule, ids, m, pad, ids_shape(kw), device))
                ref = outs[name]
                real = m.bool()
                if not torch.allclose(out[real], ref[real], rtol=1e-5, atol=1e-6 * max(ref[real].abs().max().item(), 1)):
                    raise _refuse(path0, module0, f"passing its own numbering ({rule}) as position_ids changes the "
                                                  f"model's output ({name} probe): something besides the table reads "
                                                  "position_ids")
    finally:
        for module, mode in modes:
            module.training = mode
    return PositionConvention(rule, pad if rule == "pad_cumsum" else None,
                              tuple((path, offsets[path]) for path, _ in tables))


def ids_shape(kw) -> tuple[int, int]:
    ref = kw.get("input_ids", kw.get("inputs_embeds"))
    return int(ref.shape[0]), int(ref.shape[1])


def _matches(index: torch.Tensor, rule: str, ids, mask, pad, c: int, device) -> bool:
    expected = rule_positions(rule, ids, mask, pad, (2, PROBE_LEN), device) + c
    try:
        return bool((index.expand_as(expected) == expected).all())
    except RuntimeError:  # shapes that do not broadcast: not this rule
        return False
