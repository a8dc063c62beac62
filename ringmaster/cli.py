"""``ringmaster`` command line: ``demo`` runs CP on local CPU gloo ranks against a tiny model,
``plan`` prints the cost of each split, ``bench`` runs a short version of the benchmarks,
``check`` answers "will CP be exact for my model?" from its config alone."""

from __future__ import annotations

import argparse
import sys
import time


def _demo_job(ctx, model_type, world, backend, seq_len, attn, overrides, fp64=False):
    from ringmaster.config import RingmasterConfig
    from ringmaster_tools.parity import compare

    cfg = RingmasterConfig(size=world, backend=backend)
    result = compare(model_type, cfg, seq_len=seq_len, device_mesh=ctx.mesh(world), attn_implementation=attn,
                     fp64=fp64, **overrides)
    result["rank"] = ctx.rank
    return result


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _demo_family(name: str) -> None:
    """Refuse, before any rank is spawned, a ``--model`` that is not one of the demo's families (those
    ``demo --help`` lists: the ones with a hand-sized tiny config), with the closest names."""
    import difflib

    from ringmaster_tools.parity import demo_families

    accepted = [f for group in demo_families().values() for f in group]
    if name in accepted:
        return
    close = difflib.get_close_matches(name, accepted, n=5)
    raise SystemExit(f"ringmaster demo: --model {name!r} is not one of the demo's families"
                     + (f"; did you mean {', '.join(close)}?" if close else f" ({', '.join(accepted)})")
                     + f" `ringmaster check {name}` runs CP parity for any causal-LM family of transformers")


def _demo_precision(model_type: str, dtype: str) -> str:
    """``--dtype auto``: float64 for a family with recurrent layers (their per-parameter gradients only hold in
    float64, parity.DEMO_TOL), float32 for the rest."""
    if dtype != "auto":
        return dtype
    from types import SimpleNamespace

    import ringmaster.architectures  # noqa: F401 - registers the families
    from ringmaster.architectures.spec import registered_architecture

    spec = registered_architecture(SimpleNamespace(model_type=model_type))
    return "float64" if spec is not None and spec.recurrent_classes else "float32"


def _demo_heads(args) -> dict:
    """The head counts the demo overrides: the flags where given, else 8 / 4 for an attention family; a hybrid
    keeps its tiny config's (its attention width is tied to other sizes: Zamba2's adapters)."""
    from ringmaster_tools.parity import DEMO_ATTENTION, TINY

    defaults = (8, 4) if args.model in DEMO_ATTENTION else (None, None)
    tiny = TINY.get(args.model, {})
    out = {}
    for key, flag, default in (("num_attention_heads", args.heads, defaults[0]),
                               ("num_key_value_heads", args.kv_heads, defaults[1])):
        value = flag if flag is not None else default
        if value is not None:
            out[key] = value
        elif key in tiny:
            out[key] = tiny[key]
    return out


