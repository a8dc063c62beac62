"""Benchmarks behind ``ringmaster bench``, ``benchmarks/cp_vs_noncp.py`` and ``benchmarks/peers.py``.

Two measurements, each run on local CPU gloo ranks (:class:`~ringmaster_tools.pool.LocalPool`) or,
under ``torchrun``, on the launched ranks (NCCL when CUDA is available):

* **CP vs non-CP** (:func:`run_cp_vs_noncp`): one training step (forward + backward of a causal
  LM with its loss) of a small Llama and of a Qwen3.5-style hybrid (gated DeltaNet + attention),
  without CP and with CP at P = 2, 4; the sequence length doubles until a time or memory budget
  runs out. Per configuration: the step time (median over repetitions, slowest rank), the bytes
  saved for backward and the peak memory per rank (RSS rise over the step on CPU, the CUDA
  allocator peak on GPU), and the loss (the CP loss is the mean over ranks: equal to non-CP).
* **Peers** (:func:`run_peers`): one causal GQA attention, forward + backward, through
  ringmaster's Ulysses / Ring p2p / Ring allgather and through every peer that runs here:
  torch's native ``context_parallel`` (SDPA), DeepSpeed Ulysses (``DistributedAttention``),
  ring-flash-attn, yunchang (:mod:`ringmaster_tools.peers` makes them run on CPU gloo), and a no-library
  baseline (all-gather K/V with ``torch.distributed.nn`` + SDPA). Per system: the max error
  against the single-process reference (output and dq/dk/dv), the bytes each rank sends (every
  collective counted at the c10d op level, :func:`ringmaster_tools.profiling.count_collectives`, next to
  ringmaster's own record), the bytes saved for backward, and the median step time as a ratio to
  the fastest ringmaster system of the same class (Ulysses / ring) and P.

Times on a shared small CPU machine are noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# --------------------------------------------------------------------------------------------
# ranks: a LocalPool of gloo CPU processes, or the ranks torchrun launched


@dataclass
class _TorchrunContext:
    rank: int
    world: int
    device: str
    _meshes: dict = field(default_factory=dict)


class TorchrunPool:
    """Runs jobs in this process on every rank torchrun started (NCCL on CUDA, else gloo);
    ``run`` returns every rank's result on every rank."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.world = dist.get_world_size()
        self.ctx = _TorchrunContext(dist.get_rank(), self.world, f"cuda:{local}" if cuda else "cpu")

    def run(self, fn: Callable, *args, **kwargs) -> list:
        import torch.distributed as dist

        result = fn(self.ctx, *args, **kwargs)
        out = [None] * self.world
        dist.all_gather_object(out, result)
        return out

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ)


def make_pool(world: int, timeout: float = 600.0):
    """The ranks to run on: torchrun's when launched by it, else ``world`` local CPU gloo processes.

    Local pools get a fixed glibc mmap threshold so freed tensors go back to the OS and the RSS
    high-water mark of each step measures that step (not memory an earlier, larger step left)."""
    if under_torchrun():
        return TorchrunPool()
    from .pool import LocalPool, torch_kernels_only

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return LocalPool(world, timeout=timeout, grace=15.0, init=torch_kernels_only)


def is_main(pool) -> bool:
    return not isinstance(pool, TorchrunPool) or pool.ctx.rank == 0


def _device(ctx) -> str:
    return getattr(ctx, "device", "cpu")


