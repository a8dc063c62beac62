"""Recurrent and hybrid decoder blocks compile with ``torch.compile(block, fullgraph=True)`` and stay exact over new
packings (the attention's compiled paths: ``tests/test_compile.py``).

Every recurrent kind compiles its blocks with no graph break; packed, padded and ``load_balance="documents"`` rows
run each chunk's documents as padded pieces whose count and length are dynamic sizes, so a hybrid compiles a graph
per case, not per packing (``ringmaster_tools.packings.over_packings``, dynamo's eager backend); each mechanism
has its mutation. A file of its own so that the README's two test workers (``-n 2 --dist loadfile``) run it beside
the attention's compile tests.
"""

import jobs_compile
import pytest
import torch

TOL = 1e-5
GDN_GRAD_TOL = 5e-3   # fp32 cancellation in gated DeltaNet's A_log / dt_bias gradients, as in eager (fp64 elsewhere)


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


# graphs a hybrid of one attention and one recurrent block compiles, whatever the packings: one per block. The
# pieces' count and length are dynamic sizes (ChunkPieces.sizes), so no (count, length) pair adds one; a chunk the
# state crosses whole runs as pieces too, and a packed row of one document keeps its document ids (Runtime.compiled),
# so neither is a case of its own (before: 5-7 graphs over 50 packings, the last ones late)
HYBRID_GRAPHS = 2


def test_hybrid_new_packings_compile_few_graphs(pool):
    """A Mamba2 hybrid (Ulysses, the scan) over 16 new packings, among them a row of one document (the 5th) and one
    whose chunk on rank 0 holds no document start (the 12th): the recurrent layers run each chunk's documents as
    padded pieces whose count and length are dynamic sizes, so the two blocks compile one graph each, from the first
    step on, and every step is exact (gradients on the first and last). Mutations (by hand): the one-document row as
    plain rows (the shard step's ``keep_one`` False) 4 graphs on both ranks; a chunk with no document start run
    without pieces 4 and 5."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 16):
        assert r["breaks"] == 0 and r["graphs"][-1] <= HYBRID_GRAPHS, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_crowded_packings_run_in_groups_by_length(pool):
    """Rows of 12 to 20 documents (S=128, P=2: many short ones beside longer ones, as real packed rows hold) through a
    gated-DeltaNet hybrid: where one padded batch of pieces would pass the budget, the pieces run in groups by
    length (``ChunkPieces.of(groups=PIECE_GROUPS)``, ``RecurrentWiring.piece_groups``), one more case a block
    compiles once, not a chunk cut in Python per packing. 8 packings: 3-4 graphs, every step exact. Mutation: one
    group (``piece_groups`` 1): the crowded chunks are cut in Python, a graph per packing (measured: 6 and 5)."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "gdn-hybrid", "ulysses", 8, kind="many", seq_len=128):
        assert r["breaks"] == 0 and r["graphs"][-1] <= HYBRID_GRAPHS + 2, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= GDN_GRAD_TOL, (r["loss"], r["grad"])


def test_heads_new_packings_compile_few_graphs(pool):
    """``recurrent="heads"`` (a Mamba2 hybrid, Ulysses): the recurrent layers run whole rows whose documents are the
    batch's whole-row pieces (``CPBatch.row_pieces``, dynamic sizes), so 6 new packings compile one graph per block
    and every step is exact; fullgraph, no break."""
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


def test_hybrid_documents_packings_compile_one_graph_per_block(pool):
    """``load_balance="documents"`` on a compiled runtime (a gated-DeltaNet hybrid, Ulysses, blocks compiled with
    ``dynamic=True``): at the first packing rank 0 holds no whole document (its split part is its whole shard, its
    whole part the spare tokens alone); three packings compile one graph per block, every step exact. Mutations (by
    hand, 3 graphs each): the split part cut from the shard unpadded (``by_parts``: at the first packing a narrow to
    the shard's whole length, and the attention block's graph took the whole part's marker as 2), and a pieces index
    left a view (``sharding.documents._on``: dynamo gave its base's length, unmarked, the hidden states' symbol)."""
    for r in pool.run(jobs_compile.hybrid_over_packings, "gdn-hybrid", "ulysses-documents", 3, kind="documents",
                      dynamic=True):
        assert r["breaks"] == 0 and r["graphs"] == [HYBRID_GRAPHS] * 3, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= GDN_GRAD_TOL, (r["loss"], r["grad"])


def test_mutation_heads_without_row_pieces_compile_per_packing(pool):
    """Mutation: heads mode cutting the whole rows' documents in Python (no ``CPBatch.row_pieces``): a graph per
    packing, past the bound above (measured: 3 graphs in 2 packings, 4 in 3, 6 in 5)."""
    results = pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses-heads", 2, row_pieces_dropped=True)
    assert max(r["graphs"][-1] for r in results) > HYBRID_GRAPHS, [r["graphs"] for r in results]


def test_mutation_static_piece_sizes_compile_per_size_pair(pool):
    """Mutation: the pieces' count and length reach the block as Python ints (``ChunkPieces.n``, ``.L``): every
    new pair compiles a graph, past the bound the test above holds (measured: 3 on both ranks in 2 packings; 4 on
    rank 0 and 3 on rank 1 in 4, no more in 16)."""
    results = pool.run(jobs_compile.hybrid_over_packings, "mamba2-hybrid", "ulysses", 2, static_sizes=True)
    assert max(r["graphs"][-1] for r in results) > HYBRID_GRAPHS, [r["graphs"] for r in results]