def demo(args, pool=None) -> int:
    """``ringmaster demo``; ``pool``: a pool of at least ``args.world`` ranks to run in (tests), else one is
    spawned for the run."""
    from ringmaster_tools.parity import DEMO_TOL
    from ringmaster_tools.pool import LocalPool, cpu_kernels_note, torch_kernels_only

    _demo_family(args.model)
    dtype = _demo_precision(args.model, args.dtype)
    tol = DEMO_TOL[dtype]

    overrides = _demo_heads(args)
    heads = ", ".join(f"{k}={v}" for k, v in (("heads", overrides.get("num_attention_heads")),
                                               ("kv_heads", overrides.get("num_key_value_heads"))) if v is not None)
    print(f"ringmaster demo: {args.world} CPU gloo ranks, tiny random {args.model} "
          f"({heads + ', ' if heads else ''}attn={args.attn}, {dtype}), sequence {args.seq} tokens, "
          f"backend={args.backend}")
    start = time.perf_counter()
    note = cpu_kernels_note()
    if note:
        print(note)
    job = (_demo_job, args.model, args.world, args.backend, args.seq, args.attn, overrides, dtype == "float64")
    if pool is not None:
        results = pool.run(*job)
    else:
        with LocalPool(args.world, timeout=args.timeout, init=torch_kernels_only) as spawned:
            results = spawned.run(*job)
    r0 = results[0]
    print(f"one CP forward+backward vs the same model without CP ({time.perf_counter() - start:.1f}s incl. spawn)\n")
    print(f"loss      non-CP {r0['loss_ref']:.6f}   CP (mean over ranks) {r0['loss_cp']:.6f}   "
          f"rel err {r0['loss_err']:.2e}")
    print(f"logits    gathered rel err {r0['logits_err']:.2e}")
    print(f"grads     {r0['n_grads']}/{r0['n_params']} parameters, worst rel err {r0['grad_err']:.2e} "
          f"({r0['worst_param']})\n")
    header = f"{'rank':>4}  {'saved-for-bwd CP':>17}  {'saved non-CP':>13}  {'ratio':>6}  {'peak RSS':>10}  {'bytes sent':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["saved_bytes"] / max(r["ref_saved_bytes"], 1)
        print(f"{r['rank']:>4}  {_fmt_bytes(r['saved_bytes']):>17}  {_fmt_bytes(r['ref_saved_bytes']):>13}  "
              f"{ratio:>6.2f}  {_fmt_bytes(r['peak_rss']):>10}  {_fmt_bytes(r['bytes_sent']):>11}")
    ok = max(r0["loss_err"], r0["logits_err"], r0["grad_err"]) <= tol and not r0["missing_grads"]
    why = ("; float64 because recurrent layers' A_log / dt_bias gradients cancel in float32, docs/api.md"
           if dtype == "float64" and args.dtype == "auto" else "")
    print(f"\nparity {'OK' if ok else 'FAILED'} ({dtype}, tolerance {tol:g} relative, every tensor against its own "
          f"norm{why})")
    return 0 if ok else 1


# the flags only one of ``plan``'s planners reads (--seq, --world, --batch, --dtype: both)
SPLIT_PLAN_FLAGS = ("heads", "kv_heads", "hidden", "layers", "ranks_per_node", "tflops", "intra_gbps",
                    "intra_latency_us", "inter_gbps", "inter_latency_us", "bwd_factor", "documents")
MEMORY_PLAN_FLAGS = ("gpus", "gpu_mem", "checkpointing", "offload", "fsdp", "backend", "loss", "loss_chunk",
                     "optimizer", "no_master_weights", "kernel")


def _refuse_other_planners_flags(args) -> None:
    """``plan`` runs one planner (--config: the memory planner); a flag only the other one reads would be ignored
    silently, so it is refused, naming why."""
    defaults = vars(build_parser().parse_args(["plan", "--seq", "1"]))
    memory = bool(args.config)
    names = SPLIT_PLAN_FLAGS if memory else MEMORY_PLAN_FLAGS
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != defaults[n]]
    if not given:
        return
    flags = " ".join(given)
    if memory:
        raise SystemExit(
            f"ringmaster plan: {flags}: read only by the split planner (without --config), while --config runs the "
            "memory planner, which would ignore " + ("it" if len(given) == 1 else "them")
            + (" (--documents: what load_balance='documents' does with one packed row, from --heads/--kv-heads/"
               "--world/--hidden)" if "--documents" in given else "")
            + ": drop " + ("it" if len(given) == 1 else "them") + ", or run the split planner without --config")
    raise SystemExit(
        f"ringmaster plan: {flags}: read only by the memory planner, which runs with --config <config.json | dir | "
        "model_type>; without it the split planner runs and would ignore " + ("it" if len(given) == 1 else "them")
        + ": add --config, or drop " + ("it" if len(given) == 1 else "them"))


def plan(args) -> int:
    _refuse_other_planners_flags(args)
    if args.config:  # the memory planner: bytes per rank and the longest sequence that fits
        from ringmaster_tools.memory_plan import run_from_args

        return run_from_args(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("heads", "kv_heads", "world", "hidden") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"ringmaster plan: {', '.join(missing)} required (or --config <config.json | dir | "
                         "model_type> for the memory plan)")
    from ringmaster_tools.planning import document_lengths, documents_table, plan_table

    if args.documents:   # load_balance="documents": what the assignment does with this length mix
        lens = document_lengths(args.documents, args.seq)
        print(documents_table(lens, args.world, args.heads, args.kv_heads, args.hidden, _plan_hardware(args),
                              args.ranks_per_node, {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]))
        return 0
    print(plan_table(args.heads, args.kv_heads, args.world, args.ranks_per_node, args.seq, args.hidden, args.layers,
                     args.batch, {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype], hardware=_plan_hardware(args)))
    return 0


