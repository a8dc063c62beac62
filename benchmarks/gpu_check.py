"""The GPU check: one script, one GPU, under 8 minutes. Prints a table and writes it to a file.

    python benchmarks/gpu_check.py [--out gpu_check.md] [--budget 420] [--max-seq 131072]
    python benchmarks/gpu_check.py --device cpu --quick       # the same plumbing on CPU (CI smoke)

What it runs (every row is caught on its own: an error is a row that says so, never a crash):

1. **Parity in bf16, each against an fp32 truth.** A random Llama (and for ring, every rotation
   and layout) is trained one step in bf16 with CP and without, and both are compared with the
   same weights run in fp32 without CP. A CP path passes when its error against the truth is at
   most 2x (+1e-3) the non-CP bf16 model's own error: bf16 rounding is allowed, a CP bug is not.
   Cases: Ulysses with sdpa, with torch's flash kernel (sdpa restricted to the flash backend) and
   with flex; Ring with torch's fused ops (ring_impl='aten': flash / memory-efficient attention,
   no math fallback) for both rotations and layouts, causal, sliding-window and packed rows; USP
   2x2; and Ring / Ulysses with the flash kernels: the flash_attn packages when installed, the hub kernels
   when `kernels` finds them in its local cache (rows say why when neither loads).
   The CP ranks are processes sharing the one GPU, over gloo with CUDA tensors (NCCL refuses two
   ranks on one GPU); NCCL itself runs at world=1 through the same wiring and shard code.
2. **Peak memory and step time per rank** at 16k..128k tokens (doubling) for a ~1B-parameter
   random Llama and a Qwen3.5-style hybrid (3 gated-DeltaNet layers per attention layer), bf16,
   non-CP vs CP at P=2 (two processes on the one GPU: each rank's CUDA allocator peak is its own).
   A series stops at the first OOM or when the time budget is spent.

3. **Recurrent kinds with the real kernel packages.** For Mamba2 (mamba2), Mamba1 (mamba), gated
   DeltaNet (qwen3_5) and KDA (kimi_linear), when transformers resolved their kernels to mamba-ssm,
   causal-conv1d and flash-linear-attention: bf16 CP at P=2 (``scan``, ``sequential``, and for gated
   DeltaNet / KDA flash-linear-attention's own context parallelism, ``recurrent="fla_cp"``, which also
   reports its distance to ``scan``), dense and packed rows, against the fp32 truth, same rule as 1.
   A row says "skipped" naming the package transformers did not find. On CPU these rows run only with
   ``--recurrent-standins``: flash-linear-attention's real kernels under Triton's interpreter (tests/realkernels)
   and ringmaster's stand-ins of mamba-ssm and causal-conv1d (the plumbing, not those kernels).

Record the printed table in docs/benchmarks.md ("GPU check") with the date and the GPU.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback

import torch

# tests/: the CPU plumbing run's stand-ins (tests/standins, never shipped) import from there
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")

# --------------------------------------------------------------------------------------------
# models

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1 << 18)
HYBRID_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                 layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=1 << 18)
PARITY_LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1 << 16)
QUICK_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 12)
QUICK_HYBRID = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=1 << 12)

# flash names ringmaster resolves itself (attention.flash_kernels): the installed flash_attn /
# flash_attn_interface package, else the hub through `kernels` (a hub repo must be in the local cache:
# the GPU machine reaches no network)
FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2",
                 "kernels-community/flash-attn3", "kernels-community/flash-attn4", "kernels-community/vllm-flash-attn3")


def parity_cases(P: int, quick: bool) -> list[dict]:
    """(name, config, inner kernel, batch kind) rows for a CP size."""
    if P == 4:
        return [dict(name="usp 2x2 aten", cfg=dict(backend="usp", ulysses_size=2, ring_size=2), inner="sdpa",
                     batch="causal")]
    rows = [
        dict(name="ulysses sdpa", cfg=dict(backend="ulysses"), inner="sdpa", batch="causal"),
        dict(name="ulysses sdpa packed", cfg=dict(backend="ulysses"), inner="sdpa", batch="packed"),
        dict(name="ulysses sdpa window", cfg=dict(backend="ulysses"), inner="sdpa", batch="window"),
        dict(name="ulysses torch-flash", cfg=dict(backend="ulysses"), inner="sdpa", batch="causal",
             sdpa_backend="FLASH_ATTENTION"),
        dict(name="ulysses flex", cfg=dict(backend="ulysses"), inner="flex_attention", batch="causal"),
    ]
    for rotate in ("alltoall", "allgather"):
        for layout in ("none", "head_tail"):
            rows.append(dict(name=f"ring aten {rotate} {layout}", inner="sdpa", batch="causal",
                             cfg=dict(backend="ring", ring_impl="aten", rotate_method=rotate, load_balance=layout)))
    rows += [
        dict(name="ring aten window", cfg=dict(backend="ring", ring_impl="aten"), inner="sdpa", batch="window"),
        dict(name="ring aten packed", cfg=dict(backend="ring", ring_impl="aten", load_balance="none"), inner="sdpa",
             batch="packed"),
        dict(name="ring aten distflash", cfg=dict(backend="ring", ring_impl="aten", load_balance="distflash"),
             inner="sdpa", batch="causal"),
    ]
    for repo in FLASH_KERNELS[2:3] if quick else FLASH_KERNELS:
        short = repo.split("/")[-1]
        rows.append(dict(name=f"ulysses {short}", cfg=dict(backend="ulysses"), inner=repo, batch="packed"))
        rows.append(dict(name=f"ring {short}", cfg=dict(backend="ring", ring_impl="hf_kernels"), inner=repo,
                         batch="causal"))
    return rows


# --------------------------------------------------------------------------------------------
# ranks: processes sharing one device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, backend, device, job, args, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
        if job is not recurrent_kernel_job:   # that one runs FLA under Triton's interpreter
            from ringmaster_tools.pool import torch_kernels_only

            torch_kernels_only()   # installed GPU kernel packages would fail on CPU tensors
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = job(rank, world, device, *args)
    except BaseException:
        result = {"error": traceback.format_exc(limit=4)}
    out_q.put((rank, result))
    dist.destroy_process_group()


def run_ranks(world: int, job, *args, device: str = "cuda", backend: str = "gloo", timeout: float = 600.0):
    """Run ``job(rank, world, device, *args)`` on ``world`` fresh processes; every rank's result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, device, job, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + timeout
    try:
        while len(results) < world and time.time() < deadline:
            try:
                rank, res = q.get(timeout=5)
                results[rank] = res
            except Exception:  # queue.Empty: check that the ranks are alive
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results.get(r, {"error": f"rank {r} died or timed out"}) for r in range(world)]


