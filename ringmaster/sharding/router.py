"""MoE router losses over the whole CP group: the model's own load-balancing loss, exact under CP.

A MoE model with ``output_router_logits=True`` adds ``coef * aux_loss`` to its loss, where ``aux_loss`` is a
statistic of the whole sequence: each expert's token fraction times its mean router probability. Every rank of a
CP group holds a shard, so the family's function (``load_balancing_loss_func`` in its modeling module) would see
the shard only. Here the function's statistics are summed over the group before its formula is applied, as
Megatron-Core does (per-expert token counts reduced over the context group, probabilities kept local):

- a :class:`Style` is one formula in the sum form ``F(T, R, N)``: ``T [E]`` the (mask-weighted) top-k counts per
  expert, ``R [E]`` the (mask-weighted) router probability sums, ``N`` the token total, each a sum over the layers
  and tokens a rank holds, ``F`` linear in ``R``;
- at wire time (:func:`plan`) each call site's function is *recognised*: run on random router logits (with and
  without a padding mask) it must give what the style computes, else it is not replaced (and a model that switches
  the loss on is refused, naming the function);
- per step the rank's ``(T, R, N)`` travel in one all-reduce of ``2E + 1`` floats (all layers at once: the
  families pool the layers before the formula), on the host-free device path; the value returned is the
  single-device ``aux_loss`` on every rank, and its gradient is ``P`` times the rank's own share
  (``F(T, R_rank, N)``, ``F`` being linear in ``R``), so the group mean of the rank gradients is the single-device
  gradient (``DESIGN.md``'s convention); no collective runs in backward.

The padding mask the family weights tokens by is the shard of the batch's own ``attention_mask``
(``CPBatch.token_mask``, cut in the shard step), since the shard drops ``attention_mask`` itself.
"""

from __future__ import annotations

import dis
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import all_reduce_sum, timed_comm
from ..errors import UnsupportedLayerError
from ..intercept import rebind_forward

# module-level functions of a model's forward that compute a router statistic (a call site of one of these that
# no style recognises is refused when the model switches the router loss on)
ROUTER_LOSS_NAME = re.compile(r"(balanc|z_loss|aux_loss|router_loss)", re.IGNORECASE)


def _mask_weights(attention_mask, device) -> torch.Tensor | None:
    return None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)


def _switch_stats(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """Switch Transformer's balancing statistics as transformers' MoE families compute them (mixtral, qwen3_moe,
    olmoe, jamba, qwen3_next, gpt_oss, ...): softmax over each layer's router logits, top-k experts per token."""
    device = gate_logits[0].device
    T = torch.zeros(num_experts, dtype=torch.float64, device=device)
    R = torch.zeros(num_experts, dtype=torch.float32, device=device)
    N = torch.zeros((), dtype=torch.float64, device=device)
    mask = _mask_weights(attention_mask, device)   # the same flat mask for every layer's rows
    for layer in gate_logits:
        weights = torch.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        T, R, N = _accumulate(T, R, N, chosen, weights.float(), mask, mask, top_k)
    return T, R, N


def _accumulate(T, R, N, chosen, weights, count_mask, weight_mask, top_k):
    """One layer's top-k counts ``chosen [rows, k]`` (weighted by ``count_mask``) and router probabilities
    ``weights [rows, E]`` (weighted by ``weight_mask``) added to the sums; no mask: every row counts once."""
    if weight_mask is None:
        T = T.index_add(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=T.dtype, device=T.device))
        return T, R + weights.sum(dim=0), N + weights.shape[0]
    T = T.index_add(0, chosen.reshape(-1), count_mask.repeat_interleave(top_k).to(T.dtype))
    R = R + (weights * weight_mask.to(weights.dtype).unsqueeze(-1)).sum(dim=0)
    return T, R, N + weight_mask.sum().to(N.dtype)


def _switch_formula(T, R, N, num_experts=None, **_):
    n = N.to(torch.float32)
    return torch.sum((T.to(torch.float32) / n) * (R / n).unsqueeze(0)) * num_experts


def _product_key_stats(gate_logits, num_experts=None, num_keys=None, top_k=2, attention_mask=None):
    """Doge's balancing statistics: experts addressed by a pair of keys (product-key routing), the top-k of the
    key-pair scores, a softmax over the pair scores."""
    device = gate_logits[0].device
    T = torch.zeros(num_experts, dtype=torch.float64, device=device)
    R = torch.zeros(num_experts, dtype=gate_logits[0].dtype, device=device)
    N = torch.zeros((), dtype=torch.float64, device=device)
    mask = _mask_weights(attention_mask, device)
    # doge counts the tokens a mask keeps (bool) but weights the totals by its values
    kept = None if mask is None else (mask != 0)
    for layer in gate_logits:
        layer = layer.to(device)
        (sx, sy), (ix, iy) = layer.topk(num_keys, dim=-1)
        scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)
        indices = (ix.unsqueeze(-1) * num_keys + iy.unsqueeze(-2)).flatten(-2)
        _, pos = scores.topk(top_k, dim=-1)
        chosen = indices.gather(-1, pos)
        weights = torch.zeros_like(scores).scatter(-1, indices, torch.softmax(scores, dim=-1))
        T, R, N = _accumulate(T, R, N, chosen, weights, kept, mask, top_k)
    return T, R, N


