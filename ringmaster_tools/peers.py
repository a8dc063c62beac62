"""Other libraries' context-parallel attention, made runnable on CPU gloo for ``ringmaster bench``.

Nothing here changes how ringmaster runs; it exists so the peers table measures peers instead of
saying "skipped". Each builder returns ``(layout, fn, context)``: ``fn(q, k, v) -> out`` on this
rank's ``[B, H, S/P, D]`` shard in ``layout`` (``"contiguous"`` or ``"head_tail"``, see
:mod:`ringmaster.shard`), and a context manager the steps run inside. A peer that cannot run
raises :class:`Skip` with the reason (not installed, a shape it refuses).

* **DeepSpeed Ulysses** (``deepspeed.sequence.layer.DistributedAttention``): as shipped, on gloo.
* **torch's native context parallel** (``torch.distributed.tensor.experimental.context_parallel``):
  on CPU, SDPA dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which torch's
  CP has no rule for. :func:`torch_cp_cpu_rules` registers, for the block only, a DTensor sharding
  strategy (sequence-sharded q/k/v/out/lse) and an op handler for that op and its backward that
  call torch's own ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the
  CPU kernel as the block op: torch's ring, load balancing and rotation, just a CPU block kernel.
* **ring-flash-attn** (zigzag ring; its ring module is imported without the package ``__init__``,
  whose Hugging Face adapter fails to import against transformers 5) and **yunchang** (Ulysses,
  zigzag ring): they call ``flash_attn``; they are imported inside
  :func:`ringmaster_tools.flash_standin.package.as_flash_attn`, which makes the CPU flash
  stand-in importable as ``flash_attn`` for that import only. Their ring backward starts the dq
  accumulator as ``dq_buffer.to(torch.float32)``, which for fp32 inputs returns the block buffer
  itself (no copy): the next block's backward overwrites it, so their fp32 dq is wrong (the
  table's error column shows it; dk/dv are right; in bf16, their target dtype, or fp64, ``.to``
  copies and dq is right). Not patched: the table reports what the library computes.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .pool import without_deepspeed_shm_comm


class Skip(Exception):
    """A system that cannot run here; the message says why."""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"


# --------------------------------------------------------------------------------------------
# torch context_parallel on CPU


def _cpu_rules():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    seq = Shard(2)

    def fwd_strategy(op_schema):  # (output, logsumexp) <- (query, key, value)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema,
                                               [[seq] * 5, [Replicate()] * 5], input_index=2)

    def bwd_strategy(op_schema):  # (dq, dk, dv) <- (grad_out, query, key, value, out, logsumexp)
        return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                               [[seq] * 9, [Replicate()] * 9], input_index=3)

    def ring_fwd(group, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if attn_mask is not None:
            raise NotImplementedError("torch CP on CPU (ringmaster bench rules): attn_mask is not supported")
        return cp._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                            query, key, value, is_causal=is_causal, dropout_p=dropout_p,
                                            scale=scale)

    def ring_bwd(group, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                 scale=None):
        if attn_mask is not None:
            raise NotImplementedError("torch CP on CPU (ringmaster bench rules): attn_mask is not supported")
        return cp._templated_ring_attention_backward(
            group, 2, bwd_op, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
            out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    def handler(op_call, args, kwargs):  # the shape of torch's own _sdpa_handler
        op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        sharding = op_info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise RuntimeError(f"{op_call}: q/k/v must all be sharded on the sequence dim (Shard(2))")
        ring = ring_fwd if op_call is fwd_op else ring_bwd
        local = ring(op_info.compute_mesh.get_group(), *op_info.local_args, **op_info.local_kwargs)
        return DTensor._op_dispatcher.wrap(local, sharding.output_spec)

    return ((fwd_op, fwd_strategy, RuntimeSchemaInfo(3)), (bwd_op, bwd_strategy, RuntimeSchemaInfo(6))), handler


@contextlib.contextmanager
def torch_cp_cpu_rules():
    """Inside an active ``context_parallel``: CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu``
    forward and backward) on sequence-sharded DTensors runs torch's templated ring attention.

    Opt-in and scoped: the strategies and handlers are removed on exit (``context_parallel``'s own
    exit also drops the handler table it built)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._sharding_rules import _op_strategy_context

    rules, handler = _cpu_rules()
    table = DTensor._op_dispatcher._custom_op_handlers
    added = [op for op, _, _ in rules if op not in table]
    with contextlib.ExitStack() as stack:
        for op, strategy, schema_info in rules:
            stack.enter_context(_op_strategy_context(op, strategy, schema_info))
        for op in added:
            table[op] = handler
        try:
            yield
        finally:
            for op in added:
                if table.get(op) is handler:
                    del table[op]