# --------------------------------------------------------------------------------------------
# 1. parity


def _batch(kind: str, vocab: int, S: int, device):
    from ringmaster_tools.parity import packed_batch, tiny_batch

    if kind == "packed":
        lens = [S // 4, S // 2 - 8, S // 4 + 8]
        batch = packed_batch(vocab, lens, seed=1)
    else:
        batch = tiny_batch(vocab, S, 1, seed=1)
    return {k: v.to(device) for k, v in batch.items()}


def _cp_step(model, cfg, batch, world: int, ctx=None):
    """Wire ``model`` with ``cfg``, run one CP forward+backward on ``batch`` (inside ``ctx``), unwire:
    the CP-group mean loss, the gathered logits and the CP-group mean gradients (float32)."""
    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region

    runtime = rm.wire(model, cfg)
    try:
        with (ctx if ctx is not None else _null()), context_parallel_region(batch, runtime=runtime) as shard:
            out = model(**shard)
            out.loss.backward()
        loss = out.loss.detach().float().clone()
        dist.all_reduce(loss, group=runtime.cp_group)
        logits = rm.gather_sequence(out.logits.detach().float(), dim=1, runtime=runtime)
        grads = _grads(model)
        for g in grads.values():
            dist.all_reduce(g, group=runtime.cp_group)
            g.div_(world)
    finally:
        rm.unwire(model)
    return loss / world, logits, grads


def _grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _score(row: dict, cp, ref, truth) -> bool:
    """Fill ``row`` with the bf16 CP and bf16 non-CP errors against the fp32 truth (each a
    ``(loss, logits, grads)``) and whether CP is within the rule: at most 2x the non-CP error + 1e-3."""
    (loss, logits, grads), (r_loss, r_logits, r_grads), (t_loss, t_logits, t_grads) = cp, ref, truth
    row.update(loss_cp=_rel(loss, t_loss), loss_ref=_rel(r_loss, t_loss),
               logits_cp=_rel(logits, t_logits), logits_ref=_rel(r_logits, t_logits),
               grad_cp=max(_rel(grads[n], t_grads[n]) for n in t_grads),
               grad_ref=max(_rel(r_grads[n], t_grads[n]) for n in t_grads),
               missing=len(set(t_grads) - set(grads)))
    return all(row[f"{k}_cp"] <= 2 * row[f"{k}_ref"] + 1e-3 for k in ("loss", "logits", "grad"))


def parity_job(rank, world, device, cases, quick):
    """Every case on every rank: fp32 truth and bf16 reference without CP, bf16 with CP."""
    import copy

    import ringmaster as rm
    from ringmaster_tools.parity import tiny_model

    S = 256 if quick else 4096
    overrides = QUICK_LLAMA if quick else PARITY_LLAMA
    rows = []
    references = {}
    for case in cases:
        row = {"case": case["name"], "P": world}
        try:
            extra = dict(overrides)
            if case["batch"] == "window":
                extra.update(sliding_window=S // 8, model_type_override="mistral")
            model_type = extra.pop("model_type_override", "llama")
            inner = case["inner"]
            build_inner = inner if inner in ("sdpa", "eager", "flex_attention") else "sdpa"
            base = tiny_model(model_type, build_inner, 0, **extra).to(device)
            batch = _batch(case["batch"], base.config.vocab_size, S, device)

            key = (model_type, build_inner, case["batch"])
            if key not in references:   # the fp32 truth and the bf16 run without CP, once per model and batch
                truth = copy.deepcopy(base)
                out = truth(**batch, use_cache=False)
                out.loss.backward()
                t_ref = out.loss.detach().float(), out.logits.detach().float(), _grads(truth)
                del truth, out
                ref = copy.deepcopy(base).to(torch.bfloat16)
                out = ref(**batch, use_cache=False)
                out.loss.backward()
                references[key] = (t_ref, (out.loss.detach().float(), out.logits.detach().float(), _grads(ref)))
                del ref, out
            (t_loss, t_logits, t_grads), (r_loss, r_logits, r_grads) = references[key]

            model = copy.deepcopy(base).to(torch.bfloat16)
            del base
            cfg = rm.RingmasterConfig(size=world, **case["cfg"])
            if inner != build_inner:  # a flash kernel: ringmaster resolves and calls it itself, so the name
                _name_attention(model, inner)  # is set as from_pretrained(attn_implementation=...) sets it
            ctx = torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, case["sdpa_backend"])) \
                if case.get("sdpa_backend") else _null()
            loss, logits, grads = _cp_step(model, cfg, batch, world, ctx)
            ok = _score(row, (loss, logits, grads), (r_loss, r_logits, r_grads), (t_loss, t_logits, t_grads))
            row["verdict"] = "ok" if ok and not row["missing"] else "FAIL"
        except BaseException as e:  # one row's failure is that row's result
            row["verdict"] = "error"
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
        rows.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _name_attention(model, name):
    for module in [model, *model.modules()]:
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def nccl_job(rank, world, device, quick):
    """World=1 over NCCL: wiring, sharding, the input check and one step through the same code."""
    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_model

    rows = []
    for backend in ("ulysses", "ring"):
        row = {"case": f"nccl world=1 {backend}", "P": 1}
        try:
            model = tiny_model("llama", "sdpa", 0, **(QUICK_LLAMA if quick else PARITY_LLAMA)).to(device)
            model = model.to(torch.bfloat16)
            batch = _batch("causal", model.config.vocab_size, 256, device)
            runtime = rm.wire(model, rm.RingmasterConfig(size=1, backend=backend))
            try:
                with context_parallel_region(batch, runtime=runtime) as shard:
                    model(**shard).loss.backward()
            finally:
                rm.unwire(model)
            row["verdict"] = "ok"
        except BaseException as e:
            row["verdict"] = "error"
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# 1b. recurrent kinds with the real kernel packages (mamba-ssm, causal-conv1d, flash-linear-attention)

