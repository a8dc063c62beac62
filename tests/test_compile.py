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


WARM_UP = 5   # steps after which no new packing may compile a graph


@pytest.mark.parametrize("backend, kind, compiler", [("ulysses", "packed", "aot_eager_decomp_partition"),
                                                     ("ring-alltoall", "padded", "eager"),
                                                     ("ring-documents", "documents", "eager")])
def test_fifty_new_packings_compile_no_new_graph(pool, backend, kind, compiler):
    """50 steps, each a new random packing (1 to 6 documents) or padding, through fullgraph-compiled blocks (under
    load_balance="documents" too: uneven shards, the blocks compiled with dynamic=True as docs/api.md says): one
    graph, compiled on the first step, for every packing (a packed row of one document keeps its document ids on a
    compiled runtime: before, it was one more graph; under documents mode every rank runs a whole part, with spare
    tokens: before, a rank with no whole document, or one of one token, was a case of its own, and the first
    packing here is a row of one document); and every step's loss matches the model without CP (gradients on the
    first and last step; through AOTAutograd, the custom ops' backward included, for Ulysses)."""
    for r in pool.run(jobs_compile.over_packings, "llama", backend, kind, 50, compiler=compiler,
                      dynamic=True if kind == "documents" else None):
        assert r["breaks"] == 0, r
        assert r["graphs"][-1] == r["graphs"][0] == 1, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_mutation_documents_without_spare_tokens_compile_a_case_per_part(pool):
    """Mutation: a compiled runtime's documents batches without the whole part's spare tokens (``SPARE`` 0): the
    first packing's row of one document leaves both ranks no whole document (no whole part), the next ones hold
    some: a second graph by the third packing, which the test above refuses."""
    for r in pool.run(jobs_compile.over_packings, "llama", "ring-documents", "documents", 3, dynamic=True,
                      no_spare=True):
        assert r["graphs"][-1] > 1, r["graphs"]
        assert max(r["loss"]) <= TOL, r["loss"]


def test_mutation_plan_in_the_graph_recompiles_per_packing(pool):
    """Mutation: the compiled Ulysses sdpa tiles plan in Python inside the block again (the step handle
    unused): the document boundaries specialise the graph, new packings recompile until dynamo's limit. Seven new
    packings show it past the warm-up the test above allows (measured: 6 graphs after step 5, 7 after steps 6 and 7,
    8 after step 8, 9 by step 16 and no more in 50: its graphs are what costs)."""
    try:
        results = pool.run(jobs_compile.over_packings, "llama", "ulysses", "packed", 7, plan_in_python=True)
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
    # its sizes are new per packing: compile with dynamic=True (tests above)
    only = compile_notes(docs, "sdpa", [], "scan")
    assert len(only) == 1 and "dynamic=True" in only[0] and "spare tokens" in only[0], only
    # every layer pads its pieces neutrally (wire's probe): the split part's pieces a power of two long, cases only
    hybrid_docs = compile_notes(docs, "sdpa", ["mamba1"], "scan", pow2_pieces=True)
    assert len(hybrid_docs) == 3 and "recompile_limit" in hybrid_docs[2], hybrid_docs
    # some layer does not: the split part's lone piece fills its row, a graph per new length; a static layout is the fix
    looped = compile_notes(docs, "sdpa", ["rglru", "gated_deltanet"], "scan")
    assert len(looped) == 4 and "(rglru)" in looped[3] and "only postpones" in looped[3], looped
    assert "static load_balance" in looped[3], looped
    assert len(compile_notes(docs, "sdpa", ["rglru", "gated_deltanet"], "scan", pow2_pieces=True)) == 3
