"""Decoder blocks compile with ``torch.compile(block, fullgraph=True)`` after ``rm.wire`` and stay exact.

Each case compiles every block of a tiny model (torchtitan's order: wire, then compile), runs one CP
step and compares loss, gathered logits and every gradient with the model without CP
(``ringmaster_tools.step_shape.compile_parity``). The backend is ``aot_eager_decomp_partition``:
AOTAutograd's forward/backward graphs with the min-cut partitioner inductor uses (the one that keeps
collectives where ringmaster pins them), minus inductor's CPU code generation, too slow for the suite;
``benchmarks/step_shape.py`` / ``ringmaster_tools.step_shape`` runs the same rows with inductor.
"""

import jobs_compile
import pytest
import torch

from ringmaster_tools.pool import RankError

TOL = 1e-5
GDN_GRAD_TOL = 5e-3   # fp32 cancellation in gated DeltaNet's A_log / dt_bias gradients, as in eager (fp64 elsewhere)


@pytest.mark.parametrize("model, backend, grad_tol", [
    ("llama", "ulysses", TOL),
    ("llama", "ring-alltoall", TOL),
    ("gdn-hybrid", "ulysses", GDN_GRAD_TOL),   # rm.wire(compile=True): recurrent auto -> the scan at P=2 too
])
def test_fullgraph_compile_matches_single_device(pool, model, backend, grad_tol):
    for r in pool.run(jobs_compile.compile_parity, model, backend):
        assert r["graph_breaks"] == 0 and r["graphs"] >= 1, r
        assert r["loss"] <= TOL and r["logits"] <= TOL, r
        assert r["grad"] <= grad_tol, r


def test_flex_model_compiles_under_usp(pool):
    """A flex_attention model under USP (Ulysses 2 x Ring 2) on a packed row: every block compiles with
    fullgraph=True, no graph break, logits as the model without CP (forward: torch 2.13's flex has no CPU backward
    for the reference; the ring's own blocks are the aten kernels whose backward the llama rows check; measured
    too: Ring and distflash at P=2, the same)."""
    for r in pool.run(jobs_compile.compile_parity, "llama-flex", "usp", 4, batch="packed"):
        assert r["graph_breaks"] == 0 and r["graphs"] >= 1, r
        assert r["loss"] <= TOL and r["logits"] <= TOL, r


def test_fullgraph_compile_with_documents(pool):
    """load_balance="documents" on a packed row (two documents split, one whole on its rank) through a gated-DeltaNet
    hybrid: the attention's two parts and the recurrent kernels' (by_parts) compile with fullgraph=True per block
    and match the model without CP (the ring's split part is the static ring loop compiled above; measured too:
    llama ring-documents, 0 breaks, exact). Dynamo's eager backend: fullgraph is a property of the capture, which
    this checks; AOTAutograd's trace of the backward runs for the dense rows above (measured with it too: exact,
    at three times the cost)."""
    for r in pool.run(jobs_compile.compile_parity, "gdn-hybrid", "ulysses-documents", compiler="eager", batch="packed"):
        assert r["graph_breaks"] == 0 and r["graphs"] >= 1, r
        assert r["loss"] <= TOL and r["logits"] <= TOL, r
        assert r["grad"] <= GDN_GRAD_TOL, r


def test_mutation_host_read_in_ring_breaks_fullgraph(pool):
    """A host read (``.item()``) put back into the ring loop, branching on the value as host reads do: fullgraph
    compile raises (torch 2.13 traces the read as a symbol, then cannot decide the branch; with
    ``capture_scalar_outputs`` off the read itself is the graph break)."""
    with pytest.raises(RankError, match=r"data-dependent expression|Tensor\.item\(\)"):
        pool.run(jobs_compile.compile_with_host_read_in_ring)


def test_first_cp_forward_runs_compiled_and_one_graph_serves_every_block(pool):
    """Blocks compiled before the first CP step: that step runs compiled too (its one-time accounting and
    token-mixing check record an eager replay after it, before the loss can be used), 10 blocks share their
    graphs (<= 2, stable from the first step) and the loss matches the model without CP."""
    for steps in pool.run(jobs_compile.first_forward_compiled, 10):
        assert 1 <= steps[0]["graphs"] <= 2, steps
        assert steps[2]["graphs"] == steps[1]["graphs"] == steps[0]["graphs"], steps
        assert all(s["loss"] <= TOL for s in steps), steps