# model_type -> (modeling module, {module-level kernel name: package transformers must resolve it to},
#                strategies checked). fla_cp rows also report their distance to ringmaster's scan.
RECURRENT_KERNEL_FAMILIES = {
    "mamba2": ("transformers.models.mamba2.modeling_mamba2",
               {"mamba2_chunk_scan": "mamba_ssm", "causal_conv1d_fn": "causal_conv1d"}, ("scan", "sequential")),
    "mamba": ("transformers.models.mamba.modeling_mamba",
              {"mamba_selective_scan": "mamba_ssm", "causal_conv1d_fn": "causal_conv1d"}, ("scan", "sequential")),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5",
                     {"torch_chunk_gated_delta_rule": "fla", "causal_conv1d_fn": "causal_conv1d"},
                     ("scan", "sequential", "fla_cp")),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear",
                    {"chunk_kimi_delta_attention": "fla", "causal_conv1d_fn": "causal_conv1d"},
                    ("scan", "sequential", "fla_cp")),
}


def _resolved_packages(module_name: str, kernels: dict) -> tuple[list[str], list[str]]:
    """(kernel -> module lines, packages transformers did not resolve) for one modeling module."""
    import importlib

    from ringmaster.recurrent.fla_cp import kernel_implementation

    module = importlib.import_module(module_name)
    lines, missing = [], []
    for name, package in kernels.items():
        impl = kernel_implementation(getattr(module, name))
        where = getattr(impl, "__module__", "?")
        standin = getattr(sys.modules.get(where), "__ringmaster_standin__", False)
        lines.append(f"{name}={where}")
        if not (where == package or where.startswith(package + ".") or standin):
            missing.append(package)
    return lines, missing