@contextlib.contextmanager
def torch_context_parallel(mesh, rotate: str):
    """torch's ``context_parallel`` (SDPA patched, head-tail load balancing) with ``rotate``
    ("alltoall" / "allgather") and the CPU rules; restores torch's rotate method on exit."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    old = cp._cp_options.rotate_method
    cp._cp_options.rotate_method = cp._RotateMethod.ALL_TO_ALL if rotate == "alltoall" else cp._RotateMethod.ALL_GATHER
    # context_parallel needs a buffer to pick its load balancer from: a dummy of 2P tokens (head-tail)
    dummy = torch.zeros(1, 1, 2 * mesh.size(), device=mesh.device_type)
    try:
        with context_parallel(mesh, buffers=[dummy], buffer_seq_dims=[2]), torch_cp_cpu_rules():
            yield
    finally:
        cp._cp_options.rotate_method = old


# --------------------------------------------------------------------------------------------
# builders


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or a library's own import-time error
        raise Skip(f"{name} not importable ({_why(exc)}); pip install -e '.[bench]'") from None


def _with_flash_standin(name: str):
    """Import ``name`` with the CPU flash stand-in importable as ``flash_attn``."""
    from .flash_standin.package import as_flash_attn

    with as_flash_attn():
        return _import(name)


def _submodule_without_package_init(package: str, module: str):
    """``package.module`` imported without running ``package/__init__.py``.

    ring-flash-attn's ``__init__`` imports its Hugging Face adapter, which fails against
    transformers 5 (``is_flash_attn_greater_or_equal_2_10`` is gone) although its ring functions
    need nothing from transformers. The package is stood in by a bare module for the import only."""
    import importlib
    import importlib.util
    import sys
    import types

    with contextlib.suppress(Exception):
        return importlib.import_module(f"{package}.{module}")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Skip(f"{package} not importable (ModuleNotFoundError: No module named '{package}'); "
                   "pip install -e '.[bench]'")
    bare = types.ModuleType(package)
    bare.__path__, bare.__spec__ = list(spec.submodule_search_locations), spec
    saved = sys.modules.get(package)
    sys.modules[package] = bare
    try:
        return importlib.import_module(f"{package}.{module}")
    except Exception as exc:
        raise Skip(f"{package}.{module} not importable ({_why(exc)})") from None
    finally:
        if saved is None:
            sys.modules.pop(package, None)
        else:
            sys.modules[package] = saved


def _bshd(fn: Callable) -> Callable:
    """A peer taking ``[B, S, H, D]`` as ours ``[B, H, S, D]``."""
    def wrapped(q, k, v):
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return wrapped


def _local_sdpa(q, k, v, *args, **kwargs):  # [B, S, h, D], for DeepSpeed's DistributedAttention
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)


def deepspeed_ulysses(group, P: int, H: int, Hkv: int):
    layer = _import("deepspeed.sequence.layer")
    without_deepspeed_shm_comm()   # its collectives on the group's backend, no C++ op compiled on a CPU host
    # torch.distributed is already up: DeepSpeed's comm layer wraps it (its documented path for that)
    _import("deepspeed.comm").init_distributed(dist_backend=dist.get_backend(group), auto_mpi_discovery=False,
                                               verbose=False)
    if H % P or Hkv % P:
        raise Skip(f"DeepSpeed Ulysses needs heads ({H}) and KV heads ({Hkv}) divisible by P={P}")
    attn = layer.DistributedAttention(_local_sdpa, group, scatter_idx=2, gather_idx=1)
    return "contiguous", _bshd(lambda q, k, v: attn(q, k, v, 0)), contextlib.nullcontext


def torch_cp(mesh, P: int, H: int, Hkv: int, rotate: str):
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError as exc:
        raise Skip(f"torch.distributed.tensor.experimental.context_parallel missing ({exc})") from None
    if mesh is None:
        raise Skip("torch context_parallel needs a DeviceMesh")

    def fn(q, k, v):  # F.scaled_dot_product_attention is the one context_parallel patched
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return "head_tail", fn, lambda: torch_context_parallel(mesh, rotate)


def ring_flash_attn_zigzag(group, P: int, H: int, Hkv: int):
    from .flash_standin.package import as_flash_attn

    with as_flash_attn():
        rfa = _submodule_without_package_init("ring_flash_attn", "zigzag_ring_flash_attn")
    return "head_tail", _bshd(lambda q, k, v: rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)), \
        contextlib.nullcontext


def yunchang_ulysses(group, P: int, H: int, Hkv: int):
    yc = _with_flash_standin("yunchang")
    kernels = _import("yunchang.kernels")
    if H % P or Hkv % P:
        raise Skip(f"yunchang Ulysses needs heads ({H}) and KV heads ({Hkv}) divisible by P={P}")
    attn = yc.UlyssesAttention(group, attn_type=kernels.AttnType.FA)
    return "contiguous", _bshd(lambda q, k, v: attn(q, k, v, causal=True)), contextlib.nullcontext


def yunchang_ring_zigzag(group, P: int, H: int, Hkv: int):
    _with_flash_standin("yunchang")
    ring = _import("yunchang.ring")
    kernels = _import("yunchang.kernels")
    return "head_tail", _bshd(lambda q, k, v: ring.zigzag_ring_flash_attn_func(
        q, k, v, causal=True, group=group, attn_type=kernels.AttnType.FA)), contextlib.nullcontext


# name -> (class, kernel note, builder(group, mesh, P, H, Hkv))
PEERS: dict[str, tuple[str, str, Callable]] = {
    "deepspeed ulysses": ("ulysses", "aten SDPA", lambda g, m, P, H, Hkv: deepspeed_ulysses(g, P, H, Hkv)),
    "torch cp alltoall": ("ring", "aten CPU flash", lambda g, m, P, H, Hkv: torch_cp(m, P, H, Hkv, "alltoall")),
    "torch cp allgather": ("ring", "aten CPU flash", lambda g, m, P, H, Hkv: torch_cp(m, P, H, Hkv, "allgather")),
    "ring-flash-attn zigzag": ("ring", "flash stand-in", lambda g, m, P, H, Hkv: ring_flash_attn_zigzag(g, P, H, Hkv)),
    "yunchang ulysses": ("ulysses", "flash stand-in", lambda g, m, P, H, Hkv: yunchang_ulysses(g, P, H, Hkv)),
    "yunchang ring zigzag": ("ring", "flash stand-in", lambda g, m, P, H, Hkv: yunchang_ring_zigzag(g, P, H, Hkv)),
}


def peer_system(name: str, group, mesh, P: int, H: int, Hkv: int):
    """``(layout, fn, context)`` of the peer ``name`` (see the module docstring); raises Skip."""
    try:
        return PEERS[name][2](group, mesh, P, H, Hkv)
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; known: {sorted(PEERS)}") from None