def cp_mesh(ctx, P: int):
    """A 1-D ``("cp",)`` DeviceMesh over ranks 0..P-1 (None on the other ranks). Every rank of the
    pool must call it (group creation is collective); cached per P."""
    key = ("bench_cp", P)
    if key not in ctx._meshes:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ranks = list(range(P))
        group = dist.new_group(ranks) if P < ctx.world else dist.group.WORLD
        device_type = _device(ctx).split(":")[0]
        ctx._meshes[key] = (DeviceMesh.from_group(group, device_type, mesh_dim_names=("cp",))
                            if ctx.rank in ranks else None)
    return ctx._meshes[key]


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain text bar."""

    def __init__(self, total: int, desc: str = "", enabled: bool = True):
        self.total, self.n, self.desc, self.enabled = max(total, 1), 0, desc, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                self._draw("")

    def _draw(self, label: str) -> None:
        width = 30
        done = int(width * self.n / self.total)
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {label:<40}")
        sys.stderr.flush()

    def update(self, label: str = "", n: int = 1) -> None:
        self.n = min(self.n + n, self.total)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(n)
        else:
            self._draw(label)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def fmt_bytes(n) -> str:
    from .profiling import format_bytes

    return format_bytes(n)


# --------------------------------------------------------------------------------------------
# CP vs non-CP: whole-model training steps

# model type and config overrides (on top of parity.COMMON) of the benchmarked models
MODELS: dict[str, tuple[str, dict]] = {
    # a small Llama: 4 layers, 8 heads over 4 KV heads (GQA)
    "llama": ("llama", dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 17)),
    # Qwen3.5-style hybrid: 3 gated-DeltaNet layers per attention layer
    "qwen3_5-hybrid": ("qwen3_5_text", dict(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        max_position_embeddings=1 << 17)),
}
QUICK_MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 15)),
    "qwen3_5-hybrid": ("qwen3_5_text", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
        linear_value_head_dim=16, max_position_embeddings=1 << 15)),
}


def step_job(ctx, model_type: str, overrides: dict, P: int, seq: int, reps: int, backend: str = "auto"):
    """One configuration on every rank of the pool: ranks 0..P-1 run ``reps`` (+1 warm-up) training
    steps of the model, non-CP when P == 1; the other ranks return None at once."""
    import torch
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    mesh = cp_mesh(ctx, P) if P > 1 else None
    if ctx.rank >= P:
        return None
    device = _device(ctx)
    model = tiny_model(model_type, "sdpa", 0, **overrides).to(device)
    batch = {k: v.to(device) for k, v in tiny_batch(model.config.vocab_size, seq, 1, seed=1).items()}
    group = None
    if P > 1:
        runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend=backend), device_mesh=mesh)
        group = runtime.cp_group
        used = runtime.config.backend.value
    else:
        used = "none"
    times, saved, rise, peak, cuda_peak, loss = [], 0, 0, 0, None, 0.0
    try:
        for i in range(reps + 1):
            model.zero_grad(set_to_none=True)
            if group is not None:
                dist.barrier(group=group)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            with rm.profile_memory() as mem:
                start = time.perf_counter()
                if P > 1:
                    with context_parallel_region(batch) as shard:
                        out = model(**shard)
                else:
                    out = model(**batch, use_cache=False)
                out.loss.backward()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
            loss = out.loss.detach()
            del out
            if i:  # the first step warms up
                times.append(elapsed)
            saved = max(saved, mem.peak_saved_bytes)
            rise = max(rise, mem.peak_rss_delta_bytes or 0)
            peak = max(peak, mem.peak_rss_bytes)
            if mem.cuda_peak_bytes is not None:
                cuda_peak = max(cuda_peak or 0, mem.cuda_peak_bytes)
        if group is not None:
            dist.all_reduce(loss, group=group)
            loss = loss / P
    finally:
        if P > 1:
            rm.unwire(model)
            rm.teardown()
    return {"rank": ctx.rank, "backend": used, "time": statistics.median(times) if times else elapsed,
            "saved": saved, "rss_rise": rise, "rss_peak": peak, "cuda_peak": cuda_peak, "loss": float(loss)}


def run_cp_vs_noncp(pool, models: dict[str, tuple[str, dict]], sizes=(1, 2, 4), start_seq: int = 512,
                    max_seq: int = 16384, time_budget: float = 20.0, mem_budget: float = 4 * 2**30,
                    total_budget: float | None = None, reps: int = 2, backend: str = "auto",
                    progress: bool = True) -> list[dict]:
    """Rows of the CP vs non-CP table. For each model and P, sequence lengths double from
    ``start_seq`` until one step takes longer than ``time_budget`` seconds, a rank's memory rise
    exceeds ``mem_budget`` bytes, ``max_seq`` is passed, or ``total_budget`` seconds (per model) have gone."""
    seqs = []
    s = start_seq
    while s <= max_seq:
        seqs.append(s)
        s *= 2
    sizes = [P for P in sizes if P <= pool.world]
    bar = Progress(len(models) * len(sizes) * len(seqs), "cp vs non-cp", progress and is_main(pool))
    began = time.perf_counter()
    rows = []
    for name, (model_type, overrides) in models.items():
        began = time.perf_counter()  # the total budget is per model, so every model gets rows
        stopped: dict[int, str] = {}
        # every P at one length before the next length, so a budget cut keeps comparable rows
        for seq in seqs:
            for P in sizes:
                if P in stopped or (total_budget is not None and time.perf_counter() - began > total_budget):
                    stopped.setdefault(P, "total budget")
                    bar.update(f"{name} P={P} skip")
                    continue
                if seq % (2 * P):
                    bar.update()
                    continue
                results = [r for r in pool.run(step_job, model_type, overrides, P, seq, reps, backend) if r]
                row = {
                    "model": name, "P": P, "backend": results[0]["backend"], "seq": seq,
                    "step_s": max(r["time"] for r in results),
                    "saved_bytes": max(r["saved"] for r in results),
                    "rss_rise_bytes": max(r["rss_rise"] for r in results),
                    "rss_peak_bytes": max(r["rss_peak"] for r in results),
                    "cuda_peak_bytes": max((r["cuda_peak"] or 0) for r in results) if results[0]["cuda_peak"]
                    is not None else None,
                    "loss": results[0]["loss"],
                }
                row["mem_bytes"] = row["cuda_peak_bytes"] if row["cuda_peak_bytes"] is not None else row["rss_rise_bytes"]
                rows.append(row)
                bar.update(f"{name} P={P} seq={seq} {row['step_s']:.2f}s")
                if row["step_s"] > time_budget:
                    stopped[P] = "time budget"
                elif row["mem_bytes"] > mem_budget:
                    stopped[P] = "memory budget"
    bar.close()
    return rows


def cp_table(rows: list[dict]) -> str:
    """The CP vs non-CP table: per model, sequence length and P."""
    cuda = any(r.get("cuda_peak_bytes") is not None for r in rows)
    mem_label = "CUDA peak/rank" if cuda else "RSS rise/rank"
    header = (f"{'model':<15} {'seq':>6} {'P':>2} {'backend':<8} {'step s':>8} {'vs P=1':>7} "
              f"{'saved/rank':>11} {'vs P=1':>7} {mem_label:>14} {'vs P=1':>7} {'loss':>9}")
    lines = [header, "-" * len(header)]
    base = {(r["model"], r["seq"]): r for r in rows if r["P"] == 1}
    for r in sorted(rows, key=lambda r: (r["model"], r["seq"], r["P"])):
        b = base.get((r["model"], r["seq"]))
        ratio = (lambda key: f"{r[key] / b[key]:>7.2f}" if b and b[key] else f"{'-':>7}")
        lines.append(f"{r['model']:<15} {r['seq']:>6} {r['P']:>2} {r['backend']:<8} {r['step_s']:>8.3f} "
                     f"{ratio('step_s')} {fmt_bytes(r['saved_bytes']):>11} {ratio('saved_bytes')} "
                     f"{fmt_bytes(r['mem_bytes']):>14} {ratio('mem_bytes')} {r['loss']:>9.5f}")
    return "\n".join(lines)


CSV_FIELDS = ("model", "P", "backend", "seq", "step_s", "saved_bytes", "rss_rise_bytes", "rss_peak_bytes",
              "cuda_peak_bytes", "mem_bytes", "loss")


def write_csv(rows: list[dict], path: str, fields=CSV_FIELDS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(r)


def write_png(rows: list[dict], path: str) -> str:
    """Plot memory per rank (and step time) against sequence length, one line per model x P.
    Returns a message; matplotlib is optional and its absence only skips the plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: skipped the plot {path} (pip install matplotlib)"
    cuda = any(r.get("cuda_peak_bytes") is not None for r in rows)
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (model, P) in sorted({(r["model"], r["P"]) for r in rows}):
        sub = sorted((r for r in rows if r["model"] == model and r["P"] == P), key=lambda r: r["seq"])
        label = f"{model} {'non-CP' if P == 1 else f'CP P={P}'}"
        style = "-" if P == 1 else "--" if P == 2 else ":"
        ax_mem.plot([r["seq"] for r in sub], [r["mem_bytes"] / 2**20 for r in sub], style, marker="o", label=label)
        ax_time.plot([r["seq"] for r in sub], [r["step_s"] for r in sub], style, marker="o", label=label)
    for ax, ylabel in ((ax_mem, ("CUDA peak" if cuda else "peak RSS rise") + " per rank (MiB)"),
                       (ax_time, "fwd+bwd step (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_mem.set_title("memory per rank vs sequence length")
    ax_time.set_title("step time vs sequence length")
    ax_mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------------------------
# peers: one attention, every system


RINGMASTER_SYSTEMS = ("ringmaster ulysses", "ringmaster ring p2p", "ringmaster ring allgather",
                      "ringmaster ring distflash")
PEER_SYSTEMS = ("deepspeed ulysses", "yunchang ulysses", "torch cp alltoall", "torch cp allgather",
                "ring-flash-attn zigzag", "yunchang ring zigzag", "baseline allgather+sdpa")
SYSTEMS = RINGMASTER_SYSTEMS + PEER_SYSTEMS
# the class a system is compared in: the fastest ringmaster system of its class is its yardstick
SYSTEM_CLASS = {"ringmaster ulysses": "ulysses", "deepspeed ulysses": "ulysses", "yunchang ulysses": "ulysses",
                "baseline allgather+sdpa": "ring"}


def system_class(name: str) -> str:
    if name in SYSTEM_CLASS:
        return SYSTEM_CLASS[name]
    from .peers import PEERS

    return PEERS[name][0] if name in PEERS else "ring"


def _reference(q, k, v, dout):
    import torch
    import torch.nn.functional as F

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def attention_system(name: str, group, P: int, rank: int, S: int, H: int, Hkv: int, D: int, mesh):
    """(layout, fn(q, k, v) -> out) for one of ringmaster's systems or the no-library baseline: q
    ``[B, H, S/P, D]`` local in ``layout``, out the same shape. Peers: :func:`ringmaster_tools.peers.peer_system`.
    Raises :class:`ringmaster_tools.peers.Skip` with the reason when the system cannot run here."""
    import torch
    import torch.nn.functional as F

    from .peers import Skip

    if name == "ringmaster ulysses":
        from ringmaster.attention.ulysses import head_to_seq, kv_replication, seq_to_head

        try:
            rep = kv_replication(H, Hkv, P)
        except ValueError as exc:
            raise Skip(str(exc).split(";")[0]) from None

        def ulysses(q, k, v):
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            qh, kh, vh = seq_to_head([q, k, v], group)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            return head_to_seq(o.transpose(1, 2), group).transpose(1, 2)

        return "contiguous", ulysses
    if name.startswith("ringmaster ring"):
        from ringmaster.config import RingImpl
        from ringmaster.attention.ring.distflash import DistFlashPlan, distflash_attention
        from ringmaster.attention.ring.kernels import get_kernel
        from ringmaster.attention.ring.loop import RingPlan, ring_attention
        from ringmaster.attention.ring.select import resolve_ring_impl

        if name.endswith("distflash"):  # contiguous shards, the work balanced by the schedule
            kernel = get_kernel(resolve_ring_impl(RingImpl.AUTO, "sdpa"))
            dplan = DistFlashPlan(P, rank, S // P)
            return "contiguous", lambda q, k, v: distflash_attention(q, k, v, group, dplan, kernel)
        rotate = "allgather" if name.endswith("allgather") else "alltoall"
        plan = RingPlan("head_tail", P, rank, S // (2 * P))
        kernel = get_kernel(resolve_ring_impl(RingImpl.AUTO, "sdpa"))
        return "head_tail", lambda q, k, v: ring_attention(q, k, v, group, plan, kernel, rotate=rotate)
    if name == "baseline allgather+sdpa":
        import warnings

        from torch.distributed.nn.functional import all_gather as _all_gather

        def all_gather(x, group):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return _all_gather(x.contiguous(), group=group)

        n = S // P

        def naive(q, k, v):
            # one gather for K and V: two autograd gathers may run their backward collectives in a
            # different order on different ranks and silently swap dK and dV
            kf, vf = torch.cat(all_gather(torch.stack([k, v]), group=group), dim=3)
            qpos = rank * n + torch.arange(n, device=q.device)
            mask = torch.arange(S, device=q.device)[None, :] <= qpos[:, None]
            return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=True)

        return "contiguous", naive
    raise ValueError(f"unknown system {name!r}; known: {SYSTEMS}")


def _system(name, group, mesh, P, rank, S, H, Hkv, D):
    """(layout, fn, context factory) of any system."""
    import contextlib

    from .peers import PEERS, peer_system

    if name in PEERS:
        return peer_system(name, group, mesh, P, H, Hkv)
    layout, fn = attention_system(name, group, P, rank, S, H, Hkv, D, mesh)
    return layout, fn, contextlib.nullcontext


def peers_job(ctx, P: int, S: int, H: int, Hkv: int, D: int, reps: int, systems=SYSTEMS):
    """Every system on ranks 0..P-1: error vs the single-process reference, bytes sent (c10d ops,
    and ringmaster's own record), bytes saved for backward, step times. Other ranks return None.

    Per system: one counted step (bytes at the c10d op level, :func:`ringmaster_tools.profiling.count_collectives`,
    whoever issues them; ringmaster's own :func:`profile_comms` record; saved-for-backward bytes). Then
    one untimed warm-up round and ``reps`` timed rounds with no counter active (the counter's dispatch
    mode costs a Python call per op); each round steps every system once, in an order that alternates
    between rounds, so no system pays the process's warm-up or a drift of the machine alone (one system
    after another made the first one up to 1.25x slower on a quiet machine)."""
    import torch
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster_tools.peers import Skip, _why
    from ringmaster_tools.profiling import count_collectives
    from ringmaster.shard import shard_tensor

    mesh = cp_mesh(ctx, P)
    if ctx.rank >= P:
        return None
    group = mesh.get_group()
    rank = dist.get_rank(group)
    device = _device(ctx)
    g = torch.Generator().manual_seed(1234)
    q_full, k_full, v_full = (torch.randn(1, h, S, D, generator=g).to(device) for h in (H, Hkv, Hkv))
    dout_full = torch.randn(1, H, S, D, generator=g).to(device)
    ref_out, ref_grads = _reference(q_full, k_full, v_full, dout_full)
    refs = [ref_out] + ref_grads
    out: dict[str, Any] = {}
    ready = {}  # name -> (fn, context factory, local shards)
    for name in systems:
        try:
            try:
                layout, fn, context = _system(name, group, mesh, P, rank, S, H, Hkv, D)
            except Skip:
                raise
            except Exception as exc:
                raise Skip(_why(exc)) from None
            local = [shard_tensor(t, 2, rank, P, layout) for t in (q_full, k_full, v_full, dout_full)]
            leaves = [t.clone().requires_grad_(True) for t in local[:3]]
            dist.barrier(group=group)
            _sync(device)
            with context(), count_collectives() as comms, rm.profile_comms() as rm_comms, \
                    rm.profile_memory() as mem:
                o = fn(*leaves)
                o.backward(local[3])
            mine = [o.detach()] + [t.grad for t in leaves]
            refs_local = [shard_tensor(t, 2, rank, P, layout) for t in refs]
            out[name] = {"status": "ok", "err": max(_rel(a, b) for a, b in zip(mine, refs_local)),
                         "fwd": comms.total_bytes(phase="forward"), "bwd": comms.total_bytes(phase="backward"),
                         "rm_fwd": rm_comms.total_bytes(phase="forward") if rm_comms.records else None,
                         "rm_bwd": rm_comms.total_bytes(phase="backward") if rm_comms.records else None,
                         "kinds": sorted({f"{r.kind}/{r.phase[:3]}" for r in comms.records}),
                         "saved": mem.peak_saved_bytes, "time": None}
            ready[name] = (fn, context, local)
        except Skip as exc:
            out[name] = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # a peer that imports but fails to run is reported, not fatal
            out[name] = {"status": "failed", "reason": _why(exc)}
        dist.barrier(group=group)
    times: dict[str, list] = {name: [] for name in ready}
    order = list(ready)
    for i in range(reps + 1):  # round 0: the warm-up
        for name in (order if i % 2 else order[::-1]):
            fn, context, local = ready[name]
            try:
                with context():
                    leaves = [t.clone().requires_grad_(True) for t in local[:3]]
                    dist.barrier(group=group)
                    _sync(device)
                    start = time.perf_counter()
                    o = fn(*leaves)
                    o.backward(local[3])
                    _sync(device)
                    if i:
                        times[name].append(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - a peer failing in a later step is reported, not fatal
                out[name] = {"status": "failed", "reason": _why(exc)}
                order.remove(name)
                times.pop(name)
                break
    for name, ts in times.items():
        out[name]["time"] = statistics.median(ts)
    out["_kv_local"] = 2 * (S // P) * Hkv * D * q_full.element_size()
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _max_or_none(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def run_peers(pool, sizes=(2, 4), S: int = 4096, H: int = 8, Hkv: int = 4, D: int = 64, reps: int = 3,
              systems=SYSTEMS, progress: bool = True) -> list[dict]:
    """Rows of the peers table (one per P and system). ``ratio``: the system's step time over the
    fastest ringmaster system of its class (Ulysses class, ring class) at the same P."""
    from .peers import PEERS

    sizes = [P for P in sizes if P <= pool.world]
    bar = Progress(len(sizes), "peers", progress and is_main(pool))
    rows = []
    for P in sizes:
        results = [r for r in pool.run(peers_job, P, S, H, Hkv, D, reps, tuple(systems)) if r]
        kv_local = results[0]["_kv_local"]
        ok = {name for name in systems if all(r[name]["status"] == "ok" for r in results)}
        t = {name: max(r[name]["time"] for r in results) for name in ok}  # a step waits for the slowest rank
        best = {}
        for name in ok:
            if name in RINGMASTER_SYSTEMS:
                c = system_class(name)
                best[c] = min(best.get(c, float("inf")), t[name])
        for name in systems:
            first = results[0][name]
            row = {"P": P, "system": name, "class": system_class(name), "status": first["status"], "S": S, "H": H,
                   "Hkv": Hkv, "D": D, "kv_local": kv_local,
                   "kernel": PEERS[name][1] if name in PEERS else "aten SDPA"}
            if name in ok:
                yard = best.get(row["class"])
                row.update(err=max(r[name]["err"] for r in results),
                           fwd_bytes=max(r[name]["fwd"] for r in results),
                           bwd_bytes=max(r[name]["bwd"] for r in results),
                           rm_fwd_bytes=_max_or_none(r[name]["rm_fwd"] for r in results),
                           rm_bwd_bytes=_max_or_none(r[name]["rm_bwd"] for r in results),
                           saved_bytes=max(r[name]["saved"] for r in results),
                           collectives=" ".join(first["kinds"]),
                           time=t[name], ratio=t[name] / yard if yard else None)
            else:
                row["reason"] = next((r[name].get("reason") for r in results if r[name]["status"] != "ok"), "")
                row["status"] = next((r[name]["status"] for r in results if r[name]["status"] != "ok"), "skipped")
            rows.append(row)
        bar.update(f"P={P}")
    bar.close()
    return rows


def peers_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    lines = [f"causal GQA attention, seq={r0['S']} heads={r0['H']} kv_heads={r0['Hkv']} head_dim={r0['D']} fp32 "
             f"batch=1, fwd+bwd, slowest rank's median step. Sent: bytes per rank at the c10d op level (every "
             f"collective, any library); rm rec: ringmaster's own record. vs rm: step time over the fastest "
             f"ringmaster system of the same class (ulysses / ring) and P.", ""]
    header = (f"{'P':>2} {'system':<26} {'class':<7} {'kernel':<14} {'max rel err':>11} {'fwd sent':>10} "
              f"{'bwd sent':>10} {'rm rec f+b':>10} {'saved/rank':>10} {'median s':>8} {'vs rm':>6}")
    lines += [header, "-" * len(header)]
    skipped = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['P']:>2} {r['system']:<26} {r['class']:<7} {r['status']}: see below")
            skipped.append(f"  P={r['P']} {r['system']}: {r['reason']}")
            continue
        rec = (r["rm_fwd_bytes"] or 0) + (r["rm_bwd_bytes"] or 0) if r.get("rm_fwd_bytes") is not None else None
        ratio = f"{r['ratio']:>6.2f}" if r.get("ratio") is not None else f"{'-':>6}"
        lines.append(f"{r['P']:>2} {r['system']:<26} {r['class']:<7} {r['kernel']:<14} {r['err']:>11.1e} "
                     f"{fmt_bytes(r['fwd_bytes']):>10} {fmt_bytes(r['bwd_bytes']):>10} {fmt_bytes(rec):>10} "
                     f"{fmt_bytes(r['saved_bytes']):>10} {r['time']:>8.3f} {ratio}")
    verdicts = peers_verdict(rows)
    if verdicts:
        lines += ["", f"ringmaster vs the fastest correct peer (max rel err <= {CORRECT:.0e}) of its class; "
                      f"target <= {TARGET:.2f}x:"] + verdicts
    if skipped:
        lines += ["", "not run here:"] + list(dict.fromkeys(skipped))
    return "\n".join(lines)


CORRECT = 1e-4   # a peer row counts as a correct answer below this max relative error
TARGET = 1.05    # issue 18: ringmaster within 1.05x of the fastest peer of its class


def peers_verdict(rows: list[dict]) -> list[str]:
    """One line per (P, class): ringmaster's fastest system against the fastest correct peer.
    Wrong peers (fp32 aliasing in ring-flash-attn / yunchang ring) are left out of the race."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for P, cls in dict.fromkeys((r["P"], r["class"]) for r in ok):
        mine = [r for r in ok if r["P"] == P and r["class"] == cls and r["system"] in RINGMASTER_SYSTEMS]
        peers = [r for r in ok if r["P"] == P and r["class"] == cls and r["system"] not in RINGMASTER_SYSTEMS
                 and not r["system"].startswith("baseline") and r["err"] <= CORRECT]
        if not mine or not peers:
            continue
        a, b = min(mine, key=lambda r: r["time"]), min(peers, key=lambda r: r["time"])
        x = a["time"] / b["time"]
        out.append(f"  P={P} {cls:<7} {a['system']} {a['time']:.3f}s vs {b['system']} {b['time']:.3f}s: "
                   f"{x:.2f}x {'(within target)' if x <= TARGET else '(NOT within target)'}")
    return out


PEER_CSV_FIELDS = ("P", "system", "class", "kernel", "status", "S", "H", "Hkv", "D", "err", "fwd_bytes", "bwd_bytes",
                   "rm_fwd_bytes", "rm_bwd_bytes", "saved_bytes", "collectives", "time", "ratio", "reason")


def write_peers_png(rows: list[dict], path: str) -> str:
    """Step time and bytes sent per rank (forward + backward, c10d ops) against P, one line per
    system that ran. Returns a message; without matplotlib the plot is skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: skipped the plot {path} (pip install matplotlib)"
    ok = [r for r in rows if r["status"] == "ok"]
    fig, (ax_time, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(dict.fromkeys(r["system"] for r in ok)):
        sub = sorted((r for r in ok if r["system"] == name), key=lambda r: r["P"])
        style = dict(linestyle="-" if name in RINGMASTER_SYSTEMS else "--", marker="o", color=colors[i % 20])
        Ps = [r["P"] for r in sub]
        ax_time.plot(Ps, [r["time"] for r in sub], label=name, **style)
        ax_bytes.plot(Ps, [(r["fwd_bytes"] + r["bwd_bytes"]) / 2**20 for r in sub], label=name, **style)
    r0 = rows[0] if rows else {}
    for ax, ylabel, title in ((ax_time, "fwd+bwd step, slowest rank (s)", "step time vs P"),
                              (ax_bytes, "sent per rank, fwd+bwd (MiB)", "bytes vs P (c10d ops)")):
        ax.set_xlabel("P (ranks)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, S={r0.get('S')}")
        ax.set_xticks(sorted({r["P"] for r in ok}) or [2])
        ax.grid(True, alpha=0.3)
    ax_bytes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------------------------
# `ringmaster bench`


def bench(quick: bool = False, world: int = 4, out_dir: str | None = None, progress: bool = True,
          max_seq: int | None = None, peer_seq: int | None = None, pool=None,
          print_fn: Callable[[str], None] = print) -> dict:
    """A short run of both benchmarks in one pool; prints both tables and returns the rows.
    ``pool``: an existing pool (``.run``, ``.world``) instead of spawning ``world`` ranks."""
    began = time.perf_counter()
    if quick:
        cp_kw = dict(models=QUICK_MODELS, start_seq=256, max_seq=512, time_budget=2.0, mem_budget=2**30,
                     total_budget=180.0, reps=1)
        peer_kw = dict(sizes=(2,), S=512, H=8, Hkv=4, D=32, reps=1)
    else:
        cp_kw = dict(models=MODELS, start_seq=512, max_seq=2048, time_budget=8.0, mem_budget=2 * 2**30,
                     total_budget=90.0, reps=2)
        peer_kw = dict(sizes=(2, 4), S=2048, H=8, Hkv=4, D=64, reps=3)
    if max_seq is not None:
        cp_kw["max_seq"] = max_seq
        cp_kw["start_seq"] = min(cp_kw["start_seq"], max_seq)
    if peer_seq is not None:
        peer_kw["S"] = peer_seq
    own = pool is None
    pool = make_pool(world) if own else pool
    try:
        cp_rows = run_cp_vs_noncp(pool, sizes=(1, 2, 4), progress=progress, **cp_kw)
        peer_rows = run_peers(pool, progress=progress, **peer_kw)
    finally:
        if own:
            pool.close()
    if is_main(pool):
        where = "GPU (NCCL)" if isinstance(pool, TorchrunPool) and pool.ctx.device.startswith("cuda") \
            else "CPU gloo"
        print_fn(f"ringmaster bench{' --quick' if quick else ''}: {pool.world} {where} ranks\n")
        print_fn("CP vs non-CP: one training step (forward+backward with loss) per configuration, fp32, batch 1; "
                 "ratios vs P=1 at the same length\n")
        print_fn(cp_table(cp_rows))
        print_fn("")
        print_fn(peers_table(peer_rows))
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            write_csv(cp_rows, os.path.join(out_dir, "cp_vs_noncp.csv"))
            write_csv(peer_rows, os.path.join(out_dir, "peers.csv"), PEER_CSV_FIELDS)
            print_fn(f"\nwrote {out_dir}/cp_vs_noncp.csv, {out_dir}/peers.csv; "
                     + write_png(cp_rows, os.path.join(out_dir, "cp_vs_noncp.png")) + "; "
                     + write_peers_png(peer_rows, os.path.join(out_dir, "peers.png")))
        print_fn(f"\n(done in {time.perf_counter() - began:.0f}s)")
    return {"cp_vs_noncp": cp_rows, "peers": peer_rows}
