"""Rank-side jobs of tests/test_compile.py and tests/test_compile_recurrent.py: decoder blocks compiled with
``fullgraph=True`` after ``rm.wire``."""

from __future__ import annotations

from ringmaster.attention.ring import loop
from ringmaster_tools import step_shape

SMALL = step_shape.TWO_BLOCKS


def compile_parity(ctx, model, backend, P=2, compiler="aot_eager_decomp_partition", batch="dense"):
    """Every block ``compile(fullgraph=True)`` (AOTAutograd with the min-cut partitioner, as inductor uses it,
    without inductor's slow CPU code generation), CP step vs the model without CP. ``batch``: dense, packed or
    padded (step_shape.make_batch)."""
    return step_shape.compile_parity(ctx, model, backend, batch, P, fullgraph=True, compiler=compiler,
                                     overrides=SMALL[model])


def compile_with_host_read_in_ring(ctx, P=2):
    """Mutation: the ring loop reads a tensor value on the host (``.item()``) before each block; the fullgraph
    compile must refuse it (a graph break), not run it."""
    original = loop._forward_block

    def reads_host(kernel, plan, q, *args, **kwargs):
        if q.abs().sum().item() < 0:   # never true: only the host read matters
            raise AssertionError("unreachable")
        return original(kernel, plan, q, *args, **kwargs)

    loop._forward_block = reads_host
    try:
        return compile_parity(ctx, "llama", "ring-alltoall", P)
    finally:
        loop._forward_block = original