def _product_key_formula(T, R, N, num_experts=None, top_k=2, **_):
    dtype = R.dtype
    n = N.to(dtype)
    return torch.sum((T.to(dtype) / (n * top_k)) * (R / n)) * num_experts


@dataclass(frozen=True)
class Style:
    """One router-loss formula in sum form: ``stats(**args) -> (T, R, N)`` over what a rank holds, and
    ``formula(T, R, N, **args)``, linear in ``R``. ``params``: the function's parameters, in order;
    ``probe(seed)``: random arguments for recognising a family's function."""

    name: str
    params: tuple[str, ...]
    stats: Callable
    formula: Callable
    probe: Callable


def _switch_probe(masked: bool, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(7 + masked)
    mask = torch.randint(0, 3, (2, 6), generator=g) if masked else None   # 0 = padding; 2: axolotl's packed ids
    return dict(gate_logits=tuple(torch.randn(12, 8, generator=g, dtype=dtype) for _ in range(3)), num_experts=8,
                top_k=2, attention_mask=mask)


def _product_key_probe(masked: bool) -> dict:
    g = torch.Generator().manual_seed(11 + masked)
    mask = torch.randint(0, 3, (2, 6), generator=g) if masked else None
    return dict(gate_logits=tuple(torch.randn(2, 12, 4, generator=g) for _ in range(3)), num_experts=16, num_keys=4,
                top_k=2, attention_mask=mask)


STYLES = (
    Style("switch", ("gate_logits", "num_experts", "top_k", "attention_mask"), _switch_stats, _switch_formula,
          _switch_probe),
    Style("product_keys", ("gate_logits", "num_experts", "num_keys", "top_k", "attention_mask"),
          _product_key_stats, _product_key_formula, _product_key_probe),
)


def recognise(fn: Callable) -> Style | None:
    """The style whose formula ``fn`` computes: same parameters, and the same value as the style on random router
    logits with and without a padding mask. None when no style does (an unknown formula stays unreplaced)."""
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    for style in STYLES:
        if params != style.params:
            continue
        try:
            for masked in (False, True):
                args = style.probe(masked)
                want = fn(**args)
                got = style.formula(*style.stats(**args), **{k: v for k, v in args.items() if k != "gate_logits"})
                # wire time, on the host: the two values, in whatever precision each computed
                if not isinstance(want, torch.Tensor) or not abs(float(got) - float(want)) <= 1e-5 * abs(float(want)):
                    break
            else:
                return style
        except Exception:   # a function that cannot run on the probe's arguments is not this style
            continue
    return None


def group_loss(style: Style, original: Callable, group, size: int, batch_of: Callable[[], object]) -> Callable:
    """``original``'s replacement for one wired model: under a CP step (``batch_of()`` gives its ``CPBatch``) the
    statistics summed over ``group`` (of ``size`` ranks) in one all-reduce, the value the single-device loss, the
    gradient ``size`` times the rank's share; at a group of one rank, ``original`` itself (a CP call without the
    step's batch raises)."""
    sig = inspect.signature(original)

    def loss(*args, **kwargs):
        batch = batch_of()
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        gate_logits = a.get("gate_logits")
        if size <= 1 or gate_logits is None or not isinstance(gate_logits, tuple):
            return original(*args, **kwargs)
        if batch is None:
            raise RuntimeError(f"{getattr(original, '__qualname__', 'the router loss')} ran under a CP group of {size} "
                               "ranks without the step's batch: shard batches with context_parallel_region(batch) or "
                               "ContextParallelContextManager, so the router statistics can be summed over the group")
        # the shard of the batch's own padding mask (the forward gets none under CP: the shard drops it)
        a["attention_mask"] = getattr(batch, "token_mask", None)
        T, R, N = style.stats(**a)
        rest = {k: v for k, v in a.items() if k != "gate_logits"}
        stats = torch.cat([T.to(torch.float64), R.detach().to(torch.float64), N.reshape(1)])   # 2E + 1 floats
        with timed_comm("all_reduce", "forward", stats.numel() * stats.element_size(), tag="router_loss"):
            total = all_reduce_sum(stats, group, tag="router_loss")
        E = T.shape[0]
        T_all, R_all, N_all = total[:E], total[E:2 * E].to(R.dtype), total[2 * E]
        value = style.formula(T_all, R_all, N_all, **rest)
        share = style.formula(T_all, R, N_all, **rest) * size    # linear in R: P times this rank's part
        return value.detach() + (share - share.detach())

    loss.__wrapped_router_loss__ = original
    return loss


def _sites(model) -> list[tuple[str, object, dict[str, Callable]]]:
    """``(path, module, {name: function})`` for every module whose forward calls a router-loss function by
    module-global name (:data:`ROUTER_LOSS_NAME`): the causal LM's forward, in transformers' MoE families."""
    out = []
    for path, module in model.named_modules():
        fn = inspect.unwrap(_forward_of(module))
        code, namespace = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or namespace is None:
            continue
        # the names the forward loads as globals or imports (not attributes: a coefficient's name may match); one
        # that is no function of the module (imported inside the forward, as trl's fused LM head imports mixtral's)
        # is None, which no style recognises, so it is refused with the router loss on
        loaded = {i.argval for i in dis.get_instructions(code)
                  if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "IMPORT_FROM") and isinstance(i.argval, str)}
        # (a module constant of such a name, a coefficient, is no call)
        found = {n: namespace.get(n) if callable(namespace.get(n)) else None
                 for n in sorted(loaded) if ROUTER_LOSS_NAME.search(n) and (n not in namespace or callable(namespace[n]))}
        if found:
            out.append((path, module, found))
    return out