def recurrent_kernel_job(rank, world, device, quick, standins):
    """Every family of :data:`RECURRENT_KERNEL_FAMILIES` whose kernels transformers resolved to the real
    packages: bf16 CP (each strategy, dense and packed rows) against the fp32 truth without CP, next to
    bf16 without CP; ``fla_cp`` rows also give their distance to ringmaster's ``scan``. ``standins``: the
    CPU stand-in packages first on ``sys.path`` (plumbing run only; never on a GPU)."""
    import copy

    if standins:
        sys.path.append(TESTS)
        import realkernels
        import realkernels.mamba
        from standins.kernels import SITE

        realkernels.unhide()              # a test run hides FLA from its subprocesses
        realkernels.enable()              # FLA's Triton kernels under the interpreter
        try:
            realkernels.mamba.load_mamba_ssm()   # mamba-ssm's Triton SSD scan from its sdist (Mamba1: no CPU code)
        except realkernels.mamba.Unavailable as e:
            print(f"mamba-ssm's sdist unavailable ({e}): its rows use transformers' torch kernels", file=sys.stderr)
        sys.path.insert(0, SITE)          # the causal-conv1d stand-in, before transformers imports the models
    import ringmaster as rm
    from ringmaster_tools.parity import per_document_forward, tiny_model

    S = 64 if quick else 4096
    # Triton's interpreter computes FLA's bf16 kernels wrongly on CPU (gradients off by 1e25 with or without CP):
    # the CPU plumbing runs fp32 against the fp32 truth; a GPU runs bf16
    low = torch.float32 if standins else torch.bfloat16
    rows = []
    for model_type, (module_name, kernels, strategies) in RECURRENT_KERNEL_FAMILIES.items():
        try:
            lines, missing = _resolved_packages(module_name, kernels)
        except BaseException as e:
            rows.append({"case": f"recurrent {model_type}", "P": world, "verdict": "error",
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            continue
        if missing:
            rows.append({"case": f"recurrent {model_type}", "P": world, "verdict": "skipped",
                         "error": f"{', '.join(sorted(set(missing)))} not installed ({'; '.join(lines)})"})
            continue
        scan_out = {}
        for strategy in strategies:
            for kind in ("causal", "packed"):
                if strategy == "sequential" and kind == "packed":
                    continue
                row = {"case": f"recurrent {model_type} {strategy} {kind}", "P": world}
                try:
                    base = tiny_model(model_type).to(device=device, dtype=torch.float32)
                    batch = _batch(kind, base.config.vocab_size, S, device)
                    # packed: the non-CP reference is every document alone (a recurrent layer without
                    # cu_seqlens/seq_idx would carry state across the row's documents)
                    forward = ((lambda m: per_document_forward(m, batch)) if kind == "packed"
                               else (lambda m: m(**batch, use_cache=False)))
                    truth = copy.deepcopy(base)
                    out = forward(truth)
                    out.loss.backward()
                    t_loss, t_logits, t_grads = out.loss.detach().float(), out.logits.detach().float(), _grads(truth)
                    del truth, out
                    ref = copy.deepcopy(base).to(low)
                    out = forward(ref)
                    out.loss.backward()
                    r_loss, r_logits, r_grads = out.loss.detach().float(), out.logits.detach().float(), _grads(ref)
                    del ref, out
                    model = copy.deepcopy(base).to(low)
                    loss, logits, grads = _cp_step(
                        model, rm.RingmasterConfig(size=world, backend="ulysses", recurrent=strategy,
                                                   load_balance="none"), batch, world)
                    ok = _score(row, (loss, logits, grads), (r_loss, r_logits, r_grads),
                                (t_loss, t_logits, t_grads))
                    if strategy == "scan":
                        scan_out[kind] = (logits, grads)
                    elif strategy == "fla_cp" and kind in scan_out:
                        s_logits, s_grads = scan_out[kind]
                        row["case"] += (f" (vs scan: logits {_rel(logits, s_logits):.1e}, grad "
                                        f"{max(_rel(grads[n], s_grads[n]) for n in s_grads):.1e})")
                    row["verdict"] = "ok" if ok and not row["missing"] else "FAIL"
                except BaseException as e:
                    row["verdict"] = "error"
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
                rows.append(row)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------
# 2. memory and step time


def step_job(rank, world, device, model_name, overrides, S, reps):
    import statistics

    import torch.distributed as dist

    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.parity import tiny_batch, tiny_model

    model_type = "qwen3_5_text" if model_name == "hybrid" else "llama"
    with torch.device(device):
        model = tiny_model(model_type, "sdpa", 0, **overrides)
    model = model.to(device=device, dtype=torch.bfloat16)
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = {k: v.to(device) for k, v in tiny_batch(model.config.vocab_size, S, 1, seed=1).items()}
    runtime = rm.wire(model, rm.RingmasterConfig(size=world)) if world > 1 else None
    times, peak = [], 0
    try:
        for i in range(reps + 1):
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            if runtime is not None:
                with context_parallel_region(batch, runtime=runtime) as shard:
                    model(**shard).loss.backward()
            else:
                model(**batch, use_cache=False).loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated())
            if i:
                times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        if runtime is not None:
            rm.unwire(model)
    return {"time": statistics.median(times), "peak": peak,
            "backend": runtime.config.backend.value if runtime is not None else "none"}


# --------------------------------------------------------------------------------------------
# tables


def parity_table(rows: list[dict]) -> str:
    head = "| case | P | loss err CP / non-CP | logits err CP / non-CP | worst grad err CP / non-CP | verdict |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("verdict") == "error" or "loss_cp" not in r:
            lines.append(f"| {r['case']} | {r['P']} | | | | {r.get('verdict')}: {r.get('error', '')} |")
            continue
        lines.append(f"| {r['case']} | {r['P']} | {r['loss_cp']:.2e} / {r['loss_ref']:.2e} | "
                     f"{r['logits_cp']:.2e} / {r['logits_ref']:.2e} | {r['grad_cp']:.2e} / {r['grad_ref']:.2e} | "
                     f"{r['verdict']} |")
    return "\n".join(lines)


def planned_peak(model_name: str, overrides: dict, S: int, P: int, backend: str) -> tuple[float, str]:
    """The memory planner's peak for ``step_job``'s step (bf16 parameters and gradients, no optimizer,
    full checkpointing) and the kernel it assumed: "fast" when the GPU packages import, else "torch"."""
    import importlib.util

    from ringmaster_tools.memory_plan import ModelShape, PlanOptions, plan
    from ringmaster_tools.parity import COMMON, TINY

    model_type = "qwen3_5_text" if model_name == "hybrid" else "llama"
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**COMMON, "use_cache": False, **TINY.get(model_type, {}),
                                                 **overrides})
    fast = model_type == "llama" or importlib.util.find_spec("fla") is not None
    kernel = "fast" if fast and torch.cuda.is_available() else "torch"
    p = plan(ModelShape.from_config(config), PlanOptions(seq=S, gpus=P, dtype="bf16", master_weights=False,
                                                         checkpointing="full", optimizer="fused", kernel=kernel,
                                                         backend=backend if P > 1 else "ulysses"))
    optimizer_state = next(v for k, v in p.parts.items() if k.startswith("optimizer state"))
    return p.total - optimizer_state, kernel


