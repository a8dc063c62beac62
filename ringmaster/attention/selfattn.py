"""Attention modules that compute attention themselves, run under CP through a declared *site*.

Some families never read transformers' ``ALL_ATTENTION_FUNCTIONS`` (falcon calls torch's SDPA
directly, gpt_neo / gpt_neox_japanese / openai-gpt multiply and softmax in a ``_attn`` method),
so switching ``attn_implementation`` cannot reach them. Their spec names, per attention class, a
:class:`~ringmaster.architectures.spec.SelfAttentionSite` (data): the point where the module holds
q, k, v ``[B, H, S/P, D]`` and what its attention computes (scale, window). ``rm.wire`` gives each
such *instance* a replacement at that point (an instance attribute for a method; a re-bound copy
of its forward for the ``torch`` / ``F`` names, :mod:`ringmaster.intercept`), which
calls the runtime's CP attention function, the same one the interface families call: Ulysses,
Ring and USP, ``require_batch``, the per-layer rules and the first-forward accounting all apply
unchanged. Nothing shared (the class, the transformers module, ``torch``) is patched.

The model's own mask is dropped (it was built for the local shard from the local length); the
site declares what it encoded and the CP attention rebuilds it from global positions: causal,
padding and packed documents (the batch), sliding windows (``window_when``/``window_config``).
What the model derives from the local shard elsewhere is handled per family, as site data: a
``batch_rule`` refuses a batch the family cannot run exactly (xlm's padding mask, counted on the
shard: right padding only), a ``position_table`` gets the shard's global positions from a pre-hook
(trocr), a ``mean_loss`` (a mean over the shard's labels) is rescaled to the global mean, and
``cross_modules`` (idle cross-attention instances) refuse any call.

These modules are called with a fixed argument list by their decoder layers, so the
``ringmaster_batch`` kwarg never reaches them: their sites read the model's step carrier
(:mod:`ringmaster.sharding.carrier`), bound to them when wired, which the shard step sets for its
forward and clears after it, and a checkpoint's recomputation in backward replays with its own
forward's batch (:mod:`ringmaster.checkpointing`), also when another forward ran in between; a
forward outside a step finds it empty and the CP attention raises. A family's ``batch_rule`` runs in a
pre-hook on the model, which sees the call's kwargs (xlm's ``lengths``).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Callable

import torch
import torch.nn as nn

from ..comm import all_reduce_sum
from ..errors import UnsupportedLayerError
from .. import intercept
from ..sharding import balancers
from ..sharding.carrier import StepCarrier
from ..sharding.documents import BATCH_KWARG
from .binding import AttentionBinding
from .register import cp_attention

_TAG = "_ringmaster_selfattn"


class _Namespace:
    """A read-through view of a module (``torch``, ``torch.nn``, ``torch.nn.functional``) with some
    names replaced: what a re-bound forward sees under the global name ``torch`` / ``nn`` / ``F``."""

    def __init__(self, base, overrides: dict):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)


def _where(path: str, module) -> str:
    return f"layer {path!r} ({type(module).__name__})"


def site_scale(site, module, head_dim: int) -> float:
    """The softmax scale the module applies (see ``SelfAttentionSite``)."""
    if site.scale_attr:
        return float(getattr(module, site.scale_attr))
    if site.scale_if:
        return head_dim ** -0.5 if getattr(module, site.scale_if) else 1.0
    return head_dim ** -0.5 if site.scale is None else float(site.scale)


def site_window(site, module, path: str = "") -> int | None:
    """The sliding window of this layer (HF convention: key visible iff ``0 <= q - k < w``), or None."""
    if site.window_when is None:
        return None
    attr, value = site.window_when
    if getattr(module, attr, None) != value:
        return None
    window = getattr(getattr(module, "config", None), site.window_config, None)
    if not isinstance(window, int) or window < 1:
        raise UnsupportedLayerError(f"{_where(path, module)} is a {value!r} layer but its config.{site.window_config}"
                                    f"={window!r}; ringmaster needs the window length to rebuild its mask")
    return window


def check_site(path: str, module, site, config) -> None:
    """Raise, before anything changes, what the site cannot run exactly for this module."""
    where = _where(path, module)
    for attr, reason in site.refuse_config:
        if attr.startswith("config."):   # the config's, even where the module has an attribute of that name
            owner, label, attr = config, "config.", attr[len("config."):]
        else:
            owner, label = (module, "") if hasattr(module, attr) else (config, "config.")
        if getattr(owner, attr, None):
            raise UnsupportedLayerError(f"{where}: {label}{attr}={getattr(owner, attr)!r} is not supported under CP: "
                                        f"{reason}")
    if site.kind == "method":
        if not callable(getattr(type(module), site.method, None)):
            raise UnsupportedLayerError(
                f"{where} has no method {site.method!r} (a different transformers version?); ringmaster cannot reach "
                "its attention. Leave CP off for this model or register a spec matching its code")
    elif site.kind == "sdpa":
        intercept.interceptable(module, path, ("scaled_dot_product_attention",))
    elif site.kind == "fused_qkv":
        if "forward" in vars(module):
            raise UnsupportedLayerError(f"{where} has an instance-level forward (another patch); unwire that first")
        names = site.qkv if isinstance(site.qkv, tuple) else (site.qkv,)
        for child in names + ((site.out,) if site.out else ()):
            if not isinstance(getattr(module, child, None), nn.Linear):
                raise UnsupportedLayerError(
                    f"{where} has no Linear {child!r} (a different transformers version?); its declared fused_qkv "
                    "site does not match the module, so ringmaster cannot rebuild its attention")
        if not isinstance(site.qkv, tuple) and site.qkv_layout not in ("per_head", "chunked"):
            raise ValueError(f"SelfAttentionSite(qkv_layout={site.qkv_layout!r}) for {where}: 'per_head' or 'chunked'")
    else:
        raise ValueError(f"SelfAttentionSite(kind={site.kind!r}) for {where}: use 'method', 'sdpa' or 'fused_qkv'")


def site_causal(site, module, config=None) -> bool:
    """Whether the module attends causally (``causal_attr``: a module bool such as BERT's ``is_decoder``;
    ``causal_config``: a config bool such as xlm's ``causal``)."""
    if site.causal_config:
        return bool(getattr(config, site.causal_config))
    return bool(getattr(module, site.causal_attr, True)) if site.causal_attr else True


def _call(fn, module, site, carrier: StepCarrier, path: str, q, k, v, dropout: float = 0.0, scale=None, alibi=None,
          causal=None):
    """CP attention of this rank's q ``[B, H, S/P, D]`` (k/v ``[B, Hkv, S/P, D]``) -> ``[B, H, S/P, D]``."""
    causal = site_causal(site, module) if causal is None else causal
    kwargs = {BATCH_KWARG: carrier.current, "is_causal": causal, "dropout": dropout,
              "scaling": site_scale(site, module, q.shape[-1]) if scale is None else float(scale)}
    if alibi is not None:
        kwargs["alibi_slopes"] = alibi
    window = site_window(site, module, path)
    if window is not None:
        kwargs["sliding_window"] = window
    out, _ = fn(module, q, k, v, None, **kwargs)
    return out.transpose(1, 2)


def _method(fn, module, site, carrier, path) -> Callable:
    names = site.args

    def attention(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = (bound[n] for n in names[:3])
        if site.key_layout == "bhds":
            k = k.transpose(-1, -2)
        out = _call(fn, module, site, carrier, path, q, k, v)
        return [out] if site.returns == "list" else (out, None)

    return attention


def _global_rotary(site, module, table, carrier, path, q, k, v):
    """q, k (and v) rotated at the shard's *global* positions: the model looked its rotary table up for
    positions 0..S/P-1 of the local input; look it up at this shard's positions and apply it with the
    module's own function."""
    cpb = carrier.current
    if cpb is None:
        raise RuntimeError(f"{_where(path, module)}: no `ringmaster_batch` in this forward, so the shard's global "
                           "positions are unknown; shard the batch with context_parallel_region")
    positions = balancers.shard_positions(cpb.seq_len, cpb.size, cpb.rank, cpb.layout, device=q.device)
    if positions.shape[0] != q.shape[2]:
        raise RuntimeError(f"{_where(path, module)}: {q.shape[2]} tokens, but the batch's shard has "
                           f"{positions.shape[0]} positions")
    table_rows = table(q.shape[:1] + q.shape[2:3], 0, positions)[None, None]
    apply = getattr(module, site.rotary_apply)
    if site.rotary_value_attr and getattr(module, site.rotary_value_attr, False):
        return apply(table_rows, q, k, v)
    return (*apply(table_rows, q, k), v)


def _check_batch(site, module, cpb, kwargs, path, config) -> None:
    """The family's ``batch_rule`` on this forward's batch and the model call's ``kwargs`` (once per batch;
    every rank holds the same full rows, so every rank raises alike, before the CP attention's first
    collective)."""
    if site.batch_rule is None or cpb is None:
        return
    key = ("batch_rule", id(site))
    if key not in cpb._cache:
        try:
            site.batch_rule(cpb, kwargs, config)
        except (NotImplementedError, ValueError) as exc:
            raise type(exc)(f"{_where(path, module)}: {exc}") from None
        cpb._cache[key] = True


def _empty_cache(site, module, path, bound) -> None:
    cache = bound.get(site.empty_cache_arg) if site.empty_cache_arg else None
    if cache is None:
        return
    length = getattr(cache, "get_seq_length", None)
    if length is None or length() != 0:
        raise NotImplementedError(
            f"{_where(path, module)} was called with a {site.empty_cache_arg} holding past tokens "
            f"({type(cache).__name__}): ringmaster CP runs training forwards over whole rows; call the model "
            "without a filled cache")


def _fused_qkv(fn, module, site, carrier, path, table=None, config=None) -> Callable:
    """The forward of a ``fused_qkv`` site: ``out(CP(split(qkv(x))))`` (+ ``residual_arg``)."""
    names = site.args
    causal = site_causal(site, module, config) if site.causal_config else None   # else per call, from the module

    def forward(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        _empty_cache(site, module, path, bound)
        for name in site.refuse_kwargs:
            if bound.get(name) is not None and bound.get(name) is not False:
                raise NotImplementedError(
                    f"{_where(path, module)} was called with {name}={type(bound[name]).__name__}: ringmaster CP runs "
                    "training forwards without a KV cache or attention weights; call the model with use_cache=False, "
                    "output_attentions=False")
        x = bound[names[0]]
        B, S, _ = x.shape
        H = getattr(module, site.heads_attr)
        if site.cross_arg and bound.get(site.cross_arg) is not None:
            raise NotImplementedError(f"{_where(path, module)} was called as cross-attention ({site.cross_arg}); "
                                      "ringmaster CP shards one self-attended sequence")
        if isinstance(site.qkv, tuple):  # separate query / key / value projections
            parts = (getattr(module, name)(x).view(B, S, H, -1) for name in site.qkv)
        else:
            qkv = getattr(module, site.qkv)(x)
            if site.clip_attr and getattr(module, site.clip_attr, None):
                c = getattr(module, site.clip_attr)
                qkv = qkv.clamp(min=-c, max=c)
            if site.qkv_layout == "per_head":
                parts = qkv.view(B, S, H, 3, -1).unbind(3)
            else:
                parts = (t.reshape(B, S, H, -1) for t in qkv.chunk(3, dim=2))
        q, k, v = (t.transpose(1, 2) for t in parts)
        if site.rotary_arg and bound.get(site.rotary_arg) is not None:  # its local lookup is not used
            q, k, v = _global_rotary(site, module, table, carrier, path, q, k, v)
        slopes = site.alibi_slopes(module).to(q.device) if site.alibi_slopes is not None else None
        out = _call(fn, module, site, carrier, path, q, k, v, alibi=slopes, causal=causal)
        out = out.transpose(1, 2).reshape(B, S, -1)
        if site.out:
            out = getattr(module, site.out)(out)
        if site.residual_arg:
            out = out + bound[site.residual_arg]
        return out, None

    return forward


def _sdpa_names(fn, module, site, carrier, path) -> dict:
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        # attn_mask / is_causal describe the local shard; the batch and the site give the global mask
        return _call(fn, module, site, carrier, path, query, key, value, dropout=dropout_p, scale=scale)

    functional = _Namespace(torch.nn.functional, {"scaled_dot_product_attention": scaled_dot_product_attention})
    nn_ns = _Namespace(torch.nn, {"functional": functional})
    return {"torch": _Namespace(torch, {"nn": nn_ns}), "nn": nn_ns, "F": functional}


def _guard(site, path, module):
    """Per call, before the re-bound forward: refuse what would send it down a branch that never reaches
    the site (a refused kwarg; a config no longer on "sdpa", which falcon's forward tests every call)."""

    def guard(args, kwargs):
        impl = getattr(getattr(module, "config", None), "_attn_implementation", "sdpa")
        if impl != "sdpa":
            raise NotImplementedError(
                f"{_where(path, module)}: its config now says attn_implementation={impl!r}, so its forward would not "
                "call torch's SDPA (where ringmaster put the CP attention); keep 'sdpa' while wired")
        for name in site.refuse_kwargs:
            if kwargs.get(name):
                raise NotImplementedError(
                    f"{_where(path, module)} was called with {name}={kwargs[name]!r}, which sends it down a path that "
                    "computes attention over the local shard only; call the model without it under CP")
    return guard


def split_cross(spec, paths: list[str]) -> tuple[list[str], list[str]]:
    """``paths`` without, and the list of, the cross-attention instances the sites name (``cross_modules``)."""
    names = {n for site in spec.self_attention.values() for n in site.cross_modules}
    cross = [p for p in paths if p.rsplit(".", 1)[-1] in names]
    return [p for p in paths if p not in cross], cross


def _refuse_cross(path):
    def pre(module, args, kwargs):
        raise NotImplementedError(f"{_where(path, module)} is cross-attention over encoder states, which ringmaster "
                                  "CP does not run (it shards one self-attended sequence); use the model as a causal "
                                  "LM without encoder_hidden_states, or a CP size of 1")
    return pre


def _batch_rules(carrier: StepCarrier, rules: list, config):
    """A pre-hook on the wired model: each site's ``batch_rule`` (``rules``: ``(site, module, path)``, the
    first instance of each site) on the step's batch and the call's kwargs."""
    def pre(model, args, kwargs):
        cpb = carrier.batch(kwargs)
        for site, module, path in rules:
            _check_batch(site, module, cpb, kwargs, path, config)
    return pre


def wire_sites(model, spec, binding: AttentionBinding, modules: dict, cross: dict | None = None,
               carrier: StepCarrier | None = None) -> Callable[[], None]:
    """Give every attention module of ``modules`` (path -> module) whose class ``spec.self_attention``
    names its CP site, reading the step context from ``carrier`` (the model's step carrier); the ``cross``
    instances (path -> module) refuse any call. Returns the undo (also run here if any step fails)."""
    fn = cp_attention(binding)
    carrier = carrier if carrier is not None else StepCarrier()
    rules: list = []
    undos: list = []
    config = _config(model)
    tables = set()
    try:
        for path, module in modules.items():
            site = spec.self_attention.get(type(module).__name__)
            if site is None:
                continue
            if site.kind == "method":
                name, replacement = site.method, _method(fn, module, site, carrier, path)
            elif site.kind == "fused_qkv":
                table = rotary_table(model, site) if site.rotary_table else None
                name, replacement = "forward", _fused_qkv(fn, module, site, carrier, path, table, config)
            if site.kind in ("method", "fused_qkv"):
                setattr(module, name, replacement)
                setattr(module, _TAG, path)
                undos.append(functools.partial(_drop, module, (name, _TAG)))
            else:
                undos.append(intercept.rebind_forward(module, path, _sdpa_names(fn, module, site, carrier, path),
                                                      ("scaled_dot_product_attention",),
                                                      guard=_guard(site, path, module), tag=_TAG))
            if site.batch_rule is not None and all(s is not site for s, _, _ in rules):
                rules.append((site, module, path))
            if site.position_table and site.position_table not in tables:
                tables.add(site.position_table)
                undos.append(_steer_positions(model, site, carrier).remove)
            if site.mean_loss and site.mean_loss not in tables:
                tables.add(site.mean_loss)
                undos.append(_global_mean_loss(model, site, carrier, binding.cp_group).remove)
        for path, module in (cross or {}).items():
            undos.append(module.register_forward_pre_hook(_refuse_cross(path), with_kwargs=True).remove)
        if rules:
            undos.append(model.register_forward_pre_hook(_batch_rules(carrier, rules, config), with_kwargs=True).remove)
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise

    def restore():
        for undo in reversed(undos):
            undo()
    return restore


def _config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def position_table(model, site):
    """The module at path suffix ``site.position_table`` (exactly one), whose forward takes ``position_ids``."""
    found = [(p, m) for p, m in model.named_modules()
             if p == site.position_table or p.endswith("." + site.position_table)]
    if len(found) != 1:
        raise UnsupportedLayerError(
            f"{type(model).__name__}: {len(found)} modules at path suffix {site.position_table!r} (the position "
            "embedding its SelfAttentionSite names); ringmaster needs exactly one to number it globally")
    path, module = found[0]
    if "position_ids" not in inspect.signature(module.forward).parameters:
        raise UnsupportedLayerError(
            f"layer {path!r} ({type(module).__name__}) takes no position_ids (e.g. a sinusoidal table numbered "
            "from the local input), so ringmaster cannot give it this shard's global positions; use a CP size of 1 "
            "or a config with learned position embeddings")
    return path, module


def _steer_positions(model, site, carrier):
    """A forward pre-hook on the model's position table: ``position_ids`` = this shard's global positions
    (``arange`` of the whole row, cut in the batch's layout: the numbering the model uses itself on one
    device, where it numbers the local input from 0). Without a CP batch it passes nothing (the CP attention
    then refuses the forward)."""
    path, module = position_table(model, site)

    def pre(mod, args, kwargs):
        cpb = carrier.current
        if cpb is None:
            return None
        if kwargs.get("cache_length", 0) or (len(args) > 1 and args[1]):
            raise NotImplementedError(f"layer {path!r} ({type(mod).__name__}) was called with a cache length: "
                                      "ringmaster CP runs training forwards without a KV cache")
        ref = args[0] if args else kwargs.get("input_ids")
        positions = balancers.shard_positions(cpb.seq_len, cpb.size, cpb.rank, cpb.layout, device=mod.weight.device)
        if ref is not None and ref.shape[1] != positions.shape[0]:
            raise RuntimeError(f"layer {path!r}: {ref.shape[1]} tokens, but the batch's shard has "
                               f"{positions.shape[0]} positions")
        return args, {**kwargs, "position_ids": positions}

    return module.register_forward_pre_hook(pre, with_kwargs=True)


def _global_mean_loss(model, site, carrier, group):
    """A forward hook on the module that returns a mean loss over its *local* labels != -100 (``mean_loss``:
    a path suffix, called ``(x, labels)`` and returning ``(loss, scores, ...)``; or ``"."``: the wired model
    itself, called with ``labels=`` and returning ``.loss`` / ``.logits``). Under CP that mean is over this
    shard's labels only, so the group's mean of the ranks' losses would weigh every shard alike; rescale it
    to ``local sum * P / global count`` (the count summed over the CP group: the module runs on every rank).
    A shard without a label returns 0 (its mean is NaN)."""
    top = site.mean_loss == "."
    path, module = ("", model) if top else _one(model, site.mean_loss, "loss module")

    def post(mod, args, kwargs, output):
        cpb = carrier.current
        labels = kwargs.get("labels") if top else (args[1] if len(args) > 1 else None)
        if isinstance(output, tuple):
            loss, scores = (output[0], output[1]) if len(output) > 1 else (None, None)
        else:
            loss, scores = getattr(output, "loss", None), getattr(output, "logits", None)
        if cpb is None or labels is None or loss is None:
            return None
        local = labels.ne(-100).sum()
        total = all_reduce_sum(local, group, tag=f"{path or type(model).__name__} loss count")
        if int(local) == 0:
            loss = scores.sum() * 0.0
        else:
            loss = loss * (local.to(loss.dtype) * cpb.size / total.to(loss.dtype))
        if isinstance(output, tuple):
            return (loss,) + tuple(output[1:])
        output["loss"] = loss
        return output

    return module.register_forward_hook(post, with_kwargs=True)


def _one(model, suffix, what):
    found = [(p, m) for p, m in model.named_modules() if p == suffix or p.endswith("." + suffix)]
    if len(found) != 1:
        raise UnsupportedLayerError(f"{type(model).__name__}: {len(found)} modules at path suffix {suffix!r} (the "
                                    f"{what} its SelfAttentionSite names); ringmaster needs exactly one")
    return found[0]


def site_paths(model, spec) -> list[str]:
    """The modules the declared self-attention sites of ``spec`` route besides the attention modules: their
    position tables (numbered globally), rotary tables (looked up globally) and mean-loss modules."""
    suffixes = {s for site in spec.self_attention.values()
                for s in (site.position_table, site.rotary_table, site.mean_loss) if s and s != "."}
    return [p for p, _ in model.named_modules() if any(p == s or p.endswith("." + s) for s in suffixes)]


def rotary_table(model, site):
    """The model's rotary table module for ``site.rotary_table`` (a path suffix; exactly one must match)."""
    found = [m for p, m in model.named_modules() if p == site.rotary_table or p.endswith("." + site.rotary_table)]
    if len(found) != 1:
        raise UnsupportedLayerError(
            f"{type(model).__name__}: {len(found)} modules at path suffix {site.rotary_table!r} (the rotary table its "
            "SelfAttentionSite names); ringmaster needs exactly one to look positions up globally")
    return found[0]


def _drop(module, names) -> None:
    for name in names:
        module.__dict__.pop(name, None)


def bypassed_dropout(module, site) -> list[str]:
    """Dropout the module applies inside the code its site replaces, which the CP attention call never applies:
    a dropout child (``p > 0``) or a dropout probability attribute (``*drop*``, ``> 0``) that the replaced method
    (``kind="method"``) or forward (``kind="fused_qkv"``) reads as ``self.<name>``. An ``"sdpa"`` site keeps the
    module's forward and passes its ``dropout_p`` to the CP function (Ulysses applies it under each rank's forked
    random state; Ring refuses it). Unreadable source: every such child and attribute counts (fail closed)."""
    if site.kind == "sdpa":
        return []
    fn = getattr(type(module), site.method if site.kind == "method" else "forward", None)
    try:
        names = set(re.findall(r"self\.(\w+)", inspect.getsource(fn)))
    except (OSError, TypeError):
        names = set(vars(module)) | set(dict(module.named_children()))
    out = []
    for name in sorted(names):
        value = getattr(module, name, None)
        if isinstance(value, nn.modules.dropout._DropoutNd) and value.p > 0:
            out.append(f"{name} (p={value.p})")
        elif "drop" in name and isinstance(value, float) and value > 0:
            out.append(f"{name}={value}")
    return out


def check_sites(model, spec, paths) -> None:
    """Validate every site of the model (wire calls it before changing anything). Dropout elsewhere runs under
    each rank's forked random state (:mod:`ringmaster.sharding.rng`); dropout inside the code a site replaces
    would be skipped, so it is refused here (:func:`bypassed_dropout`)."""
    if not spec.self_attention:
        return
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for path in paths:
        module = modules[path]
        site = spec.self_attention.get(type(module).__name__)
        if site is not None:
            check_site(path, module, site, config)
            if site.rotary_table:
                rotary_table(model, site)
            if site.position_table:
                position_table(model, site)
            if site.mean_loss and site.mean_loss != ".":
                _one(model, site.mean_loss, "loss module")
    for path in paths:
        module = modules[path]
        site = spec.self_attention.get(type(module).__name__)
        bypassed = bypassed_dropout(module, site) if site is not None else []
        if bypassed:
            what = f"its method {site.method!r}" if site.kind == "method" else "its forward"
            raise UnsupportedLayerError(
                f"{_where(path, module)}: {', '.join(bypassed)} is applied inside {what}, which its CP site replaces "
                "with an attention call that applies no dropout (the CP model would train without it); set that "
                "dropout to 0.0 for CP training")
