"""Pool jobs for the MoE router loss under CP (tests/test_router_loss.py)."""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist

import ringmaster as rm

ROUTER_ON = dict(output_router_logits=True, router_aux_loss_coef=0.5)
# the configs default to 60-128 experts (eager expert loops): 8, top-2, cost less and route the same way (top-k
# below the expert count: a top-k of every expert would make the balancing loss a constant)
SMALL = {t: dict(num_experts=8, num_experts_per_tok=2) for t in ("qwen3_moe", "qwen2_moe", "olmoe")}


def router_on(model_type: str) -> dict:
    return {**ROUTER_ON, **SMALL.get(model_type, {})}


def _batch(kind: str, vocab: int, seed: int = 1, rows: int = 1):
    from ringmaster_tools.parity import packed_batch, padded_rows, tiny_batch

    if kind == "dense":
        return tiny_batch(vocab, 64, rows, seed=seed)
    if kind == "packed":   # position_ids restarting per document: transformers masks the documents itself
        return packed_batch(vocab, [20, 30, 14], seed=seed)
    if kind == "padded":   # B=2, attention_mask: the router loss weights the real tokens only
        return padded_rows(vocab, 64)
    raise ValueError(kind)


def router_parity(ctx, model_type, P, backend="ulysses", kind="dense", load_balance=None, rows=1, steps=1,
                  checkpointing=False, mutate=None, overrides=None, fp64=False, cfg_kwargs=None):
    """The MoE model with its router loss on (coefficient 0.5), with and without CP: the group mean of the rank
    losses and of their ``aux_loss``, and every parameter's gradient against its own norm (``steps`` micro-batches
    accumulated). ``mutate="local"``: the group reduction of the router statistics skipped."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster.sharding import router
    from ringmaster_tools.parity import group_mean_grad_errors, keep_fp64, rel_err, tiny_model

    if fp64:   # recurrent layers: fp32 gradients of A_log / dt_bias cancel (DESIGN.md), so compare in fp64
        with keep_fp64():
            return router_parity(ctx, model_type, P, backend, kind, load_balance, rows, steps, checkpointing, mutate,
                                 {**(overrides or {}), "dtype": torch.float64}, cfg_kwargs=cfg_kwargs)
    model = tiny_model(model_type, "sdpa", 0, **{**router_on(model_type), **(overrides or {})})
    reference = copy.deepcopy(model)
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = [_batch(kind, model.config.vocab_size, seed=1 + s, rows=rows) for s in range(steps)]
    ref_losses, ref_aux = [], []
    for batch in batches:
        out = reference(**batch, use_cache=False)
        out.loss.backward()
        ref_losses.append(out.loss.detach())
        ref_aux.append(out.aux_loss.detach())
    cfg = rm.RingmasterConfig(size=P, backend=backend, **({"load_balance": load_balance} if load_balance else {}),
                              **(cfg_kwargs or {}))
    runtime = rm.wire(model, cfg, device_mesh=ctx.mesh(P))
    group = runtime.cp_group
    saved = router.all_reduce_sum
    if mutate == "local":
        router.all_reduce_sum = lambda value, group, tag="": value.detach().clone()
    try:
        losses, auxes = [], []
        for batch in batches:
            with context_parallel_region(batch) as shard:
                out = model(**shard)
            out.loss.backward()
            for t, into in ((out.loss, losses), (out.aux_loss, auxes)):
                v = t.detach().float().clone()
                dist.all_reduce(v, group=group)
                into.append(v / P)
        grads, missing, _ = group_mean_grad_errors(model, reference, group, P)
    finally:
        router.all_reduce_sum = saved
        rm.unwire(model)
        rm.teardown()
    routers = {k: v for k, v in grads.items() if "gate" in k.split(".")[-2] or "router" in k}
    return {"loss_err": max(rel_err(a, b) for a, b in zip(losses, ref_losses)),
            "aux_err": max(rel_err(a, b) for a, b in zip(auxes, ref_aux)),
            "aux": float(ref_aux[0]), "grad_err": max(grads.values()), "worst": max(grads, key=grads.get),
            "router_grad_err": max(routers.values()) if routers else None, "n_router": len(routers),
            "missing": missing}


def _own_formula(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """A router loss no style computes: the squared mean router probability per expert."""
    probs = torch.cat([torch.softmax(g, dim=-1) for g in gate_logits]).mean(0)
    return (probs ** 2).sum() * num_experts


def unknown_router_loss(ctx, P, flag: bool):
    """A qwen3_moe model whose forward calls a router loss of its own formula (module-level, as transformers'
    families do): with ``output_router_logits`` on, ``rm.wire`` refuses; with it off it wires, and a CP call that
    switches it on is refused before its forward runs. Returns (wire error, call error)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model
    from jobs import error_of

    class OwnLossForCausalLM(mq.Qwen3MoeForCausalLM):
        pass

    namespace = dict(mq.__dict__, load_balancing_loss_func=_own_formula)
    forward = inspect.unwrap(mq.Qwen3MoeForCausalLM.forward)
    own = type(forward)(forward.__code__, namespace, forward.__name__, forward.__defaults__, forward.__closure__)
    own.__kwdefaults__ = forward.__kwdefaults__
    OwnLossForCausalLM.forward = own
    base = tiny_model("qwen3_moe", "sdpa", 0, **{**router_on("qwen3_moe"), "output_router_logits": flag})
    model = OwnLossForCausalLM(base.config)
    model.load_state_dict(base.state_dict())
    try:
        rm.wire(model, rm.RingmasterConfig(size=P), device_mesh=ctx.mesh(P))
    except Exception as exc:  # the test asserts on the type and the message
        rm.teardown()
        return (type(exc).__name__, str(exc)), None

    def call():
        with context_parallel_region(tiny_batch(model.config.vocab_size, 64)) as shard:
            model(**shard, output_router_logits=True)
    try:
        return None, error_of(call)
    finally:
        rm.unwire(model)
        rm.teardown()


def flag_only(ctx, model_type, P):
    """Wire a model that carries output_router_logits=True but computes no router loss; one CP step. None: fine."""
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model
    from jobs import error_of

    model = tiny_model(model_type, "sdpa", 0, output_router_logits=True)

    def step():
        rm.wire(model, rm.RingmasterConfig(size=P), device_mesh=ctx.mesh(P))
        with context_parallel_region(tiny_batch(model.config.vocab_size, 64)) as shard:
            model(**shard).loss.backward()
        rm.unwire(model)
    return error_of(step)