def test_mutation_first_cp_forward_eager_compiles_nothing_in_it(pool):
    """Mutation: the first CP forward's checks run it eagerly (no compiled first step): the test above fails
    on it (no graph after the first step)."""
    for steps in pool.run(jobs_compile.first_forward_compiled, 10, eager_first=True):
        assert steps[0]["graphs"] == 0, steps


KIND_CASES = [(k, "auto") for k in ("mamba1", "lightning", "rglru", "rwkv", "mlstm", "short_conv",
                                    "dynamic_short_conv")] + \
    [(k, "heads") for k in ("mamba1", "lightning", "rglru", "rwkv", "mlstm")]


@pytest.mark.parametrize("kind, recurrent", KIND_CASES, ids=[f"{k}-{r}" for k, r in KIND_CASES])
def test_every_recurrent_kind_compiles_fullgraph(pool, kind, recurrent):
    """A family of each recurrent kind (gated DeltaNet and Mamba2 above; KDA in ``benchmarks/compile.py
    --kinds``): its blocks compiled with fullgraph=True before the first CP step, no graph break, loss and every
    gradient as the model without CP (fp32; dynamo's graphs on its eager backend, AOTAutograd in the benchmark);
    under the state passing and head-parallel (``recurrent="heads"``). Inkling2's dynamic short conv on the zoo's
    tiny config, its experts on transformers' ``batched_mm`` (the eager expert loop is data-dependent)."""
    r = pool.run(jobs_compile.recurrent_kind_compiles, jobs_compile.KIND_FAMILIES[kind], compiler="eager",
                 recurrent=recurrent)[0]
    assert kind in r["kinds"] and r["breaks"] == 0 and 1 <= r["graphs"] <= 3 and not r["missing"], r
    assert max(r["loss"]) <= TOL and r["grad"] <= 1e-5, r


WARM_UP = 5   # steps after which no new packing may compile a graph


@pytest.mark.parametrize("backend, kind, compiler", [("ulysses", "packed", "aot_eager_decomp_partition"),
                                                     ("ring-alltoall", "padded", "eager"),
                                                     ("ring-documents", "documents", "eager")])
def test_fifty_new_packings_compile_no_new_graph(pool, backend, kind, compiler):
    """50 steps, each a new random packing (1 to 6 documents) or padding, through fullgraph-compiled blocks (under
    load_balance="documents" too: uneven shards): after the first steps (a row of one document is one more graph: no
    documents to mask; the documents sizes turn dynamic after they first change), no step compiles a graph,
    and every step's loss matches the model without CP (gradients on the first and last step; through
    AOTAutograd, the custom ops' backward included, for Ulysses)."""
    for r in pool.run(jobs_compile.over_packings, "llama", backend, kind, 50, compiler=compiler):
        assert r["breaks"] == 0, r
        if kind == "documents":   # shard lengths and the split share: sizes, dynamic after they first change; a
            # rank with no whole document, or one of 1 token, is a case of its own (measured: 5 graphs by step 40)
            assert r["graphs"][-1] <= 6, r["graphs"]
        else:
            assert r["graphs"][-1] <= 2 and r["graphs"][-1] == r["graphs"][WARM_UP - 1], r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


# graphs a hybrid of one attention and one recurrent block compiles, whatever the packings: the recurrent block
# one each for a row of one document (no pieces), a chunk the state crosses whole, and pieces as long as the chunk
# or shorter (dynamo unifies a size equal to the block's length); the attention block one each with and without
# documents. The pieces' count and length are dynamic sizes (ChunkPieces.sizes), so no (count, length) pair adds one
HYBRID_GRAPHS = 6