def _forward_of(module):
    forward = vars(module).get("forward") or type(module).forward
    return getattr(forward, "__func__", forward)


def wire_router_loss(model, config, group, size: int, batch_of: Callable[[], object], multimodal: bool = False
                     ) -> list[Callable[[], None]]:
    """Make the model's router loss exact under CP: every call site of a router-loss function (:func:`_sites`)
    whose function a :class:`Style` recognises gets :func:`group_loss` in its place (this instance only:
    :func:`ringmaster.intercept.rebind_forward`). Returns the undos.

    What cannot be made exact (a function no style recognises, a VLM's fused sequence, a forward another tool
    replaced on the instance) is refused here when ``config.output_router_logits`` is on, naming the function and
    the fix; when it is off, the per-call switch ``output_router_logits=True`` is refused at that call instead.
    A family that carries the flag but whose forward computes no router loss (llama4, gemma4) is not refused."""
    if not hasattr(config, "output_router_logits"):
        return []
    sites, problems = [], []
    for path, module, found in _sites(model):
        unknown = [f"{name} ({getattr(fn, '__module__', '?')})" if fn is not None else
                   f"{name} (imported inside {getattr(inspect.unwrap(_forward_of(module)), '__qualname__', 'it')}, "
                   "which ringmaster cannot route)"
                   for name, fn in found.items() if fn is None or recognise(fn) is None]
        if unknown:
            problems.append(f"{type(module).__name__}.forward calls {', '.join(unknown)}, a router loss ringmaster "
                            "does not recognise (known: " + ", ".join(s.name for s in STYLES) + " balancing losses)")
        elif multimodal:
            problems.append(f"{type(module).__name__} is a vision-language model: its router loss weights the fused "
                            "sequence's tokens, which ringmaster cuts inside the language model")
        else:
            sites.append((path, module, found))
    if problems:
        message = ("the MoE auxiliary router loss is a statistic of the whole sequence that each CP rank would compute "
                   f"over its shard only: {problems[0]}. Set output_router_logits=False (router_aux_loss_coef then has "
                   "no effect) or use a CP size of 1")
        if getattr(config, "output_router_logits", False):
            raise UnsupportedLayerError("config.output_router_logits=True: " + message)
        return [_refuse_per_call(model, message)]
    undos = []
    try:
        for path, module, found in sites:
            styles = {name: recognise(fn) for name, fn in found.items()}
            replacements = {name: group_loss(styles[name], fn, group, size, batch_of) for name, fn in found.items()}
            undos.append(rebind_forward(module, path, replacements, list(found), tag="_ringmaster_router"))
            # for a loss head that bypasses the model's forward (CPSFTTrainer's chunked head): the replacement
            module.__dict__["_ringmaster_router_loss"] = next(iter(replacements.values()))
            undos.append(lambda m=module: m.__dict__.pop("_ringmaster_router_loss", None))
    except UnsupportedLayerError as exc:
        for undo in reversed(undos):
            undo()
        if getattr(config, "output_router_logits", False):
            raise UnsupportedLayerError(f"config.output_router_logits=True: {exc}") from None
        return [_refuse_per_call(model, str(exc))]
    return undos


def _refuse_per_call(model, message: str) -> Callable[[], None]:
    """Refuse a CP forward called with ``output_router_logits=True`` (it overrides the config), before it runs."""
    def pre(module, args, kwargs):
        if kwargs.get("output_router_logits"):
            raise UnsupportedLayerError("output_router_logits=True was passed to a CP forward: " + message)

    return model.register_forward_pre_hook(pre, with_kwargs=True).remove