def _plan_hardware(args):
    """The step model's inputs from ``plan``'s link flags, or None (then bytes and heads decide)."""
    from ringmaster_tools.step_model import Hardware, Link

    if args.tflops is None and args.intra_gbps is None:
        return None
    if args.tflops is None or args.intra_gbps is None:
        raise SystemExit("ringmaster plan: the step-time model needs both --tflops and --intra-gbps "
                         "(and --inter-gbps when ranks span nodes)")
    inter = Link(args.inter_gbps * 1e9, args.inter_latency_us * 1e-6) if args.inter_gbps else None
    return Hardware(args.tflops * 1e12, Link(args.intra_gbps * 1e9, args.intra_latency_us * 1e-6), inter,
                    args.ranks_per_node, args.bwd_factor)


def bench(args) -> int:
    from ringmaster_tools.bench import bench as run_bench

    run_bench(quick=args.quick, world=args.world, out_dir=args.out, progress=not args.no_progress,
              max_seq=args.max_seq, peer_seq=args.peer_seq)
    return 0


def _load_config(target: str):
    """``ringmaster check``'s target: a config.json, a model directory or a model_type (the memory
    planner's loader, which never downloads)."""
    from ringmaster_tools.memory_plan import load_config

    return load_config(target, tool="check", flag="")


def _check_cases(sizes: list[int]) -> list[tuple[str, int]]:
    cases = []
    for P in sizes:
        cases += [("ulysses", P), ("ring", P)] + ([("usp", P)] if P >= 4 and P % 2 == 0 else [])
    return cases


def _per_kind(row: dict, keys: list[str]) -> dict[str, dict[str, str]]:
    """Per layer kind and case: exact when the whole model is, refused for the kinds a refusal
    names (every kind when it names none: a model-wide refusal), '-' for kinds it did not reach."""
    kinds = row.get("layer_kinds") or ["(model)"]
    out = {k: {} for k in kinds}
    for key in keys:
        case = row[key]
        named = [k for k in kinds if k in case.get("reason", "")]
        for k in kinds:
            if case["verdict"] == "refused":
                out[k][key] = "refused" if (k in named or not named) else "-"
            else:
                out[k][key] = case["verdict"]
    return out


BEST_BACKEND_RULE = "the exact case with the largest CP degree, then the fewest bytes sent per rank"


