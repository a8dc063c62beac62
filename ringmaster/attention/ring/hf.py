"""Ring attention behind transformers' attention interface."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import RingImpl
from ...sharding import balancers, handle
from ..binding import AttentionBinding
from ..relbias import KWARG as REL_KWARG
from ..token_sinks import KWARG as TOKEN_SINKS
from . import distflash
from .loop import RingPlan, ring_attention
from .math_kernel import MathKernel

_MATH = MathKernel()
# the block kernels a compiled ring runs inside ringmaster's ops (ring_block, distflash_task), which plan the pairs
# from the step handle's host runs, so the traced loop reads no per-packing value: the tile kernels on packed rows
# (their dense blocks trace as they are); a hub flash kernel always, so its own Python (varlen calls cut on the
# host, outputs that alias its buffers) never reaches dynamo, whether or not it has torch.library ops of its own
BY_OP = (RingImpl.ATEN, RingImpl.MATH, RingImpl.HF_KERNELS)


def _by_op(kernel, cpb, plain: bool = True) -> bool:
    """Whether a compiled ring runs its blocks inside ringmaster's ops (:data:`BY_OP`); ``plain``: no ALiBi or
    relative bias (the math kernel builds those in its tiles, traced)."""
    if not (plain and torch.compiler.is_compiling() and handle.AVAILABLE):
        return False
    name = getattr(kernel, "name", None)
    return name in BY_OP and (cpb.doc_ids is not None or name is RingImpl.HF_KERNELS)


def module_sinks(module, kwargs):
    """gpt-oss style sinks ``[Hq]``: the ``s_aux`` kwarg or the module's ``sinks`` parameter; Inkling2's
    per-token sinks ``[B, Hq, q]`` (:mod:`..token_sinks`) when the call has them."""
    sinks = kwargs.pop(TOKEN_SINKS, None)
    if sinks is not None:
        return sinks
    sinks = kwargs.get("s_aux")
    if not isinstance(sinks, torch.Tensor):
        sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def check_call(binding: AttentionBinding, module, query, value, kwargs) -> None:
    """Refuse, before any collective (USP calls it before its all-to-all), what the ring cannot run
    exactly for this call: attention dropout, and softcap / MLA head dims a block kernel or the
    distflash schedule does not take."""
    where = type(module).__name__
    if kwargs.get("dropout") and getattr(module, "training", False):
        raise NotImplementedError(
            f"{where}: ring attention is exact only without attention dropout (got {kwargs['dropout']}); "
            "set attention_dropout=0 in the model config"
        )
    softcap = kwargs.get("softcap")
    if binding.schedule == "distflash" and (softcap or query.shape[-1] != value.shape[-1]):
        what = f"softcap={softcap}" if softcap else f"query/key head dim {query.shape[-1]} != value head dim " \
                                                      f"{value.shape[-1]} (MLA)"
        raise NotImplementedError(f"{where}: the distflash ring schedule does not implement {what}; "
                                  "use load_balance='head_tail' (or 'none')")
    binding.ring_kernel.check(query, value, softcap)
    alibi = kwargs.get("alibi_slopes")
    if alibi is not None:
        from_kernel = getattr(binding.ring_kernel, "name", None)
        if (binding.schedule == "distflash" or softcap or from_kernel not in (RingImpl.MATH, RingImpl.ATEN)
                or (from_kernel is RingImpl.ATEN and query.device.type != "cpu")):
            raise NotImplementedError(
                f"{where}: ALiBi (alibi_slopes) runs in the ring's math kernel and aten's CPU kernel only (got "
                f"ring_impl={from_kernel}, schedule={binding.schedule}, softcap={softcap}, device={query.device.type}); "
                "use ring_impl='math' (or 'aten' on CPU), load_balance='head_tail' or 'none', or backend='ulysses'")
        if alibi.shape != (query.shape[1],):
            raise ValueError(f"{where}: {tuple(alibi.shape)} ALiBi slopes for {query.shape[1]} query heads")
    if kwargs.get(REL_KWARG) is not None:
        from_kernel = getattr(binding.ring_kernel, "name", None)
        if binding.schedule == "distflash" or softcap or from_kernel not in (RingImpl.MATH, RingImpl.ATEN):
            raise NotImplementedError(
                f"{where}: the relative position bias (Inkling) runs inside the ring's math block kernel (it returns "
                f"the bias's gradient; got ring_impl={from_kernel}, schedule={binding.schedule}, softcap={softcap}); "
                "use ring_impl='math' or 'aten' (its relative-bias blocks run in the math kernel), load_balance="
                "'head_tail' or 'none', or backend='ulysses'")


def _plan_runs(cpb, kernel, device, by_op: bool = False):
    """The host runs a ring plan carries: the batch's in eager mode. Compiled, none where every pair and tile runs
    under its mask from the ids on the device (the tile kernels: math, aten on CPU) or the op plans the pairs
    from the step handle (``by_op``), so the graph does not depend on the packing; a flash-style kernel (hub, aten
    on CUDA) cuts documents into varlen calls on the host, so its plan keeps them."""
    if not torch.compiler.is_compiling():
        return cpb.runs
    name = getattr(kernel, "name", None)
    tiles = name is RingImpl.MATH or (name is RingImpl.ATEN and torch.device(device).type == "cpu")
    return None if by_op or tiles else cpb.runs


def ring_core(binding: AttentionBinding, cpb, module, query, key, value, group, layout: str, kwargs, sinks):
    """Ring attention over ``group`` for q ``[B, H, n, D]`` in ``layout``; returns ``[B, H, n, D_v]``."""
    check_call(binding, module, query, value, kwargs)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if binding.schedule == "distflash":
        distflash.check_call(causal, kwargs.get("sliding_window"), cpb.seq_len)
        # compiled: no per-packing value in the graph; every task's messages move, and a task of disjoint documents
        # is skipped inside torch.ops.ringmaster.distflash_task from the step handle (an aten or math kernel)
        static = torch.compiler.is_compiling()
        by_op = _by_op(binding.ring_kernel, cpb)
        plan = distflash.DistFlashPlan(size=dist.get_world_size(group), rank=dist.get_rank(group),
                                       chunk=query.shape[2], docs=cpb.docs_on(query.device),
                                       runs=_plan_runs(cpb, binding.ring_kernel, query.device, by_op),
                                       static_docs=static and cpb.doc_ids is not None,
                                       handle=cpb.handle if by_op else None)
        return distflash.distflash_attention(query, key, value, group, plan, binding.ring_kernel,
                                             scale=kwargs.get("scaling"), sinks=sinks)
    rel = kwargs.get(REL_KWARG)
    kernel = binding.ring_kernel
    if rel is not None:  # the bias and its gradient are built inside the math kernel's block tiles
        kernel = _MATH
    chunk = query.shape[2] // balancers.chunks_per_rank(layout)
    # compiled: the traced loop does not read the host runs, so a new packing does not recompile the block; the
    # pairs are planned from them inside torch.ops.ringmaster.ring_block (the step handle), skipped as in eager
    # mode, where the op runs the call (no ALiBi or relative bias; an aten, math or hub flash block kernel)
    static = torch.compiler.is_compiling()
    by_op = _by_op(kernel, cpb, kwargs.get("alibi_slopes") is None and rel is None)
    plan = RingPlan(layout=layout, size=dist.get_world_size(group), rank=dist.get_rank(group), chunk=chunk,
                    causal=causal, window=kwargs.get("sliding_window"), docs=cpb.docs_on(query.device),
                    alibi=kwargs.get("alibi_slopes"), runs=_plan_runs(cpb, kernel, query.device, by_op),
                    static_docs=static and cpb.doc_ids is not None, handle=cpb.handle if by_op else None)
    return ring_attention(query, key, value, group, plan, kernel, rotate=binding.rotate,
                          scale=kwargs.get("scaling"), sinks=sinks, softcap=kwargs.get("softcap"),
                          rel=None if rel is None else rel.logits())


def ring_attention_hf(module, query, key, value, *, binding: AttentionBinding, cpb, **kwargs):
    """q ``[B, Hq, S/P, D]``, k/v ``[B, Hkv, S/P, D]`` -> ``[B, S/P, Hq, D]``, the shard cut in ``cpb.layout``.

    Masks come from global positions (the layout's chunks), not from HF's per-shard mask;
    the sliding window from the ``sliding_window`` kwarg; sinks from ``s_aux`` / ``module.sinks``;
    Gemma-2's logit cap from ``softcap``. v may have a narrower head dim than q/k (MLA).
    """
    out = ring_core(binding, cpb, module, query, key, value, binding.ring_group, cpb.layout, kwargs,
                    module_sinks(module, kwargs))
    return out.transpose(1, 2).contiguous(), None
