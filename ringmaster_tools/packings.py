"""Compiled training over many packings: graphs per block, recompiles and exactness on every step.

Run on every rank of a CP group (a ``LocalPool`` job: ``benchmarks/compile.py``, ``tests/test_compile.py``,
``tests/test_compile_recurrent.py``).
Every decoder block is compiled with ``torch.compile(block, fullgraph=True)`` before the first CP step; then
``steps`` batches, each a new random packing of the same length (documents of random lengths for ``packed``
and ``documents``, 12 to 20 for ``many``, random left/right padding for ``padded``,
new tokens for ``dense``), run forward (and
backward): the graphs dynamo has compiled after each step, the recompiles, and the loss of every step
against the model without CP.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from . import step_shape


def random_packing(rng: torch.Generator, seq_len: int, quantum: int = 1, max_docs: int = 6,
                   min_docs: int = 1) -> list[int]:
    """Document lengths, multiples of ``quantum`` (at least ``quantum``), summing to ``seq_len``: ``min_docs`` to
    ``max_docs`` documents (fewer where cut points coincide)."""
    units = seq_len // quantum
    n = int(torch.randint(min_docs, max_docs + 1, (1,), generator=rng))
    cuts = sorted(set(torch.randperm(units - 1, generator=rng)[:n - 1].add(1).tolist()))
    bounds = [0, *cuts, units]
    return [(b - a) * quantum for a, b in zip(bounds, bounds[1:])]


def make_step_batch(kind: str, vocab: int, seq_len: int, step: int) -> tuple[dict, str]:
    """The batch of step ``step`` and the kind of reference it needs (dense, packed or padded)."""
    from ringmaster_tools.parity import packed_batch, padded_rows, tiny_batch

    rng = torch.Generator().manual_seed(1000 + step)
    if kind == "dense":
        return tiny_batch(vocab, seq_len, seed=step + 1), "dense"
    if kind in ("packed", "documents"):
        return packed_batch(vocab, random_packing(rng, seq_len), seed=step + 1), "packed"
    if kind == "many":   # 12 to 20 documents: many short ones beside longer ones, as real packed rows hold
        return packed_batch(vocab, random_packing(rng, seq_len, max_docs=20, min_docs=12), seed=step + 1), "packed"
    if kind == "padded":
        left = int(torch.randint(0, seq_len // 4, (1,), generator=rng))
        real = int(torch.randint(seq_len // 4, seq_len - left, (1,), generator=rng))
        return padded_rows(vocab, seq_len, left=left, real=real), "padded"
    raise ValueError(f"batch kind {kind!r}: dense, packed, many, padded or documents")


def graphs_now() -> int:
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def over_packings(ctx, model_name: str, backend: str, kind: str, steps: int = 50, size: int = 2,
                  compiler: str = "eager", backward: bool = True, seq_len: int = 64,
                  eager: bool = False, overrides: dict | None = None, mutate=None, dynamic: bool | None = None,
                  prepare=None) -> dict:
    """``steps`` CP steps over new packings of a two-block model (``step_shape.TWO_BLOCKS``) with every block compiled (``eager=True``: not compiled, the
    baseline); per step the graphs compiled so far and the loss error against the model without CP (the
    gradient error on the first and last step) and the attention work issued (``ringmaster.attention.work``: query-key
pairs handed to a kernel, forward). ``mutate(model)``: edit the wired model before compiling
    (the tests' mutations). ``dynamic``: ``torch.compile``'s (None: its default, static first). ``prepare(model)``:
    edit the CP model before it is wired (the reference without CP is left as built: e.g. name its attention a
    flash kernel, which the ring's ``ring_impl="auto"`` then runs as the hub kernel)."""
    import torch._dynamo

    import ringmaster as rm
    from ringmaster.attention import work
    from ringmaster_tools.parity import group_mean_grad_errors, rel_err

    mesh = ctx.mesh(size)
    group = mesh.get_group("cp")
    torch.manual_seed(0)
    ref = step_shape._model(model_name, **{**step_shape.TWO_BLOCKS[model_name], **(overrides or {})})
    model = copy.deepcopy(ref)
    if prepare is not None:
        prepare(model)
    runtime = rm.wire(model, step_shape._cfg(backend, size), device_mesh=mesh, compile=True)
    if mutate is not None:
        mutate(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # a path that recompiles per packing may do so at different steps on different ranks (uneven shards): raise
    # dynamo's limits so no rank gives up alone (and leaves the others in a collective); the graphs tell
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    torch._dynamo.config.recompile_limit = steps + 16
    torch._dynamo.config.accumulated_recompile_limit = max(limits[1], 64 * (steps + 16))
    blocks = step_shape.decoder_blocks(model)
    record = {"graphs": [], "loss": [], "grad": [], "seconds": [], "pairs": []}
    try:
        if not eager:
            for block in blocks:
                block.compile(fullgraph=True, backend=compiler, dynamic=dynamic)
        for step in range(steps):
            batch, ref_kind = make_step_batch(kind, ref.config.vocab_size, seq_len, step)
            check_grad = backward and step in (0, steps - 1)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            ref_out = step_shape._reference(ref, batch, ref_kind, backward=check_grad)
            t0 = time.perf_counter()
            with work.counting() as tally:
                out = step_shape._cp_step(model, runtime, batch, backward=backward)
            record["seconds"].append(time.perf_counter() - t0)
            record["pairs"].append(tally["pairs"])
            loss = out.loss.detach().clone()
            dist.all_reduce(loss, group=group)
            record["loss"].append(rel_err(loss / size, ref_out.loss.detach()))
            if check_grad:
                grads, missing, _ = group_mean_grad_errors(model, ref, group, size)
                if missing:
                    raise AssertionError(f"step {step}: no CP gradient for {missing}")
                record["grad"].append(max(grads.values()))
            record["graphs"].append(graphs_now())
        record["recompiles"] = sum(torch._dynamo.utils.counters["recompiles"].values()) \
            if "recompiles" in torch._dynamo.utils.counters else None
        record["breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    finally:
        torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = limits
        for block in blocks:
            block._compiled_call_impl = None
        rm.unwire(model)
    return record
