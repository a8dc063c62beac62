"""A pool of local CPU gloo ranks that runs one function on every rank and returns the results.

Spawning processes and importing torch/transformers takes seconds on a small machine, so
the demo, the benchmarks and the test suite start one pool and run many jobs in it. A job
that fails on one rank (or hangs past ``timeout``) raises here with every rank's traceback;
a hung pool is killed and must be replaced.
"""

from __future__ import annotations

import glob
import os
import queue
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A job raised on one or more ranks; the message carries each rank's traceback."""


class SkipRank(BaseException):
    """Raised by :meth:`RankContext.mesh` on the ranks outside the first CP group of a solo job (a
    BaseException: a job's ``except Exception`` does not turn it into a result)."""


@dataclass(frozen=True)
class Skipped:
    """What a rank that left a solo job reports; :meth:`LocalPool.run` leaves it out."""


@dataclass
class RankContext:
    """What a job function receives as its first argument on each rank.

    In a ``solo`` pool (the test session's), a job's first ``mesh(cp)`` with ``1 < cp < world`` keeps
    only the first CP group: the other ranks leave the job there (:class:`SkipRank`) instead of
    running the same case again beside it, so the group that runs it has the machine's cores to
    itself. A job that needs every rank after that (the ``dp`` dimension, world collectives, a
    second CP size) passes ``all_groups=True`` to its first ``mesh`` call (the rest of the job keeps
    every rank), or its module sets ``ALL_GROUPS = True``; a solo job that asks for a second CP size
    raises rather than hangs."""

    rank: int
    world: int
    solo: bool = False
    _meshes: dict = field(default_factory=dict)
    _job_all_groups: bool = False
    _solo_cp: int | None = None

    def uses(self, sizes) -> None:
        """Declare the CP sizes this job will ask for: with more than one (a P=2 and a P=4 case in one
        job), every rank stays in the job."""
        if len({int(p) for p in sizes}) > 1:
            self.keep_all_groups()

    def keep_all_groups(self) -> None:
        """Every rank stays in this job (it splits work between the CP groups, or needs the world)."""
        self._job_all_groups = True

    def repeats(self, cp: int) -> bool:
        """Whether a case of CP size ``cp`` on this rank would only repeat the first CP group's: in a solo pool,
        a job that keeps every rank (two CP sizes, :meth:`uses`) runs its cases of a size smaller than the world on
        the first group of that size; the other groups' ranks skip them (their results lack those cases), so the
        first group has the cores to itself, as a solo job's does. Always False outside a solo pool."""
        mesh = self._meshes.get(cp)   # a solo pool makes every mesh at start
        if not (self.solo and self._job_all_groups) or not 1 < cp < self.world or mesh is None:
            return False   # a job on one CP size: its first mesh(cp) call keeps the first group only
        return mesh.get_local_rank("dp") != 0

    def mesh(self, cp: int, all_groups: bool = False):
        """A ``("dp", "cp")`` DeviceMesh with a cp dim of ``cp`` over all ranks (created once, collectively;
        a solo pool creates every one at start, so no job creates one on some ranks only)."""
        if cp not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            if self.world % cp:
                raise ValueError(f"cp={cp} does not divide the pool's world size {self.world}")
            self._meshes[cp] = init_device_mesh("cpu", (self.world // cp, cp), mesh_dim_names=("dp", "cp"))
        mesh = self._meshes[cp]
        if all_groups:
            self._job_all_groups = True   # for the rest of the job
        if self._solo_cp is not None and cp != self._solo_cp:
            raise RuntimeError(
                f"this job left ranks outside its first CP group at mesh({self._solo_cp}); mesh({cp}) needs every "
                "rank: pass all_groups=True to the job's first ctx.mesh call, or set ALL_GROUPS = True in its module")
        if self.solo and not (all_groups or self._job_all_groups) and 1 < cp < self.world:
            self._solo_cp = cp
            if mesh.get_local_rank("dp") != 0:
                raise SkipRank
        return mesh


# optional kernel packages whose kernels take no CPU tensors, yet transformers calls them whenever they import
GPU_KERNEL_PACKAGES = ("fla", "mamba_ssm", "causal_conv1d")


def installed_gpu_kernel_packages() -> list[str]:
    """Which of :data:`GPU_KERNEL_PACKAGES` are installed (looked up, not imported)."""
    import importlib.util

    found = []
    for name in GPU_KERNEL_PACKAGES:
        try:
            if importlib.util.find_spec(name) is not None:
                found.append(name)
        except (ImportError, ValueError):
            pass
    return found


def torch_kernels_only() -> None:
    """A :class:`LocalPool` ``init`` for runs on CPU tensors (``ringmaster demo``, ``check``, the zoo sweep): the
    packages of :data:`GPU_KERNEL_PACKAGES` become unimportable in the worker before transformers imports a
    modeling module, so its recurrent layers run transformers' torch kernels. Installed, they would be resolved
    and fail at their first CPU call (flash-linear-attention's Triton kernels: ``RuntimeError: 0 active
    drivers``). Left alone under Triton's interpreter (``TRITON_INTERPRET=1``), which runs FLA on CPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    for name in GPU_KERNEL_PACKAGES:
        sys.modules.setdefault(name, None)   # `import name` raises ModuleNotFoundError; find_spec returns None


def cpu_kernels_note() -> str | None:
    """The line a CPU run prints when it ran transformers' torch kernels in place of installed GPU packages."""
    found = installed_gpu_kernel_packages()
    if not found or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"note: {', '.join(found)} installed: their kernels need a GPU, so these CPU ranks run transformers' "
            "torch kernels in their place (the same ringmaster wiring)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, backend: str = "gloo",
            sys_path: tuple = (), solo: bool = False, init: Callable | None = None) -> None:
    # before anything imports transformers' modeling modules (their kernels resolve once, at import)
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    init_error = None
    if init is not None:
        try:
            init()
        except BaseException:  # every job then reports it (a worker that died would leave the caller waiting)
            init_error = f"the pool's init {getattr(init, '__name__', init)} failed:\n{traceback.format_exc()}"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    ctx = RankContext(rank, world, solo=solo)
    if solo:
        for cp in range(1, world + 1):
            if world % cp == 0:
                ctx.mesh(cp, all_groups=True)
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        if init_error is not None:
            results.put((job_id, rank, False, init_error))
            continue
        ctx._solo_cp = None
        ctx._job_all_groups = bool(getattr(sys.modules.get(getattr(fn, "__module__", ""), None), "ALL_GROUPS", False))
        try:
            results.put((job_id, rank, True, fn(ctx, *args, **kwargs)))
        except SkipRank:
            results.put((job_id, rank, True, Skipped()))
        except BaseException:  # reported to the caller with the rank's traceback
            results.put((job_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def deepspeed_shm_buffers(port: int) -> list[str]:
    """The shared-memory all-reduce buffers DeepSpeed's CPU communication maps for the ranks of the pool on ``port``
    (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, about 50 MB each, never unlinked; ``_worker`` sets the
    address): none where :func:`without_deepspeed_shm_comm` ran first."""
    return sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))


def without_deepspeed_shm_comm() -> None:
    """Call in a CPU rank before DeepSpeed's communication starts (``deepspeed.comm.init_distributed``,
    ``deepspeed.initialize``, the HF Trainer's ``deepspeed=``): DeepSpeed's collectives then run on the process
    group's own backend (gloo), as they do on NCCL.

    Otherwise DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (C++, minutes on a small machine,
    built under a lock file in ``TORCH_EXTENSIONS_DIR``) and maps a buffer per rank in /dev/shm that it never unlinks.
    A rank killed while it compiles (a pool's timeout) leaves the lock file behind, and every later DeepSpeed rank on
    the machine waits on it for ever: CI at stop 59, where the first DeepSpeed job of a fresh machine timed out while
    compiling and every DeepSpeed pool after it hung. The op is an optimisation of DeepSpeed's CPU all-reduce, which
    ringmaster does not use. Marked incompatible in ``deepspeed.ops.__compatible_ops__`` (the process's one dict,
    which DeepSpeed's comm layer reads before it builds the op)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


class LocalPool:
    def __init__(self, world: int = 4, timeout: float = 300.0, grace: float = 15.0, backend: str = "gloo",
                 sys_path: tuple = (), solo: bool = False, init: Callable | None = None):
        """``backend``: what every rank passes to ``init_process_group`` (``"cuda:gloo"`` builds a CUDA-only
        group on CPU, the stand-in for NCCL in tests/test_devices.py). ``sys_path``: folders each worker puts
        first on its ``sys.path`` before it runs anything (the kernel stand-in packages,
        :data:`standins.kernels.SITE`); the parent process is left alone. ``init``: a module-level function each
        worker calls next, before torch.distributed starts (tests/realkernels.enable_all_in_worker: the real kernel
        packages under Triton's interpreter). ``solo``: a job on a CP size
        smaller than the world runs on its first CP group only (:class:`RankContext`)."""
        self.world, self.timeout, self.grace = world, timeout, grace
        ctx = mp.get_context("spawn")
        self.port = port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world, port, self._tasks[r], self._results, backend,
                                                                    tuple(sys_path), solo, init), daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self._next = 0
        self.broken = False

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the per-rank results in rank order (in a
        solo pool, only the ranks that stayed in the job)."""
        if self.broken:
            raise RuntimeError("this pool was shut down after a failure; start a new LocalPool")
        self._next += 1
        job_id = self._next
        for q in self._tasks:
            q.put((job_id, fn, args, kwargs))
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world:
            failed = any(not ok for ok, _ in got.values())
            try:
                # once a rank has failed the others may be stuck in a collective: wait briefly, then kill
                jid, rank, ok, payload = self._results.get(timeout=self.grace if failed else self.timeout)
            except queue.Empty:
                self.close(force=True)
                missing = sorted(set(range(self.world)) - set(got))
                errors = "".join(f"\n--- rank {r} ---\n{p}" for r, (ok, p) in sorted(got.items()) if not ok)
                raise (RankError if failed else TimeoutError)(
                    f"ranks {missing} did not finish {getattr(fn, '__name__', fn)} "
                    f"({'stuck after another rank failed' if failed else f'within {self.timeout:.0f}s'}); "
                    f"the pool was shut down{errors}")
            if jid == job_id:
                got[rank] = (ok, payload)
        failed = {r: p for r, (ok, p) in got.items() if not ok}
        if failed:
            raise RankError("".join(f"\n--- rank {r} ---\n{p}" for r, p in sorted(failed.items())))
        return [got[r][1] for r in range(self.world) if not isinstance(got[r][1], Skipped)]

    def close(self, force: bool = False) -> None:
        self.broken = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=any(exc))