def test_hybrid_new_packings_compile_few_graphs(pool):
    """A Mamba2 hybrid (Ulysses, the scan) over 16 new packings: the recurrent layers run each chunk's documents as
    padded pieces whose count and length are dynamic sizes, so the graphs are bounded by the cases above, not by
    the packings, and every step is exact (gradients on the first and last)."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 16):
        assert r["breaks"] == 0 and r["graphs"][-1] <= HYBRID_GRAPHS, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_heads_new_packings_compile_few_graphs(pool):
    """``recurrent="heads"`` (a Mamba2 hybrid, Ulysses): the recurrent layers run whole rows whose documents are the
    batch's whole-row pieces (``CPBatch.row_pieces``, dynamic sizes), so 6 new packings compile a bounded number of
    graphs (measured: 4 in 12) and every step is exact; fullgraph, no break."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses-heads", 6):
        assert r["breaks"] == 0 and r["graphs"][-1] <= HYBRID_GRAPHS, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_heads_under_documents_compiles(pool):
    """``recurrent="heads"`` with ``load_balance="documents"`` (a gated-DeltaNet hybrid): the split part through the
    head all-to-alls, the whole documents locally, both in one compiled block, exact, no break (before: dynamo
    failed on the kernel wrapper's closure, which heads mode inspected in forward; now decided at wire)."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "gdn-hybrid", "ulysses-documents-heads", 1, kind="documents",
                         seq_len=32):
        assert r["breaks"] == 0, r
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= GDN_GRAD_TOL, (r["loss"], r["grad"])


def test_mutation_heads_without_row_pieces_compile_per_packing(pool):
    """Mutation: heads mode cutting the whole rows' documents in Python (no ``CPBatch.row_pieces``): a graph per
    packing, past the bound above (measured: 7 graphs in 5 packings, 11 in 12)."""
    results = pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses-heads", 5, row_pieces_dropped=True)
    assert max(r["graphs"][-1] for r in results) > HYBRID_GRAPHS, [r["graphs"] for r in results]


def test_mutation_static_piece_sizes_compile_per_size_pair(pool):
    """Mutation: the pieces' count and length reach the block as Python ints (``ChunkPieces.n``, ``.L``): every
    new pair compiles a graph, past the bound the test above holds (measured: 7 on rank 0 in 16 packings)."""
    results = pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 16, static_sizes=True)
    assert max(r["graphs"][-1] for r in results) > HYBRID_GRAPHS, [r["graphs"] for r in results]


@pytest.mark.parametrize("model", ["mamba1", "rglru-hybrid", "xlstm", "rwkv"])
def test_other_recurrent_kinds_run_packed_rows_as_pieces(pool, model):
    """Mamba1 (its token dim last), RG-LRU and the stabilised states, mLSTM and RWKV (padded through their gates and
    keys), run packed rows as padded pieces too (gated DeltaNet and KDA share one segment, Mamba2 above; lightning
    attention in ``benchmarks/compile.py``): four new packings, compiled, exact on every step, no graph break,
    graphs within the same bound."""
    # RWKV: two recurrent blocks of different code (the first adds pre_ln), the recurrent block's 4 cases each
    bound = 2 * (HYBRID_GRAPHS - 2) if model == "rwkv" else HYBRID_GRAPHS
    # the kinds whose torch kernels loop over every token (traced unrolled: Mamba1 too): two shorter rows (30 packings of 64
    # tokens in benchmarks/compile.py: 4 graphs for xlstm, 8 for rwkv on rank 0)
    slow = model in ("xlstm", "rwkv", "mamba1")
    for r in pool.run(jobs_compile.hybrid_over_packings, model, "ulysses", 2 if slow else 4, seq_len=32 if slow else 64):
        assert r["breaks"] == 0 and r["graphs"][-1] <= bound, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_padded_rows_run_as_pieces(pool):
    """Padded rows (new left and right padding each step) through a Mamba2 hybrid: a run of padding is one document
    for the recurrent layers (``sharding.batch.padding_merged``; attention keeps one per token), so a chunk is a few
    pieces and a new padding compiles no new graph past the same bound (before: each padding token a piece, past the
    pieces' budget, the chunk cut in Python: a graph per padding). Exact on every step against each row's real
    tokens run alone."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 6, kind="padded"):
        assert r["breaks"] == 0 and r["graphs"][-1] <= HYBRID_GRAPHS, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_mutation_rwkv_pieces_padded_with_zeros(pool):
    """Mutation: RWKV's pieces padded with a zero key (mLSTM's with zero gates), not the neutral -1e30: every
    padding token before a document adds ``e^0 v`` to its "no state", and the loss and gradients go wrong. (mLSTM's
    zero gates happen to keep its zero start state (``m = max(log f + 0, 0) = 0``) and trail only discarded outputs:
    the function-level fp64 check holds under them, so only RWKV's is a mutation.)"""
    for r in pool.run(jobs_compile.hybrid_over_packings, "rwkv", "ulysses", 1, zero_padding=True, seq_len=32):
        assert max(r["loss"]) > 10 * TOL and max(r["grad"]) > 1e-2, (r["loss"], r["grad"])


def test_mutation_pieces_pass_the_state_through_a_cut(pool):
    """Mutation: a chunk cut by documents keeps its first piece's map (the state crosses the cut): the gradients
    go wrong (the tiny model's state decays fast, so the loss moves little; every parameter is checked)."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 1, whole_map_always=True):
        assert max(r["grad"]) > 1e-3, r["grad"]


def test_mutation_plan_in_the_graph_recompiles_per_packing(pool):
    """Mutation: the compiled Ulysses sdpa tiles plan in Python inside the block again (the step handle
    unused): the document boundaries specialise the graph, new packings recompile until dynamo's limit. Ten new
    packings show it past the warm-up the test above allows (measured: 5 graphs after step 5, 7 after step 10, 9 by
    step 16 and no more in 50: its graphs are what costs)."""
    try:
        results = pool.run(jobs_compile.over_packings, "llama", "ulysses", "packed", 10, plan_in_python=True)
    except RankError as exc:
        assert "recompile" in str(exc).lower(), exc
        return
    for r in results:
        assert r["graphs"][-1] > r["graphs"][WARM_UP - 1], r["graphs"]


def _packed_steps(r):
    """(compiled, eager) work of the packed steps after the first (whose one-time checks replay it eagerly)."""
    return [(c, e) for c, e in list(zip(r["compiled"], r["eager"]))[1:] if c]


@pytest.mark.parametrize("backend", ["ring-alltoall", "distflash"])
def test_compiled_ring_skips_the_pairs_eager_skips(pool, backend):
    """Packed rows (new packings): the compiled ring issues exactly the attention work of eager mode (document
    pairs skipped from the host runs inside the op: ``ring_block``; distflash's tasks of disjoint documents inside
    ``distflash_task``, their messages still moving), and stays exact."""
    for r in pool.run(jobs_compile.work_compiled_vs_eager, backend):
        steps = _packed_steps(r)
        assert len(steps) >= 3 and all(c == e for c, e in steps), r
        assert any(c < max(r["eager"]) for c, _ in steps), r   # some packing skips pairs
        assert r["loss"] <= TOL, r


@pytest.mark.parametrize("backend", ["ring-alltoall", "distflash"])
def test_mutation_compiled_ring_without_host_runs_does_more_work(pool, backend):
    """Mutation: the op plans its pairs (runs every distflash task) without the host runs: exact still, but more
    work than eager."""
    for r in pool.run(jobs_compile.work_compiled_vs_eager, backend, skip_in_op=False):
        assert any(c > e for c, e in _packed_steps(r)), r


@pytest.mark.parametrize("backend", ["ring-alltoall", "distflash", "ulysses"])
def test_hub_flash_kernel_compiles_inside_the_ops(pool, backend):
    """A flash model under the ring (``ring_impl="auto"``: the hub flash kernel) and under Ulysses (its inner
    attention), here ringmaster's CPU stand-in through ``kernels``' LOCAL_KERNELS, blocks compiled with
    fullgraph=True before the first step, 6 new packings: no graph break, at most 2 graphs (Ulysses: 1), exact on
    every step, the hub kernel called (inside ``torch.ops.ringmaster.ring_block`` / ``distflash_task`` /
    ``flash_varlen``, dense rows too). Mutations (ring, Ulysses): the kernel traced in the block as before, where
    dynamo cannot follow its host-cut varlen calls: fullgraph fails."""
    for r in pool.run(jobs_compile.hub_flash_over_packings, backend, 6):
        assert r["breaks"] == 0 and r["graphs"][-1] <= (1 if backend == "ulysses" else 2) and r["calls"] > 0, r
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])
    if backend != "distflash":
        for r in pool.run(jobs_compile.hub_flash_over_packings, backend, 1, old_path=True):
            assert "raised" in r, r


def test_ulysses_flash_op_takes_the_window_and_softcap(pool):
    """Ulysses' compiled flash call on a gemma2 with a sliding window (12 of 64 tokens) and logit soft-capping:
    the op hands the kernel its window_size and softcap, exact on every packing, no per-packing graph (its two
    blocks are a sliding and a full layer)."""
    for r in pool.run(jobs_compile.hub_flash_over_packings, "ulysses", 4, model="gemma2-window-softcap"):
        assert r["breaks"] == 0 and r["graphs"][-1] <= 2 and r["calls"] > 0, r
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_wire_for_compile_names_what_does_not_compile():
    """``rm.wire(compile=True)`` reports (and warns) the paths that do not compile or are not shown to."""
    import ringmaster as rm
    from ringmaster.wiring import compile_notes

    plan = rm.RingmasterConfig(size=2, backend="ring", ring_impl="hf_kernels").resolve(num_kv_heads=2)
    notes = compile_notes(plan, "flash_attention_2", ["gated_deltanet", "rwkv"], "sequential")
    text = " ".join(notes)
    assert "hf_kernels" in text and "flash_attention_2" in text and "recurrent='scan'" in text and "rwkv" in text
    ok = rm.RingmasterConfig(size=2, backend="ulysses").resolve(num_kv_heads=2)
    assert compile_notes(ok, "sdpa", [], "scan") == []
    # a flash kernel as Ulysses' inner attention: inside ringmaster's op, on the stand-in only; sinks/dropout traced
    flash = compile_notes(ok, "flash_attention_2", [], "scan")
    assert len(flash) == 1 and "flash_varlen" in flash[0] and "not yet run on a GPU" in flash[0], flash
    assert "sinks" in flash[0] and "dropout" in flash[0], flash
    hybrid = compile_notes(ok, "sdpa", ["gated_deltanet", "mamba2"], "scan")
    assert len(hybrid) == 1 and "padded pieces" in hybrid[0] and "dynamic sizes" in hybrid[0], hybrid
    stabilised = compile_notes(ok, "sdpa", ["mlstm", "rwkv", "rwkv_channel_mix"], "scan")
    assert len(stabilised) == 1 and "padded pieces" in stabilised[0] and "mlstm, rwkv)" in stabilised[0], stabilised
    other = compile_notes(ok, "sdpa", ["a_new_kind"], "scan")
    assert len(other) == 2 and "recompiles the block" in other[0] and "not shown to compile" in other[1], other
    docs = rm.RingmasterConfig(size=2, backend="ulysses", load_balance="documents").resolve(num_kv_heads=2)
    assert compile_notes(docs, "sdpa", [], "scan") == []   # its sizes are dynamic: tests above
    # every layer pads its pieces neutrally (wire's probe): the split part's pieces a power of two long, cases only
    hybrid_docs = compile_notes(docs, "sdpa", ["mamba1"], "scan", pow2_pieces=True)
    assert len(hybrid_docs) == 2 and "recompile_limit" in hybrid_docs[1], hybrid_docs
    # some layer does not: the split part's lone piece fills its row, a graph per new length; a static layout is the fix
    looped = compile_notes(docs, "sdpa", ["rglru", "gated_deltanet"], "scan")
    assert len(looped) == 3 and "(rglru)" in looped[2] and "only postpones" in looped[2], looped
    assert "static load_balance" in looped[2], looped
    assert len(compile_notes(docs, "sdpa", ["rglru", "gated_deltanet"], "scan", pow2_pieces=True)) == 2


@pytest.mark.parametrize("model,neutral", [("rglru-hybrid", True), ("mamba2-hybrid", True), ("xlstm", True),
                                           ("lightning-hybrid", True), ("rwkv", True), ("mamba2-clamped", False)])
def test_wire_probe_tells_whether_every_layer_pads_neutrally(model, neutral):
    """wire's probe asks each layer's segment whether its pieces' padding leaves any state as it is
    (``neutral_padding``); only a model whose every layer does gets a documents split part's pieces a power of two
    long (``RecurrentWiring.pow2_pieces``). Lightning's and RWKV's padding decays nothing (``live``); a Mamba2 whose
    step size is clamped above 0 (``time_step_limit``) moves any state through its padding."""
    from ringmaster.recurrent.wiring import wire_recurrent_layers
    from ringmaster_tools import step_shape

    torch.manual_seed(0)
    extra = {"time_step_limit": (0.01, float("inf"))} if model == "mamba2-clamped" else {}
    name = "mamba2-hybrid" if model == "mamba2-clamped" else model
    m = step_shape._model(name, **step_shape.TWO_BLOCKS[name], **extra)
    wiring = wire_recurrent_layers(m)
    try:
        assert wiring.neutral and wiring.pow2_pieces is neutral, wiring.neutral
    finally:
        wiring.restore()


@pytest.mark.parametrize("pow2", [True, False])
def test_documents_split_part_pieces_take_few_lengths(pow2):
    """Under ``load_balance="documents"`` the split part's length is new per packing; its lone piece (a document
    the state enters and leaves) used to fill its row, so a kernel that loops over the tokens in Python (RG-LRU,
    mLSTM, RWKV, lightning) compiled a graph per packing. Where every layer pads neutrally the pieces are a power of
    two long: over the 30 packings ``benchmarks/compile.py`` measures (12 split shares), on both ranks, the split
    part's piece lengths take 2 values, 16 and 32 (without: 13 lengths, the mutation)."""
    from ringmaster.sharding.assignment import plan_documents
    from ringmaster.sharding.documents import CPBatch, Runs
    from ringmaster_tools.packings import random_packing

    lengths = set()
    for step in range(30):
        lens = random_packing(torch.Generator().manual_seed(1000 + step), 64)
        docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None]
        runs = Runs.from_doc_ids(docs)
        a = plan_documents(runs, 64, 2, "contiguous", 16)
        for rank in range(2):
            split = CPBatch(rank, 2, "contiguous", 64, docs, runs=runs, assignment=a, pow2_pieces=pow2).split_part()
            if split is not None and split.pieces is not None:
                lengths.add(split.pieces[0].L)
                assert split.pieces[0].neutral is pow2
    assert (len(lengths) <= 2 and all(L & (L - 1) == 0 for L in lengths)) if pow2 else len(lengths) > 10, lengths


