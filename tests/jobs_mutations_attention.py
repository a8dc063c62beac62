"""Mutation jobs for the attention CP mechanisms (run on every rank of the gloo pool).

Each mutation is a small function returning the patches it makes, as
``[(module path, attribute, replacement)]``. ``mutated_parity`` runs the model-level parity
check (``ringmaster_tools.parity.compare``) once unmutated and once with the patches applied inside
the worker, restoring every patched attribute afterwards, so the test can show that the check
tells the two apart. Patch targets name the module whose *global* the code reads at call time
(a name bound by ``from x import y`` must be patched where it is used, not where it is defined).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch

import ringmaster as rm

# -- mutations ------------------------------------------------------------------------------


def ring_merge_without_lse_weights():
    """Ring: blocks merge by a plain mean of their outputs (no exp(lse - total) rescaling).

    Target: ``ringmaster.attention.ring.loop.merge`` (loop.py binds ``merge`` with ``from .merge import``,
    so patching ``ringmaster.attention.ring.merge.merge`` would not reach the loop)."""

    def merge(out, lse, out_b, lse_b):
        from ringmaster.attention.ring.merge import acc_dtype

        out_b, lse_b = out_b.to(acc_dtype(out_b)), lse_b.to(acc_dtype(lse_b))
        if out is None:
            return out_b, lse_b
        return (out + out_b) / 2, torch.logaddexp(lse, lse_b)  # the LSE itself stays right

    return [("ringmaster.attention.ring.loop", "merge", merge)]


def ulysses_without_kv_replication():
    """Ulysses: ``kv_replication`` answers 1 when kv_heads < P (KV heads are never repeated).

    Target: ``ringmaster.attention.ulysses.kv_replication`` (read as a module global by
    ``ulysses_attention``; wiring.py's validation keeps the real one, so it does not stop the
    mutated attention first)."""
    from ringmaster.attention import ulysses

    original = ulysses.kv_replication

    def kv_replication(num_heads, num_kv_heads, size):
        return 1 if num_kv_heads < size else original(num_heads, num_kv_heads, size)

    return [("ringmaster.attention.ulysses", "kv_replication", kv_replication)]


def ring_plans_contiguous_layout():
    """Ring: the batch is cut head_tail, but the ring plans its blocks as if it were contiguous.

    Target: ``ringmaster.attention.ring.hf.ring_core`` (``ring_attention_hf`` reads it as a module
    global and passes it the layout the batch was cut in)."""
    from ringmaster.attention.ring import hf as ring

    original = ring.ring_core

    def ring_core(binding, cpb, module, query, key, value, group, layout, *rest):
        return original(binding, cpb, module, query, key, value, group,
                        "contiguous" if layout == "head_tail" else layout, *rest)

    return [("ringmaster.attention.ring.hf", "ring_core", ring_core)]


def ring_plans_swapped_head_tail_chunks():
    """Ring: the planner's head_tail chunks come in the wrong order ([2P-1-r, r] instead of
    [r, 2P-1-r]); the batch is still cut the right way.

    Target: the ``balancers`` global of ``ringmaster.attention.ring.loop`` (``RingPlan.chunks`` calls
    ``balancers.shard_chunks``). Patching ``ringmaster.sharding.balancers.shard_chunks`` itself would
    change the batch cut (shard.py) and the gather as well, which stay consistent with the plan:
    that is a different layout, not a bug, and parity holds."""
    import types

    from ringmaster.sharding import balancers

    def shard_chunks(layout, size, rank):
        return list(reversed(balancers.shard_chunks(layout, size, rank)))

    proxy = types.SimpleNamespace(**{k: getattr(balancers, k) for k in dir(balancers) if not k.startswith("__")})
    proxy.shard_chunks = shard_chunks
    return [("ringmaster.attention.ring.loop", "balancers", proxy)]


def _replan(edit):
    """Patch for ``ringmaster.attention.tiled.plan_row`` (read as a module global by ``plan``): every
    planned call passes through ``edit``."""
    from ringmaster.attention import tiled

    original = tiled.plan_row

    def plan_row(*args, **kwargs):
        return [edit(c) for c in original(*args, **kwargs)]

    return [("ringmaster.attention.tiled", "plan_row", plan_row)]


def tiled_window_keys_start_one_late():
    """Ulysses/sdpa tiles: a window tile's key range starts one key late (the oldest key of the
    tile's first query is cut off), an off-by-one in the tile's key range."""
    import dataclasses

    return _replan(lambda c: dataclasses.replace(c, k0=c.k0 + 1) if c.masked and c.k0 < c.q0 else c)


def tiled_calls_without_masks():
    """Ulysses/sdpa tiles: every call goes unmasked, so the kernel applies its own is_causal, which
    SDPA aligns top-left: wrong for a tile with more keys than queries (and ignores documents)."""
    import dataclasses

    return _replan(lambda c: dataclasses.replace(c, masked=False))


MUTATIONS = {f.__name__: f for f in (ring_merge_without_lse_weights, ulysses_without_kv_replication,
                                      ring_plans_contiguous_layout, ring_plans_swapped_head_tail_chunks,
                                      tiled_window_keys_start_one_late, tiled_calls_without_masks)}

# -- harness --------------------------------------------------------------------------------


@contextmanager
def applied(mutation: str):
    """Apply the named mutation's patches; restore every attribute on exit."""
    saved = []
    try:
        for module_path, attr, value in MUTATIONS[mutation]():
            module = importlib.import_module(module_path)
            if not hasattr(module, attr):
                raise AttributeError(f"mutation {mutation}: {module_path}.{attr} does not exist (moved?)")
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


_KEYS = ("backend", "layout", "loss_err", "logits_err", "grad_err", "worst_param", "n_grads", "n_params",
         "attention_layers")


def _run(ctx, model_type, P, overrides, backend, cfg_kwargs, seq_len):
    from ringmaster_tools.parity import compare

    cfg = rm.RingmasterConfig(size=P, backend=backend, **(cfg_kwargs or {}))
    r = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(P), **(overrides or {}))
    return {k: r[k] for k in _KEYS}


def mutated_parity(ctx, mutation, model_type, P, overrides=None, backend="ring", cfg_kwargs=None, seq_len=64):
    """``{"clean": errors, "mutated": errors | {"raised": (type name, message)}}`` on this rank."""
    clean = _run(ctx, model_type, P, overrides, backend, cfg_kwargs, seq_len)
    with applied(mutation):
        try:
            mutated = _run(ctx, model_type, P, overrides, backend, cfg_kwargs, seq_len)
        except Exception as exc:  # the test asserts on the type and message
            mutated = {"raised": (type(exc).__name__, str(exc))}
        finally:
            rm.teardown()
    return {"clean": clean, "mutated": mutated}
