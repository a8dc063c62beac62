"""The shape of one CP training step: host syncs per step and whether each decoder block compiles.

Run on every rank of a CP group (a ``LocalPool`` job, ``benchmarks/step_shape.py``, the tests):

* :func:`host_syncs` counts host syncs (:func:`ringmaster_tools.profiling.count_host_syncs`) over one forward
  and backward after a warm-up step, for the model without CP and for the same model wired for CP;
  the shard step (built once per batch from the full batch, on the host) is counted apart.
* :func:`compile_parity` compiles every decoder block with ``torch.compile(block, fullgraph=True)``
  after ``rm.wire`` (torchtitan's order: wire, checkpoint, compile) and compares loss, gathered
  logits and every gradient with the model without CP; a block that cannot compile raises there.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

MODELS = {
    "llama": ("llama", dict(num_hidden_layers=4)),
    "llama-flex": ("llama", dict(num_hidden_layers=4, attn_implementation="flex_attention")),
    "gdn-hybrid": ("qwen3_5_text", dict(num_hidden_layers=4,
                                        layer_types=["linear_attention", "full_attention"] * 2)),
    "mamba2-hybrid": ("bamba", dict(num_hidden_layers=4, attn_layer_indices=[1, 3])),
    # one family per other recurrent kind whose packed rows run as padded pieces (benchmarks/compile.py)
    "mamba1": ("falcon_mamba", dict(num_hidden_layers=2)),
    "kda-hybrid": ("kimi_linear", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                       mlp_layer_types=["dense", "dense"])),
    "lightning-hybrid": ("minimax", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])),
    "rglru-hybrid": ("recurrent_gemma", dict(num_hidden_layers=2, block_types=["recurrent", "attention"],
                                             attn_implementation="eager")),
    "conv-hybrid": ("lfm2", dict(num_hidden_layers=2, full_attn_idxs=[1], layer_types=["conv", "full_attention"])),
    # the stabilised states: padding made neutral through the gates (mLSTM) or the keys (RWKV's WKV)
    "xlstm": ("xlstm", dict(num_blocks=2)),
    "rwkv": ("rwkv", dict(num_hidden_layers=2)),
    # a sliding window (12 of 64 tokens) and logit soft-capping (at 0.5: the tiny model's logits reach it), what a
    # flash kernel takes as window_size / softcap
    "gemma2-window-softcap": ("gemma2", dict(num_hidden_layers=2, sliding_window=12, attn_logit_softcapping=0.5)),
}

# two decoder blocks (one attention, one recurrent for the hybrids): the same code paths, half the compiles
TWO_BLOCKS = {
    "llama": dict(num_hidden_layers=2),
    "gdn-hybrid": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    "mamba2-hybrid": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "llama-flex": dict(num_hidden_layers=2),
    **{name: {} for name in ("mamba1", "kda-hybrid", "lightning-hybrid", "rglru-hybrid", "conv-hybrid", "xlstm",
                             "rwkv", "gemma2-window-softcap")},
}

# backend name -> RingmasterConfig fields (size added per run)
BACKENDS = {
    "ulysses": dict(backend="ulysses"),
    "ulysses-scan": dict(backend="ulysses", recurrent="scan"),   # recurrent layers: the all-gather scan at P=2 too
    "ring-alltoall": dict(backend="ring", rotate_method="alltoall", load_balance="head_tail"),
    "ring-allgather": dict(backend="ring", rotate_method="allgather", load_balance="head_tail"),
    "distflash": dict(backend="ring", rotate_method="alltoall", load_balance="distflash"),
    "usp": dict(backend="usp", ulysses_size=2, ring_size=2),
    # load_balance="documents" on the packed batch [20, 28, 16]: the two longer documents split, the 16 whole
    "ulysses-documents": dict(backend="ulysses", load_balance="documents", documents_threshold=16),
    "ring-documents": dict(backend="ring", rotate_method="alltoall", load_balance="documents", documents_threshold=16),
    "ring-allgather-documents": dict(backend="ring", rotate_method="allgather", load_balance="documents",
                                     documents_threshold=16),
    "usp-documents": dict(backend="usp", ulysses_size=2, ring_size=2, load_balance="documents", documents_threshold=16),
    # recurrent="heads": the recurrent layers head-parallel (whole rows for H/P heads)
    "ulysses-heads": dict(backend="ulysses", recurrent="heads"),
    "ring-heads": dict(backend="ring", rotate_method="alltoall", load_balance="head_tail", recurrent="heads"),
    "ulysses-documents-heads": dict(backend="ulysses", load_balance="documents", documents_threshold=16,
                                    recurrent="heads"),
}


def make_batch(kind: str, vocab: int, seq_len: int = 64) -> dict:
    from ringmaster_tools.parity import packed_batch, padded_rows, tiny_batch

    if kind == "dense":
        return tiny_batch(vocab, seq_len)
    if kind == "packed":
        return packed_batch(vocab, [20, seq_len - 36, 16])
    if kind == "padded":
        return padded_rows(vocab, seq_len)
    raise ValueError(f"batch kind {kind!r}: dense, packed or padded")


def _model(name: str, dtype=torch.float32, **extra):
    from ringmaster_tools.parity import tiny_model

    model_type, overrides = MODELS[name]
    overrides = {**overrides, **extra}
    inner = overrides.pop("attn_implementation", "sdpa")
    return tiny_model(model_type, attn_implementation=inner, dtype=dtype, **overrides)


def _cfg(backend: str, size: int):
    import ringmaster as rm

    return rm.RingmasterConfig(size=size, **BACKENDS[backend])


def _step(model, batch, backward: bool = True):
    with torch.set_grad_enabled(backward):
        out = model(**batch)
    if backward:
        out.loss.backward()
    return out


def _reference(model, batch, batch_kind: str, backward: bool = True):
    """The model without CP: packed rows one document at a time and padded rows one row's real tokens at a
    time (transformers' own recurrent torch kernels ignore packing and padding), else the plain step."""
    from ringmaster_tools.parity import per_document_forward, per_row_forward

    if batch_kind == "dense":
        return _step(model, batch, backward)
    forward = per_document_forward if batch_kind == "packed" else per_row_forward
    with torch.set_grad_enabled(backward):
        out = forward(model, batch)
    if backward:
        out.loss.backward()
    return out


def _cp_step(model, runtime, batch, backward: bool = True):
    from ringmaster.adapters.raw import context_parallel_region

    with context_parallel_region(batch, runtime=runtime) as shard, torch.set_grad_enabled(backward):
        out = model(**shard)
        out.assignment = shard["ringmaster_batch"].assignment   # load_balance="documents" (else None)
    if backward:
        out.loss.backward()
    return out


def host_syncs(ctx, model_name: str, backend: str, batch_kind: str, size: int = 2, overrides: dict | None = None,
               plain_cache: dict | None = None) -> dict:
    """Host syncs of one warm step: ``plain`` (no CP), ``cp`` (forward + backward under CP) and ``shard``
    (the shard step: once per batch, on the host). ``overrides``: config fields over the row's model (fewer
    layers for a quick test). ``plain_cache``: a dict kept across calls, so the model without CP is built, warmed
    and counted once per (model, overrides, batch) rather than once per backend."""
    import ringmaster as rm
    from ringmaster.adapters.raw import context_parallel_region
    from ringmaster_tools.profiling import count_host_syncs

    mesh = ctx.mesh(size)
    key = (model_name, repr(sorted((overrides or {}).items())), batch_kind)
    if plain_cache is not None and key in plain_cache:
        plain, batch, ref = plain_cache[key]
    else:
        torch.manual_seed(0)
        plain = _model(model_name, **(overrides or {}))
        batch = make_batch(batch_kind, plain.config.vocab_size)
        _step(plain, batch)
        with count_host_syncs() as ref:
            _step(plain, batch)
        if plain_cache is not None:
            plain_cache[key] = plain, batch, ref
    model = copy.deepcopy(plain)
    runtime = rm.wire(model, _cfg(backend, size), device_mesh=mesh)
    try:
        _cp_step(model, runtime, batch)
        with count_host_syncs() as shard_syncs:
            region = context_parallel_region(batch, runtime=runtime)
            shard = region.__enter__()
        with count_host_syncs() as cp:
            out = model(**shard)
            out.loss.backward()
        region.__exit__(None, None, None)
    finally:
        rm.unwire(model)
    return {"plain": ref.scalar_reads, "plain_all": ref.total, "cp": cp.scalar_reads, "cp_all": cp.total,
            "cp_ops": dict(cp.ops), "shard": shard_syncs.total}


def compile_parity(ctx, model_name: str, backend: str, batch_kind: str, size: int = 2, fullgraph: bool = True,
                   compiler: str | None = None, backward: bool | None = None, overrides: dict | None = None) -> dict:
    """Every decoder block compiled (``fullgraph``) after ``rm.wire``: errors against the model without
    CP (loss, gathered logits, the worst gradient, each relative to its own norm), graph breaks and the
    graphs compiled. The first CP step runs eagerly (its accounting); the second, compiled, is compared.
    ``compiler``: the torch.compile backend (default ``inductor`` with ``fullgraph``, ``eager`` without;
    ``aot_eager`` traces forward and backward like inductor without its slow CPU codegen). ``backward``:
    run the backward and compare gradients (default: unless the model runs flex_attention on CPU, which
    has no CPU backward in torch 2.13; then forward only, ``grad`` is None). ``overrides``: config fields over
    the row's model (fewer layers for a quick test)."""
    import torch._dynamo

    import ringmaster as rm
    from ringmaster_tools.parity import group_mean_grad_errors, rel_err

    mesh = ctx.mesh(size)
    group = mesh.get_group("cp")
    torch.manual_seed(0)
    ref = _model(model_name, **(overrides or {}))
    batch = make_batch(batch_kind, ref.config.vocab_size)
    model = copy.deepcopy(ref)
    if backward is None:
        backward = ref.config._attn_implementation != "flex_attention"
    ref_out = _reference(ref, batch, batch_kind, backward)
    runtime = rm.wire(model, _cfg(backend, size), device_mesh=mesh, compile=True)   # recurrent auto -> scan
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        for layer in decoder_blocks(model):
            layer.compile(fullgraph=fullgraph, backend=compiler or ("inductor" if fullgraph else "eager"))
        _cp_step(model, runtime, batch, backward)   # the first CP forward runs eagerly (attention.accounting)
        model.zero_grad(set_to_none=True)
        out = _cp_step(model, runtime, batch, backward)   # compiled
        logits = rm.gather_sequence(out.logits.detach(), dim=1, runtime=runtime, assignment=out.assignment)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=group)
        grads, missing, _ = group_mean_grad_errors(model, ref, group, size) if backward else ({}, [], None)
        if missing:
            raise AssertionError(f"no CP gradient for {missing}")
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        for layer in decoder_blocks(model):
            layer._compiled_call_impl = None
        rm.unwire(model)
    ref_logits = ref_out.logits.detach()
    if batch_kind == "padded":   # the reference has no logits at padding positions
        real = batch["attention_mask"].bool()
        logits, ref_logits = logits[real], ref_logits[real]
    return {"loss": rel_err(loss / size, ref_out.loss.detach()), "logits": rel_err(logits, ref_logits),
            "grad": (max(grads.values()) if grads else 0.0) if backward else None, "graph_breaks": breaks,
            "graphs": graphs}


def decoder_blocks(model) -> list:
    """The decoder blocks: the modules of the model's layer list (``model.model.layers``; ``blocks`` for RWKV and
    xLSTM)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "blocks") and len(module):
            return list(module)
    raise ValueError(f"{type(model).__name__}: found no decoder layer list")