@pytest.mark.parametrize("model", ["rglru-hybrid", "lightning-hybrid"])
def test_documents_split_part_power_of_two_pieces_exact(pool, model):
    """A hybrid (Ulysses, load_balance="documents"), compiled: the split part's lone pieces padded to a power of two
    after them (rows of 32: the first packing's split share, 9 tokens of one document per rank, runs as a piece of
    16), with RG-LRU's ``a = 1, x = 0`` and with lightning's padding marked not ``live``: exact, no graph break.
    Mutations, each still claiming neutral: RG-LRU's padding ``a = 0`` wipes the state the lone piece hands on
    (measured: loss 6.5e-5, worst parameter gradient 0.45); lightning's padding live decays it."""
    mutation = {"rglru-hybrid": "rglru_decaying_padding", "lightning-hybrid": "lightning_decaying_padding"}[model]
    for r in pool.run(jobs_compile.hybrid_over_packings, model, "ulysses-documents", 1, kind="documents", seq_len=32):
        assert r["breaks"] == 0, r
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])
    for r in pool.run(jobs_compile.hybrid_over_packings, model, "ulysses-documents", 1, kind="documents",
                      seq_len=32, **{mutation: True}):
        assert max(r["loss"]) > 1e-4 or max(r["grad"]) > 1e-3, (r["loss"], r["grad"])