@pytest.mark.parametrize("model", ["mamba1", "rglru-hybrid", "xlstm", "rwkv"])
def test_other_recurrent_kinds_run_packed_rows_as_pieces(pool, model):
    """Mamba1 (its token dim last), RG-LRU and the stabilised states, mLSTM and RWKV (padded through their gates and
    keys), run packed rows as padded pieces too (gated DeltaNet and KDA share one segment, Mamba2 above; lightning
    attention in ``benchmarks/compile.py``): four new packings, compiled, exact on every step, no graph break,
    graphs within the bound measured for each."""
    # one per block kind (Mamba1's and xLSTM's two blocks share their code); the torch kernels that loop over the
    # tokens in Python specialise on the piece length, a power of two: RG-LRU's one more (3 on rank 1), RWKV's
    # two blocks of different code (the first adds pre_ln) each one more (4 on rank 1)
    bound = {"mamba1": 1, "xlstm": 1, "rglru-hybrid": 3, "rwkv": 4}[model]
    # the kinds whose torch kernels loop over every token (traced unrolled: Mamba1 too): two shorter rows
    slow = model in ("xlstm", "rwkv", "mamba1")
    for r in pool.run(jobs_compile.hybrid_over_packings, model, "ulysses", 2 if slow else 4, seq_len=32 if slow else 64):
        assert r["breaks"] == 0 and r["graphs"][-1] <= bound, r["graphs"]
        assert max(r["loss"]) <= TOL and max(r["grad"]) <= TOL, (r["loss"], r["grad"])


def test_padded_rows_run_as_pieces(pool):
    """Padded rows (new left and right padding each step) through a Mamba2 hybrid: a run of padding is one document
    for the recurrent layers (``sharding.batch.padding_merged``; attention keeps one per token), so a chunk is a few
    pieces and a new padding compiles no new graph past the same bound (before: each padding token a piece, past the
    pieces' budget, the chunk cut in Python: a graph per padding; and a row with one padding token, whose merged
    ids were the attention's own tensor, a case of its own). Exact on every step against each row's real tokens run
    alone."""
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


def test_the_shard_step_gives_a_compiled_block_one_case():
    """What the shard step hands a compiled block is the same case for every packing: a packed batch whose rows are
    one document each keeps its document ids on a compiled runtime (``keep_one``; a batch without position_ids is
    plain rows either way), a padded row's merged ids for the recurrent layers are a tensor of their own even where no
    two padding tokens are neighbours (dynamo guards on two inputs being one tensor: before, such a row was a graph
    of its own, measured late in the 50-packing ring rows), and a chunk with no document start is pieces too (its
    one piece whole, the state entering and leaving), not a flag."""
    from ringmaster.sharding.batch import CP_SHARD_KEY, shard_collated_batch
    from ringmaster.sharding.documents import ChunkPieces, Runs

    ids = torch.arange(8)[None]
    one = {"input_ids": ids, "position_ids": torch.arange(8)[None]}
    kept = shard_collated_batch(one, 0, 2, keep_one=True)[CP_SHARD_KEY]["doc_ids"]
    assert kept is not None and not kept.any(), kept
    assert shard_collated_batch(one, 0, 2)[CP_SHARD_KEY]["doc_ids"] is None
    assert shard_collated_batch({"input_ids": ids}, 0, 2, keep_one=True)[CP_SHARD_KEY]["doc_ids"] is None
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])}
    meta = shard_collated_batch(padded, 0, 2)[CP_SHARD_KEY]
    assert meta["recurrent_doc_ids"] is not meta["doc_ids"] and torch.equal(meta["recurrent_doc_ids"], meta["doc_ids"])
    whole = ChunkPieces.of(Runs.from_doc_ids(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])), [0], 4, "cpu")[0]
    assert (whole.n, whole.L) == (2, 4) and whole.keep.all() and whole.whole.all(), whole


def test_a_compiled_runtime_says_when_a_packing_passes_the_pieces_budget():
    """A batch whose recurrent pieces would pad past ``PIECES_BUDGET`` (rank 1 of 2: the end of a 50-token document
    and seven of 2 tokens, 8 pieces of up to 18 tokens: 8 x 32 = 256 padded tokens for a chunk of 32) is cut in
    Python by a compiled block, which recompiles for it: a compiled runtime's shard step warns, naming the budget; an
    eager runtime, rank 0's chunk (one piece), and a packing within the budget do not."""
    import types
    import warnings

    from ringmaster.sharding.batch import BUDGET_WARNING, CP_SHARD_KEY, batch_kwarg, shard_collated_batch

    def meta(lens, rank):
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        return shard_collated_batch({"input_ids": torch.zeros_like(pos), "position_ids": pos}, rank, 2)[CP_SHARD_KEY]

    wiring = types.SimpleNamespace(heads_upto=(), pow2_pieces=False)
    compiled = types.SimpleNamespace(compiled=True, config=None, recurrent_wiring=wiring)
    past = [50] + [2] * 7
    with pytest.warns(UserWarning, match="PIECES_BUDGET") as caught:
        assert batch_kwarg(meta(past, 1), compiled).past_the_budget()
    assert str(caught[0].message) == BUDGET_WARNING
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch_kwarg(meta(past, 1), types.SimpleNamespace(compiled=False, config=None, recurrent_wiring=wiring))
        assert not batch_kwarg(meta(past, 0), compiled).past_the_budget()
        assert not batch_kwarg(meta([40, 8, 8, 8], 1), compiled).past_the_budget()