def first_forward_compiled(ctx, layers=10, eager_first=False, P=2):
    """A ``layers``-block llama, every block compiled (fullgraph) before its first CP step, three steps: the
    graphs compiled after each, and the loss against the model without CP. ``eager_first=True`` is the
    mutation: the first CP forward's checks run it eagerly again (no replay: ``compat.has_compiled_blocks``
    answers False, so the accounting runs the forward itself eagerly)."""
    import copy

    import torch
    import torch._dynamo

    import ringmaster as rm
    from ringmaster import compat
    from ringmaster_tools.parity import rel_err

    mesh = ctx.mesh(P)
    torch.manual_seed(0)
    ref = step_shape._model("llama", num_hidden_layers=layers)
    batch = step_shape.make_batch("packed", ref.config.vocab_size)
    model = copy.deepcopy(ref)
    ref_loss = step_shape._reference(ref, batch, "packed", backward=False).loss.detach()
    runtime = rm.wire(model, step_shape._cfg("ulysses", P), device_mesh=mesh, compile=True)
    original = compat.has_compiled_blocks
    if eager_first:
        compat.has_compiled_blocks = lambda model: False
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        for block in step_shape.decoder_blocks(model):
            block.compile(fullgraph=True, backend="aot_eager_decomp_partition")
        steps = []
        for _ in range(3):
            out = step_shape._cp_step(model, runtime, batch, backward=False)
            loss = out.loss.detach().clone()
            torch.distributed.all_reduce(loss, group=mesh.get_group("cp"))
            steps.append({"graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                          "loss": rel_err(loss / P, ref_loss)})
    finally:
        compat.has_compiled_blocks = original
        for block in step_shape.decoder_blocks(model):
            block._compiled_call_impl = None
        rm.unwire(model)
    return steps


def over_packings(ctx, model, backend, kind, steps=50, plan_in_python=False, P=2, compiler="eager", dynamic=None,
                  no_spare=False):
    """``steps`` new random packings through compiled blocks (``ringmaster_tools.packings``). ``plan_in_python``:
    the mutation, the compiled Ulysses sdpa tiles plan in the traced block again (the step handle unused), so
    each new packing's document boundaries become Python constants of the graph. ``compiler``: the blocks'
    torch.compile backend (``eager``: dynamo's graphs alone; ``aot_eager_decomp_partition``: the custom ops'
    backward traced by AOTAutograd too); ``dynamic``: its ``dynamic``. ``no_spare``: the mutation, a compiled
    runtime's documents batches without the whole part's spare tokens (``assignment.SPARE`` 0): a rank with no whole
    document runs no whole part, a case of its own."""
    from ringmaster.attention import tiled
    from ringmaster.sharding import assignment
    from ringmaster_tools import packings

    original, spare = tiled.handle.AVAILABLE, assignment.SPARE
    tiled.handle.AVAILABLE = not plan_in_python and original
    assignment.SPARE = 0 if no_spare else spare
    try:
        return packings.over_packings(ctx, model, backend, kind, steps, size=P, compiler=compiler, dynamic=dynamic)
    finally:
        tiled.handle.AVAILABLE, assignment.SPARE = original, spare


def work_compiled_vs_eager(ctx, backend, steps=6, skip_in_op=True, P=2):
    """The attention work (query-key pairs issued, forward) of each step's new packing, compiled and eager.
    ``skip_in_op=False``: the mutation, the compiled ring plans its pairs without the host runs (as before the
    step handle: every document pair computed under its mask)."""
    from ringmaster.attention import work
    from ringmaster.attention.ring import distflash, loop
    from ringmaster_tools import packings

    original, task_forward = loop._host_pairs, distflash._task_forward

    def every_task(q, k, v, step, size, rank, chunk, s, scale, impl):   # distflash: no task skipped in the op
        plan = distflash._op_plan(step, size, rank, chunk, q.device)
        work.issued(q, k)
        o, lse = distflash.kernel_named(impl).forward(q, k, v, scale, distflash.task_mask(plan, distflash._task(plan, s)))
        return o.to(distflash.acc_dtype(q)), lse.to(distflash.acc_dtype(q))

    def without_runs(step, layout, size, rank, chunk, causal, window, src, select, device):
        plan = loop.RingPlan(layout=layout, size=size, rank=rank, chunk=chunk, causal=causal,
                             window=None if window < 0 else window, docs=step.batch.docs_on(device),
                             static_docs=True)
        pairs = loop.block_pairs(plan, src, device)
        return loop._own_split(pairs)[select - 1] if select else pairs

    if not skip_in_op:
        loop._host_pairs, distflash._task_forward = without_runs, every_task
    try:
        compiled = packings.over_packings(ctx, "llama", backend, "packed", steps, size=P, backward=False)
        eager = packings.over_packings(ctx, "llama", backend, "packed", steps, size=P, backward=False, eager=True)
    finally:
        loop._host_pairs, distflash._task_forward = original, task_forward
    return {"compiled": compiled["pairs"], "eager": eager["pairs"], "loss": max(compiled["loss"])}


# a family per recurrent kind beyond gated DeltaNet and Mamba2 (tests/test_compile_recurrent.py)
KIND_FAMILIES = {"mamba1": "falcon_mamba", "lightning": "minimax", "rglru": "recurrent_gemma", "rwkv": "rwkv",
                 "mlstm": "xlstm", "short_conv": "lfm2", "kda": "kimi_linear", "dynamic_short_conv": "inkling2_text"}


def recurrent_kind_compiles(ctx, model_type, P=2, compiler="aot_eager_decomp_partition", recurrent="auto"):
    """A tiny ``model_type`` wired with ``compile=True`` (the scan), its decoder blocks compiled with fullgraph=True
    before the first CP step, two steps (the first compiled too): loss of each and every gradient of the second
    against the model without CP, fp32; graph breaks and graphs; the recurrent kinds wired."""
    import copy

    import torch
    import torch._dynamo

    import ringmaster as rm
    from ringmaster_tools.parity import group_mean_grad_errors, rel_err, tiny_batch, tiny_model

    mesh = ctx.mesh(P)
    group = mesh.get_group("cp")
    torch.manual_seed(0)
    inner = "eager" if model_type in ("recurrent_gemma", "inkling2_text") else "sdpa"
    if model_type == "inkling2_text":   # the zoo's tiny config: parity.tiny_model's shrink leaves no dynamic conv
        from ringmaster_tools.zoo import build_tiny, tiny_config

        ref = build_tiny(model_type, tiny_config(model_type, attn_implementation=inner), 0, torch.float32)
        ref.config._experts_implementation = "batched_mm"   # transformers' eager expert loop is data-dependent
    else:
        ref = tiny_model(model_type, attn_implementation=inner, dtype=torch.float32)
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config.vocab_size, 16)
    ref_out = step_shape._step(ref, {**batch, "use_cache": False})
    runtime = rm.wire(model, rm.RingmasterConfig(size=P, backend="ulysses", recurrent=recurrent), device_mesh=mesh,
                      compile=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    blocks = step_shape.decoder_blocks(model)
    out = {"kinds": sorted({k for _, k in runtime.report.recurrent}), "loss": []}
    try:
        for block in blocks:
            block.compile(fullgraph=True, backend=compiler)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            cp = step_shape._cp_step(model, runtime, batch)
            loss = cp.loss.detach().clone()
            torch.distributed.all_reduce(loss, group=group)
            out["loss"].append(rel_err(loss / P, ref_out.loss.detach()))
        grads, missing, _ = group_mean_grad_errors(model, ref, group, P)
        out.update(grad=max(grads.values()), missing=missing, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                   breaks=sum(torch._dynamo.utils.counters["graph_break"].values()))
    finally:
        for block in blocks:
            block._compiled_call_impl = None
        rm.unwire(model)
    return out


def hybrid_over_packings(ctx, model, backend, steps=20, whole_map_always=False, static_sizes=False, P=2,
                         zero_padding=False, seq_len=64, kind="packed", row_pieces_dropped=False,
                         rglru_decaying_padding=False, lightning_decaying_padding=False, dynamic=None):
    """A hybrid's recurrent layers over ``steps`` new packings, compiled (``ringmaster_tools.packings``): the chunk
    pieces as data (``recurrent.documents.PiecesSegment``). Mutations: ``whole_map_always``, a chunk cut by
    documents still passes the incoming state through its first piece's map; ``static_sizes``, the pieces' count
    and length reach the block as Python ints (``ChunkPieces.n``, ``.L``), not as dynamic sizes; ``zero_padding``,
    the stabilised kinds pad their pieces with zeros (RWKV's key, mLSTM's gates), not with their neutral values;
    ``row_pieces_dropped``, recurrent="heads" without the whole rows' pieces (``CPBatch.row_pieces``): the
    documents cut in Python, per packing; ``rglru_decaying_padding``, RG-LRU's pieces padded with ``a = 0`` (a zero
    state stays zero, any other is wiped) while the segment still claims ``neutral_padding``;
    ``lightning_decaying_padding``, lightning's padding marked ``live`` (its fixed decay applied to the padding too),
    still claiming it."""
    from ringmaster.recurrent import documents, lightning, mlstm, rglru, rwkv
    from ringmaster.sharding.documents import CPBatch
    from ringmaster_tools import packings

    original, sizes = documents.PiecesSegment.local_map, documents.PiecesSegment.__dict__["_sizes"]
    pads = rwkv.PAD_KEY, mlstm.PAD_IGATE, mlstm.PAD_FGATE
    if zero_padding:
        rwkv.PAD_KEY = mlstm.PAD_IGATE = mlstm.PAD_FGATE = 0.0

    def first_map(self):
        import torch

        maps, aux = zip(*(padded.local_map() for padded in self.padded))
        return torch.cat(maps, dim=0).index_select(0, self.first), aux

    if whole_map_always:
        documents.PiecesSegment.local_map = first_map
    if static_sizes:
        documents.PiecesSegment._sizes = staticmethod(lambda pieces: pieces.shapes)
    row_pieces = CPBatch._row_pieces
    if row_pieces_dropped:
        CPBatch._row_pieces = lambda self: None
    rglru_pad = rglru.RglruSegment.with_tensors
    if rglru_decaying_padding:
        def decaying(self, fn):   # a = 0 in the padding
            return type(self)(self.kernel, fn(self.x), fn(self.a), fn(self.reset))
        rglru.RglruSegment.with_tensors = decaying
    lightning_pad = lightning.LightningSegment.with_tensors
    if lightning_decaying_padding:
        def every_token_live(self, fn):   # no live mask: the padding decays the state
            return type(self)(fn(self.q), fn(self.k), fn(self.v), self.slope, self.block_size)
        lightning.LightningSegment.with_tensors = every_token_live
    try:
        return packings.over_packings(ctx, model, backend, kind, steps, size=P, seq_len=seq_len, dynamic=dynamic)
    finally:
        documents.PiecesSegment.local_map, documents.PiecesSegment._sizes = original, sizes
        CPBatch._row_pieces = row_pieces
        rglru.RglruSegment.with_tensors = rglru_pad
        lightning.LightningSegment.with_tensors = lightning_pad
        rwkv.PAD_KEY, mlstm.PAD_IGATE, mlstm.PAD_FGATE = pads


def hub_flash_over_packings(ctx, backend, steps, P=2, old_path=False, model="llama"):
    """llama whose attention is named ``flash_attention_2`` (the ring's ``ring_impl="auto"`` runs the hub flash kernel,
    Ulysses calls it as its inner attention: here ringmaster's CPU stand-in, resolved through ``kernels``'
    LOCAL_KERNELS), its blocks compiled with fullgraph=True, over ``steps`` new packings against the model without CP
    on sdpa; the ring's blocks run inside ringmaster's ops (``ring_block``, ``distflash_task``), Ulysses' varlen call
    inside ``flash_varlen``, the hub kernel's calls with them. ``calls``: the hub block kernel's forward calls (the
    ring) or the kernel's low-level varlen forward calls (Ulysses). ``old_path``: the mutation, the hub kernel traced
    in the block as before (``hf.BY_OP`` without it; Ulysses: ``flash_op.compiles`` answering False): the traced
    plan reads the host runs of each packing. ``model``: a ``step_shape.MODELS`` name (``gemma2-window-softcap``:
    the kernel's window_size and softcap)."""
    from jobs_ring import as_flash_model

    from ringmaster.attention import flash_op
    from ringmaster.attention.ring import hf, hub
    from ringmaster_tools import packings

    ulysses = backend.startswith("ulysses")
    owner, name = (hub._HubOps, "varlen_fwd") if ulysses else (hub.HfKernelsKernel, "forward")
    calls, forward, by_op, compiles = [], getattr(owner, name), hf.BY_OP, flash_op.compiles

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    setattr(owner, name, counted)
    if old_path:
        hf.BY_OP = tuple(k for k in by_op if k is not hf.RingImpl.HF_KERNELS)
        flash_op.compiles = lambda sinks, dropout: False
    try:
        r = packings.over_packings(ctx, model, backend, "packed", steps, size=P,
                                   prepare=lambda cp_model: as_flash_model(cp_model, "flash_attention_2"))
    except Exception as e:   # the mutation: dynamo cannot trace the hub kernel's host-cut varlen calls
        if not old_path:
            raise
        return {"raised": f"{type(e).__name__}: {e}"[:300]}
    finally:
        setattr(owner, name, forward)
        hf.BY_OP, flash_op.compiles = by_op, compiles
    return {**r, "calls": len(calls)}