def memory_table(rows: list[dict]) -> str:
    lines = ["| model | S | non-CP peak GiB | non-CP step s | CP P=2 backend | CP peak GiB/rank | CP step s | peak ratio "
             "| planned non-CP / CP GiB (kernel) | planned / measured non-CP, CP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(x, key, fmt):
            if x is None:
                return "-"
            if x.get("oom"):
                return "OOM"
            if "error" in x:
                return "error"
            return fmt(x[key])
        ratio = "-"
        if r["cp"] and r["ref"] and "peak" in r["cp"] and "peak" in r["ref"] and r["ref"]["peak"]:
            ratio = f"{r['cp']['peak'] / r['ref']['peak']:.2f}"
        lines.append(f"| {r['model']} | {r['S']} | {cell(r['ref'], 'peak', lambda v: f'{v / 2**30:.2f}')} | "
                     f"{cell(r['ref'], 'time', lambda v: f'{v:.3f}')} | "
                     f"{(r['cp'] or {}).get('backend', '-')} | {cell(r['cp'], 'peak', lambda v: f'{v / 2**30:.2f}')} | "
                     f"{cell(r['cp'], 'time', lambda v: f'{v:.3f}')} | {ratio} | {planned_cells(r)} |")
    return "\n".join(lines)


def planned_cells(r: dict) -> str:
    plan_ref, plan_cp, kernel = r.get("planned") or (None, None, "-")
    if plan_ref is None:
        return "- | -"
    ratios = [f"{p / x['peak']:.2f}" if x and x.get("peak") else "-" for p, x in ((plan_ref, r["ref"]),
                                                                                  (plan_cp, r["cp"]))]
    return f"{plan_ref / 2**30:.2f} / {plan_cp / 2**30:.2f} ({kernel}) | {', '.join(ratios)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.md")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run of the plumbing)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds after which no new memory configuration starts (the run stays under 8 min)")
    parser.add_argument("--min-seq", type=int, default=16384)
    parser.add_argument("--max-seq", type=int, default=131072)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--sizes", default="2,4", help="the CP sizes of the parity rows (the CPU smoke run's "
                                                        "P=4 row runs in the test session's pool instead)")
    parser.add_argument("--recurrent-standins", action="store_true",
                        help="on CPU: run the recurrent-kernel rows with FLA's real kernels under Triton's "
                             "interpreter and ringmaster's mamba-ssm / causal-conv1d stand-ins (plumbing)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    start = time.time()
    device = args.device
    if device == "cpu":  # the plumbing run: hub flash names resolve to ringmaster's CPU stand-in (never on GPU)
        sys.path.append(TESTS)
        from standins.flash_repos import local_kernels

        os.environ["LOCAL_KERNELS"] = local_kernels(os.environ.get("LOCAL_KERNELS"))
    header = [f"# GPU check ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'CPU'})", ""]
    print("\n".join(header), flush=True)

    parity = []
    for P in sorted({int(x) for x in args.sizes.split(",") if x.strip()}):
        parity += [r for rank_rows in run_ranks(P, parity_job, parity_cases(P, args.quick), args.quick,
                                                device=device)[:1]
                   for r in (rank_rows if isinstance(rank_rows, list) else [{"case": f"P={P}", "P": P,
                                                                                 "verdict": "error",
                                                                                 "error": rank_rows["error"]}])]
    if device == "cuda":
        nccl = run_ranks(1, nccl_job, args.quick, device=device, backend="nccl")[0]
        parity += nccl if isinstance(nccl, list) else [{"case": "nccl", "P": 1, "verdict": "error",
                                                        "error": nccl["error"]}]
    text = "## bf16 parity against an fp32 truth\n\n" + parity_table(parity)
    print(text, flush=True)

    if device == "cuda" or args.recurrent_standins:
        rk = run_ranks(2, recurrent_kernel_job, args.quick, device == "cpu", device=device)[0]
        rk = rk if isinstance(rk, list) else [{"case": "recurrent kernels", "P": 2, "verdict": "error",
                                               "error": rk["error"]}]
        parity += rk
        part = ("\n\n## Recurrent kinds with mamba-ssm / causal-conv1d / flash-linear-attention "
                f"({'CPU stand-ins' if device == 'cpu' else 'real kernels'})\n\n" + parity_table(rk))
        text += part
        print(part, flush=True)

    memory = []
    if not args.skip_memory:
        models = {"llama-1B": ("llama", QUICK_LLAMA if args.quick else LLAMA_1B),
                  "qwen3.5-hybrid-1B": ("hybrid", QUICK_HYBRID if args.quick else HYBRID_1B)}
        for label, (name, overrides) in models.items():
            S = 256 if args.quick else args.min_seq
            ref_alive = True
            while S <= (1024 if args.quick else args.max_seq) and time.time() - start < args.budget:
                ref = run_ranks(1, step_job, name, overrides, S, 1, device=device)[0] if ref_alive else None
                ref_alive = ref_alive and not (ref or {}).get("oom")
                cp = run_ranks(2, step_job, name, overrides, S, 1, device=device)
                cp_row = next((r for r in cp if "error" in r or r.get("oom")), cp[0])
                if "peak" in cp_row:
                    cp_row = dict(cp_row, peak=max(r.get("peak", 0) for r in cp))
                try:
                    plan_ref, kernel = planned_peak(name, overrides, S, 1, "ulysses")
                    plan_cp, _ = planned_peak(name, overrides, S, 2, cp_row.get("backend", "ulysses"))
                    planned = (plan_ref, plan_cp, kernel)
                except Exception as e:  # noqa: BLE001 - the planner's failure must not lose the measured row
                    print(f"planner: {type(e).__name__}: {e}", flush=True)
                    planned = None
                memory.append({"model": label, "S": S, "ref": ref, "cp": cp_row, "planned": planned})
                if cp_row.get("oom") or "error" in cp_row:
                    break
                S *= 2
        text += "\n\n## Peak memory and step time per rank (bf16, activation checkpointing)\n\n" + memory_table(memory)
        print("\n## memory\n" + memory_table(memory), flush=True)
    text = "\n".join(header) + "\n" + text + f"\n\n(total {time.time() - start:.0f} s)\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} in {time.time() - start:.0f} s", flush=True)
    failed = [r for r in parity if r.get("verdict") == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