def _check_plan(base, seq: int):
    """What ``check`` will build for ``base``, decided before any rank starts: ``(config, image_at, note)``;
    ``config`` None when the architecture cannot be checked (``note`` says why)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ringmaster_tools.parity import VLM_TINY
    from ringmaster_tools.zoo import tiny_config, tiny_vlm_config, vlm_image_at, vlm_parent

    model_type = base.model_type
    vlm = vlm_parent(base)
    if vlm is not None:
        config = tiny_vlm_config(base)
        try:
            image_at = vlm_image_at(config, seq)
        except ValueError as e:
            raise SystemExit(f"ringmaster check: {e}") from None
        note = (f"{model_type} is the text config of {vlm}: checked as the decoder of a tiny {vlm}"
                if vlm != model_type else None)
        return config, image_at, note
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None, None, (
            f"{model_type} has no causal-LM class in transformers and is none of the VLM families check builds with "
            f"an image ({', '.join(VLM_TINY)}, or their text configs), so no tiny model of it can run here; nothing "
            "was checked. rm.wire still classifies it: wire your model on the ranks you train on (docs/models.md)")
    return tiny_config(model_type, base=base), None, None


def run_check(pool, base, sizes: list[int], seq: int = 32, target: str = "") -> dict:
    """``ringmaster check``'s work, in a pool of ``max(sizes)`` (or more) ranks: the tiny model of
    ``base``'s architecture (a VLM's with one image in the batch), one parity case per backend and size. Returns
    the JSON-able result (``rc``: 0 some backend exact, 2 every backend refused, the tiny model does not run, or
    the architecture cannot be checked (decided before any rank starts), 1 wrong, crash or hang); ``changed`` and
    ``exercised`` say what the tiny model differs in from ``base`` and what the cases ran through CP."""
    from ringmaster_tools.zoo import _merge_ranks, check_changes, check_exercised, zoo_job

    start = time.perf_counter()
    model_type = base.model_type
    result = {"target": target or model_type, "model_type": model_type, "sizes": sizes}
    config, image_at, note = _check_plan(base, seq)
    if note:
        result["note"] = note
    if config is None:
        result.update(status="not checkable", reason=note, best_backend=None, rc=2, seconds=0.0)
        return result
    family = config.model_type
    cases = _check_cases(sizes)
    try:
        row = _merge_ranks(pool.run(zoo_job, [family], cases, seq, configs={family: config},
                                    images={family: image_at} if image_at is not None else None))[family]
    except TimeoutError as e:
        row = {"family": family, "status": "scored", "layer_kinds": [],
               **{f"{b}{P}": {"verdict": "hang", "reason": str(e).splitlines()[0]} for b, P in cases}}
    keys = [f"{b}{P}" for b, P in cases]
    size_of = {f"{b}{P}": P for b, P in cases}
    result["changed"] = check_changes(base, config, seq)
    if row["status"] != "scored":
        result.update(status="not run", reason=row["reason"], best_backend=None, rc=2)
    else:
        exact = [k for k in keys if row[k]["verdict"] == "exact"]
        best = min(exact, key=lambda k: (-size_of[k], row[k].get("bytes_sent", 0))) if exact else None
        bad = [k for k in keys if row[k]["verdict"] in ("WRONG", "crash", "hang")]
        ran = next((row[k] for k in keys if "attention_layers" in row[k]), {})
        result.update(status="run", attn_implementation=row.get("attn_implementation"),
                      exercised=check_exercised(config, ran, image_at, seq),
                      layer_kinds=_per_kind(row, keys),
                      cases={k: {kk: v for kk, v in row[k].items() if kk in ("verdict", "reason", "errs", "bytes_sent")}
                             for k in keys},
                      best_backend=best, best_backend_rule=BEST_BACKEND_RULE, rc=1 if bad else (0 if exact else 2))
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def check(args) -> int:
    from ringmaster_tools.zoo import RestartingPool

    sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    if not sizes or min(sizes) < 2:
        raise SystemExit(f"ringmaster check: --sizes {args.sizes!r} must list CP degrees >= 2, e.g. 2,4")
    base = _load_config(args.target)
    with RestartingPool(max(sizes), timeout=args.timeout) as pool:   # spawns its ranks at the first case only
        result = run_check(pool, base, sizes, args.seq, args.target)
    rc = result["rc"]
    if args.json:
        import json

        print(json.dumps(result, indent=2, default=str))
    else:
        print_check(result, args.seq)
    return rc


def print_check(result: dict, seq: int) -> None:
    """``ringmaster check``'s report of :func:`run_check`'s result."""
    target, sizes = result["target"], result["sizes"]
    if result["status"] == "not checkable":
        print(f"ringmaster check: {result['model_type']} ({target}): not checked, no rank started: "
              f"{result['reason']}")
        return
    print(f"ringmaster check: {result['model_type']} ({target}), tiny random model, {max(sizes)} CPU gloo "
          f"ranks, {seq} tokens, float64 parity ({result['seconds']:.0f}s)")
    if result.get("note"):
        print(result["note"])
    for line in result.get("changed", []):
        print(f"changed:   {line}")
    if result["status"] != "run":
        print(f"not run: {result['reason']}")
        return
    for line in result["exercised"]:
        print(f"exercised: {line}")
    from ringmaster_tools.pool import cpu_kernels_note

    note = cpu_kernels_note()
    if note:
        print(note)
    keys = list(result["cases"])
    width = max(len(k) for k in result["layer_kinds"]) + 2
    print("\n" + "layer kind".ljust(width) + "".join(k.ljust(10) for k in keys))
    for kind, cells in result["layer_kinds"].items():
        print(kind.ljust(width) + "".join(cells[k].ljust(10) for k in keys))
    print()
    for k in keys:
        c = result["cases"][k]
        detail = (f"loss {c['errs']['loss']:.1e}, logits {c['errs']['logits']:.1e}, worst grad {c['errs']['grad']:.1e}, "
                  f"sent {_fmt_bytes(c.get('bytes_sent', 0))} per rank" if "errs" in c else c["reason"])
        print(f"{k:<10} {c['verdict']:<8} {detail}")
    print(f"\nbest backend: {result['best_backend'] or 'none (every backend refused or failed)'} "
          f"(criterion: {BEST_BACKEND_RULE})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringmaster",
        description="Context parallelism (Ulysses / Ring / USP) for Hugging Face models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "demo",
        help="run CP on local CPU gloo ranks against a tiny random model and print parity, memory and bytes",
        description="Spawn CPU gloo ranks, build a tiny random model, run one context-parallel forward+backward "
                    "and compare loss, gathered logits and every gradient with the same model run without CP. "
                    "Prints per-rank saved-activation memory, peak RSS and bytes communicated.",
    )
    p.add_argument("--world", type=int, default=4, help="CP ranks to spawn (default 4)")
    from ringmaster_tools.parity import DEMO_TOL, demo_families

    groups = demo_families()
    p.add_argument("--model", default="llama", metavar="FAMILY",
                   help="tiny model family (default llama): "
                        + "; ".join(f"{group}: {', '.join(names)}" for group, names in groups.items())
                        + " (any other family: `ringmaster check FAMILY`)")
    p.add_argument("--dtype", choices=["auto", "float32", "float64"], default="auto",
                   help=f"parity precision (default auto: float32, tolerance {DEMO_TOL['float32']:g}, for attention "
                        f"families; float64, tolerance {DEMO_TOL['float64']:g}, for families with recurrent layers, "
                        "whose A_log / dt_bias gradients cancel in float32)")
    p.add_argument("--seq", type=int, default=256, help="sequence length in tokens (default 256)")
    p.add_argument("--heads", type=int, default=None,
                   help="query heads (default 8 for the attention families, the tiny config's for the others)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads (default 4 for the attention families, the tiny config's for the others)")
    p.add_argument("--backend", default="ulysses", help="CP backend (default ulysses)")
    p.add_argument("--attn", default=None, help="inner attention kernel (default: sdpa; eager for gpt_oss)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck rank is killed")
    p.set_defaults(func=demo)

    p = sub.add_parser(
        "plan",
        help="memory planner (--config: bytes per rank, the longest sequence that fits) or split planner "
             "(--heads ...: the Ulysses x Ring split and each alternative's bytes)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Two planners; --config picks the memory planner, and each refuses the other's flags.\n\n"
                    "Memory planner (--config <config.json | model dir | model_type> --seq N [--gpus G --gpu-mem 80GiB]):"
                    "\n  per rank, parameters, gradients and AdamW state (sharded with --fsdp full), what every decoder "
                    "layer saves\n  for backward (layer kinds read from the model on the meta device, as rm.wire "
                    "classifies them),\n  attention temporaries per backend, logits/loss, the peak, and the longest "
                    "sequence that fits per\n  backend and checkpointing mode (none / full / offload). When nothing "
                    "fits it names the flags that\n  would make it fit (--fsdp full, --loss chunked, --optimizer "
                    "fused, more --gpus) with what each gives.\n  Formulas: docs/planner.md.\n\n"
                    "Split planner (--heads H --kv-heads K --world P --hidden D --seq N, no --config):\n  the split "
                    "auto_select chooses and, per rank and attention layer, the bytes each alternative (Ulysses,\n  "
                    "Ring p2p, Ring allgather, USP splits) sends forward and backward and the K/V it keeps resident, "
                    "from\n  closed-form formulas the tests check against gloo runs; with --tflops and --intra-gbps a "
                    "step-time\n  model; with --documents what load_balance='documents' does with one packed row.",
    )
    p.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    p.add_argument("--world", type=int, default=None,
                   help="CP degree, ranks sharing one sequence (split planner; the memory planner's --gpus defaults to it)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    split = p.add_argument_group("split planner (no --config)")
    split.add_argument("--heads", type=int, default=None, help="query heads")
    split.add_argument("--kv-heads", type=int, default=None, help="KV heads")
    split.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    split.add_argument("--hidden", type=int, default=None, help="hidden size (head_dim = hidden / heads)")
    split.add_argument("--layers", type=int, default=1, help="attention layers (for the whole-model column)")
    split.add_argument("--tflops", type=float, default=None,
                       help="attention kernel forward rate per rank, TFLOP/s (with --intra-gbps: model the step time)")
    split.add_argument("--intra-gbps", type=float, default=None, help="intra-node link, GB/s per rank")
    split.add_argument("--intra-latency-us", type=float, default=5.0,
                       help="intra-node latency per call, us (default 5)")
    split.add_argument("--inter-gbps", type=float, default=None, help="inter-node link, GB/s per rank")
    split.add_argument("--inter-latency-us", type=float, default=20.0,
                       help="inter-node latency per call, us (default 20)")
    split.add_argument("--bwd-factor", type=float, default=2.5, help="backward / forward kernel time (default 2.5)")
    split.add_argument("--documents", default=None,
                       help="load_balance='documents' for one packed row: document lengths ('512,512,8000') or "
                            "'lognormal:MU,SIGMA'; prints the threshold, the tokens that travel and the balance per "
                            "backend")
    from ringmaster_tools.memory_plan import add_arguments as add_memory_plan_arguments

    add_memory_plan_arguments(p.add_argument_group("memory planner (--config)"))
    p.set_defaults(func=plan)

    p = sub.add_parser(
        "bench",
        help="short CP-vs-non-CP and peers benchmarks on local CPU gloo ranks, printed as tables",
        description="Run a short version of benchmarks/cp_vs_noncp.py (a small Llama and a Qwen3.5-style hybrid, "
                    "one training step per sequence length, non-CP vs CP at P=2/4: step time, saved-for-backward "
                    "bytes and peak memory per rank) and of benchmarks/peers.py (one causal GQA attention through "
                    "ringmaster's Ulysses / Ring p2p / Ring allgather and every peer that runs here: error, bytes "
                    "per rank, saved bytes, time ratio), with a progress bar. Under torchrun it uses the launched "
                    "ranks (NCCL on GPUs).",
    )
    p.add_argument("--quick", action="store_true", help="smallest shapes (about a minute on 2 cores)")
    p.add_argument("--world", type=int, default=4, help="local ranks to spawn (default 4; P=4 needs 4)")
    p.add_argument("--max-seq", type=int, default=None, help="longest sequence of the CP-vs-non-CP sweep")
    p.add_argument("--peer-seq", type=int, default=None, help="sequence length of the peers benchmark")
    p.add_argument("--out", default=None, help="directory for cp_vs_noncp.csv/.png and peers.csv")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=bench)

    p = sub.add_parser(
        "check",
        help="will CP be exact for my model? tiny random model of its architecture, parity per backend",
        description="Build the tiny random model of an architecture (from a config.json, a model directory or a "
                    "model_type, shrunk as the model zoo does), run CP parity (loss, gathered logits, every "
                    "gradient; float64) on CPU gloo ranks for Ulysses, Ring and USP (where P allows) and print, "
                    "per layer kind, exact or refused with the reason, and the best backend. Exit status: 0 some "
                    "backend exact, 2 every backend refused or nothing could be checked (a VLM or family it cannot build: said before any rank starts), 1 something wrong, crashed or hung. The output says what the tiny model changed (layers, sizes, dropout, windows, the vision tower) and what the cases exercised (attention masks, recurrent kinds, the image), and how the best backend was picked.",
    )
    p.add_argument("target", help="config.json, a model directory, or a model_type (e.g. phi3)")
    p.add_argument("--sizes", default="2,4", help="CP degrees to check (default 2,4)")
    p.add_argument("--seq", type=int, default=32, help="sequence length in tokens (default 32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck rank is killed")
    p.set_defaults(func=check)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    if getattr(args, "attn", "x") is None:
        args.attn = "eager" if args.model == "gpt_oss" else "sdpa"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
