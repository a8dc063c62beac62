"""Linear-recurrence kinds beyond Mamba2 / gated DeltaNet, exact under CP at model level: MiniMax
lightning attention (scalar decay per head), Kimi Delta Attention (per-channel gated delta rule),
Recurrent Gemma's RG-LRU (diagonal gated recurrence + conv1d).

Per family: fp64 end to end (HF's torch kernels kept in fp64) every parameter within 1e-5 at P=2
and P=4, Ulysses and Ring, scan and sequential; fp32 loss / logits / whole gradient; packed rows
against every document alone; a padded batch; and a mutation (the incoming state dropped, or the
conv halo) that the same fp64 check catches by a wide margin. Function-level checks of each
kind's Segment against its float64 token-by-token reference are in test_recurrent_unit.py style
below (single process).
"""

import jobs_linear_recurrent as jl
import pytest
import torch

from standins import naive
from ringmaster.recurrent.documents import DocumentSegment
from ringmaster.recurrent.scan import simulate_scan, simulate_sequential
from ringmaster.sharding.documents import Runs

FP64_PARAM_TOL = 1e-5   # every parameter, fp64
FP64_TOL = 1e-10        # fp64 loss and gathered logits
TOL = 1e-4              # fp32 loss and gathered logits
TOTAL_TOL = 2e-4        # fp32 whole gradient
MARGIN = 100            # a mutation must break the fp64 bound by this factor

# --------------------------------------------------------------------------- function level (single process)

SPLITS = {"whole": [0, 24], "equal4": [0, 6, 12, 18, 24], "uneven": [0, 1, 2, 9, 24],
          "head_tail4": [0, 3, 6, 9, 12, 15, 18, 21, 24]}


def _lightning_inputs(b=2, l=24, h=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, l, h, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    return dict(q=q, k=k, v=v), torch.tensor([1e-4, 0.05, 1.0], dtype=torch.float64)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_lightning_state_passing_exact_float64(split, strategy):
    from ringmaster.recurrent.lightning import LightningSegment

    inputs, slope = _lightning_inputs()
    ref, _ = naive.lightning_recurrence(inputs["q"], inputs["k"], inputs["v"], slope)
    W = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=ref.dtype)
    ref_grads = torch.autograd.grad((ref * W).sum(), list(inputs.values()))
    b = SPLITS[split]
    segs = [LightningSegment(*(t[:, x:y] for t in inputs.values()), slope[:, None, None], 5) for x, y in zip(b, b[1:])]
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    y = torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)
    grads = torch.autograd.grad((y * W).sum(), list(inputs.values()))
    assert (y - ref).abs().max() <= 1e-11 * ref.abs().max()
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 1e-11 * r.abs().max()


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
def test_lightning_resets_at_document_starts(strategy):
    from ringmaster.recurrent.lightning import LightningSegment

    inputs, slope = _lightning_inputs(b=1)
    lens = [2, 15, 7]
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[None]
    ref, start = [], 0
    for n in lens:
        ref.append(naive.lightning_recurrence(*(t[:, start:start + n] for t in inputs.values()), slope)[0])
        start += n
    ref = torch.cat(ref, dim=1)
    b = SPLITS["head_tail4"]
    runs = Runs.from_doc_ids(docs)
    segs = [DocumentSegment(LightningSegment(*(t[:, x:y] for t in inputs.values()), slope[:, None, None], 5),
                            runs.pattern(x, y), y - x) for x, y in zip(b, b[1:])]
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    y = torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)
    assert (y - ref).abs().max() <= 1e-11 * ref.abs().max()


# --------------------------------------------------------------------------- model level


def check(results, P, fp64, needed=(), model_type=None):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert r["attention_layers"] >= 1 or model_type == "rwkv", r   # RWKV has no softmax attention
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], r["missing_grads"]
        for name in needed:
            assert any(name in k for k in r["grad_errs"]), (name, sorted(r["grad_errs"]))
        if fp64:
            assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
            worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
        else:
            assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
            assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])
            worst = {}
        assert not worst, (rank, worst)


# family -> parameters whose gradient only the recurrent state passing gets right
NEEDED = {"minimax": ("qkv_proj.weight",), "kimi_linear": ("forget_gate.A_log", "forget_gate.dt_bias", "conv1d.weight"),
          "recurrent_gemma": ("rg_lru.recurrent_param", "rg_lru.recurrent_gate_weight", "conv_1d.weight"),
          "rwkv": ("attention.time_decay", "attention.time_first", "attention.time_mix_key",
                   "feed_forward.time_mix_key")}
FAMILIES = ["minimax", "kimi_linear", "recurrent_gemma", "rwkv"]
FULL_GRID = [(backend, P, strategy) for backend in ("ulysses", "ring") for P in (2, 4)
             for strategy in ("scan", "sequential")]
# transformers' torch KDA kernel loops over its 64-token chunk rows in Python (slow on CPU): one strategy per
# (backend, P) cell, alternating
SHORT_GRID = [("ulysses", 2, "scan"), ("ring", 2, "sequential"), ("ulysses", 4, "sequential"), ("ring", 4, "scan")]
# every family on the short grid (both backends, both degrees, both strategies across the four cells); the full
# product of backend x P x strategy is the same mechanism four more times
GRID = [(m, *c) for m in FAMILIES for c in SHORT_GRID]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-{c[1]}-P{c[2]}-{c[3]}")
def test_exact_fp64_per_parameter(pool, case):
    model_type, backend, P, strategy = case
    check(pool.run(jl.parity, model_type, P, strategy, backend, fp64=True), P, True, NEEDED[model_type], model_type)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_head_tail_dense_fp64(pool, model_type):
    """Ring with the head_tail layout (2 chunks a rank, composed in sequence order), one dense row."""
    results = pool.run(jl.parity, model_type, 4, "sequential", "ring", fp64=True,
                       cfg_kwargs=dict(load_balance="head_tail"))
    assert all(r["layout"] == "head_tail" for r in results)
    check(results, 4, True, NEEDED[model_type], model_type)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fp32_loss_and_whole_gradient(pool, model_type):
    check(pool.run(jl.parity, model_type, 4, "scan", "ulysses"), 4, False, model_type=model_type)


PACKED = [("ulysses", 4, "scan", None), ("ring", 2, "sequential", dict(load_balance="head_tail")),
          ("ring", 4, "scan", dict(load_balance="head_tail")), ("ulysses", 2, "sequential", None)]
PACKED_CASES = [(m, *c) for m in FAMILIES for c in (PACKED if m == "minimax" else PACKED[:2])]


@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-P{c[2]}-{c[3]}{'-ht' if c[4] else ''}")
def test_packed_rows_match_documents_alone(pool, case):
    model_type, backend, P, strategy, cfg_kwargs = case
    check(pool.run(jl.packed_parity, model_type, P, strategy, backend, cfg_kwargs, fp64=True), P, True,
          model_type=model_type)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_padded_rows(pool, model_type):
    for r in pool.run(jl.padded_parity, model_type, 4, "scan"):
        assert not r["nan"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err_total"] <= TOTAL_TOL, r


# P=2 for every mutation (a dropped state or halo shows at the first cut; the engine's P=4 paths run exact above)
MUTATIONS = [("lightning_state_dropped", "minimax", 2, "scan", "qkv_proj.weight"),
             ("lightning_state_dropped", "minimax", 2, "sequential", "qkv_proj.weight"),
             ("kda_state_dropped", "kimi_linear", 2, "sequential", "forget_gate.A_log"),
             ("kda_conv_halo_dropped", "kimi_linear", 2, "scan", "conv1d.weight"),
             ("rglru_state_dropped", "recurrent_gemma", 2, "scan", "rg_lru.recurrent_param"),
             ("rglru_state_dropped", "recurrent_gemma", 2, "sequential", "rg_lru.recurrent_param"),
             ("conv_halo_dropped", "recurrent_gemma", 2, "sequential", "conv_1d.weight"),
             ("rwkv_state_dropped", "rwkv", 2, "scan", "attention.time_decay"),
             ("rwkv_state_dropped", "rwkv", 2, "sequential", "attention.time_decay"),
             ("conv_halo_dropped", "rwkv", 2, "scan", "feed_forward.time_mix_key")]


@pytest.mark.parametrize("case", MUTATIONS, ids=lambda c: f"{c[0]}-{c[1]}-P{c[2]}-{c[3]}")
def test_mutation_fails_fp64_parity(pool, case):
    mutation, model_type, P, strategy, param = case
    for rank, out in enumerate(pool.run(jl.mutated_parity, mutation, model_type, P, strategy)):
        assert "raised" not in out, out["raised"]   # the parity check must catch it, not a refusal
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if param in k}
        print(f"{mutation} {model_type} P={P} {strategy} rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, "
              f"logits {r['logits_err']:.2e}")
        assert errs and max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
        clean = out["clean"]
        assert max(clean["grad_errs"].values()) <= FP64_PARAM_TOL, (rank, clean["worst_param"])


# --------------------------------------------------------------------------- function level: KDA, RG-LRU, WKV


def _run(segs, strategy):
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_grads(y, ref, leaves, tol):
    W = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=ref.dtype)
    g_ref = torch.autograd.grad((ref * W).sum(), leaves, retain_graph=True)
    g = torch.autograd.grad((y * W).sum(), leaves)
    assert _rel(y, ref) <= tol, _rel(y, ref)
    for a, b in zip(g, g_ref):
        assert _rel(a, b) <= tol, _rel(a, b)


def _kda_inputs(b=2, l=24, h=3, dk=4, dv=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    rate = torch.logspace(-4, 0, dk, dtype=dtype)                 # per channel: from ~no decay to fast
    return dict(q=torch.randn(b, l, h, dk, generator=g, dtype=dtype), k=torch.randn(b, l, h, dk, generator=g, dtype=dtype),
                v=torch.randn(b, l, h, dv, generator=g, dtype=dtype),
                g=-rate * torch.rand(b, l, h, dk, generator=g, dtype=dtype),
                beta=torch.rand(b, l, h, generator=g, dtype=dtype))


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["equal4", "uneven", "head_tail4"])
@pytest.mark.parametrize("kernel", ["ref", "hf"])
def test_kda_state_passing_exact(kernel, split, strategy):
    """Per-channel decays through gated DeltaNet's segment: float64 reference kernel exact to rounding,
    transformers' torch KDA kernel (fp32, 64-token chunks) to fp32 rounding."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment

    dtype = torch.float64 if kernel == "ref" else torch.float32
    fn = naive.chunk_kda_ref if kernel == "ref" else chunk_kimi_delta_attention
    inputs = {k: v.requires_grad_(True) for k, v in _kda_inputs(dtype=dtype).items()}
    ref = naive.kda_recurrence(*(t.double() for t in inputs.values()))[0]
    b = SPLITS[split]
    segs = [GatedDeltaSegment(fn, *(t[:, x:y] for t in inputs.values()), kwargs=dict(use_qk_l2norm_in_kernel=True))
            for x, y in zip(b, b[1:])]
    y = _run(segs, strategy).double()
    if kernel == "ref":
        _check_grads(y, ref, list(inputs.values()), 1e-11)
    else:
        assert _rel(y, ref) <= 1e-5


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["equal4", "uneven", "head_tail4"])
def test_rglru_state_passing_exact_float64(split, strategy):
    """transformers' own ``_rnn_scan`` per chunk (kept in float64), resets at position 0 inside a chunk."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    from ringmaster.recurrent.rglru import RglruSegment
    from ringmaster_tools.parity import keep_fp64

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 6, generator=g, dtype=torch.float64, requires_grad=True)
    a = (1 - torch.logspace(-4, -0.3, 6, dtype=torch.float64) * torch.rand(2, 24, 6, generator=g, dtype=torch.float64))
    a = a.requires_grad_(True)
    reset = torch.zeros(2, 24, 1, dtype=torch.bool)
    reset[1, 13] = True                                  # a document starts inside a chunk of row 1

    def kernel(**kw):
        return RecurrentGemmaRglru._rnn_scan(None, **kw)

    with keep_fp64():
        ref = naive.rglru_recurrence(x, a, reset)[0]
        b = SPLITS[split]
        y = _run([RglruSegment(kernel, x[:, s:e], a[:, s:e], reset[:, s:e]) for s, e in zip(b, b[1:])], strategy)
        _check_grads(y, ref, [x, a], 1e-11)


# a packed row of 6 documents over 4 chunks of 8: pieces of 1 to 8 tokens, some chunks cut twice, padded to 4 x 8
PIECES_DOCS = [3, 2, 9, 1, 6, 11]


def pieces_segments(make, tensors, dim, lens=PIECES_DOCS, chunk=8, **pieces):
    """``make(*chunk_tensors)`` per chunk of ``chunk`` tokens (``dim``: the token dim), each a
    :class:`~ringmaster.recurrent.documents.PiecesSegment` over the chunk's pieces of the packed row ``lens``
    (two rows): the padded batch a compiled block runs, here eagerly. ``pieces``: ``ChunkPieces.of``'s options."""
    from ringmaster.recurrent.documents import PiecesSegment
    from ringmaster.sharding.documents import ChunkPieces

    docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].expand(2, -1)
    b = list(range(0, sum(lens) + 1, chunk))
    pieces = ChunkPieces.of(Runs.from_doc_ids(docs), b[:-1], chunk, "cpu", **pieces)
    assert pieces is not None and pieces[0].L > 1
    return [PiecesSegment(make(*(t.narrow(dim, s, e - s) for t in tensors)), p) for s, e, p in zip(b, b[1:], pieces)]


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("keys", [1.0, 30.0])
def test_wkv_pieces_exact_float64(keys, strategy):
    """Packed rows as padded pieces (the compiled path): a padding key of -1e30 keeps each document's "no state"
    through its leading padding, bit for bit; outputs and gradients as every document alone, float64."""
    _wkv_pieces_check(keys, strategy, PIECES_DOCS, 8)


def _wkv_pieces_check(keys, strategy, lens, chunk, **pieces):
    """transformers' WKV loop over the packed rows ``lens`` (two rows) as padded pieces of chunks of ``chunk``
    (``ChunkPieces.of``'s options ``pieces``): outputs and gradients as every document alone, float64."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ringmaster.recurrent.rwkv import WkvSegment
    from ringmaster_tools.parity import keep_fp64

    g = torch.Generator().manual_seed(0)
    L = sum(lens)
    k = (keys * torch.randn(2, L, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    v = torch.randn(2, L, 5, generator=g, dtype=torch.float64, requires_grad=True)
    decay = torch.linspace(-6, 1, 5, dtype=torch.float64).requires_grad_(True)
    first = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    with keep_fp64():
        ends = torch.tensor(lens).cumsum(0).tolist()
        ref = torch.cat([naive.wkv_recurrence(decay, first, k[:, s:e], v[:, s:e])[0]
                         for s, e in zip([0, *ends], ends)], dim=1)
        segs = pieces_segments(lambda kk, vv: WkvSegment(rwkv_linear_attention_cpu, decay, first, kk, vv), [k, v], 1,
                               lens, chunk, **pieces)
        _check_grads(_run(segs, strategy), ref, [k, v, decay, first], 1e-12)


# many short documents beside a long one, over 2 chunks of 16: 5 pieces of up to 12 tokens in the first, past the
# pieces' budget in one group (5 x 16 > 4 x 16), within it in groups by length (2 x 16 + 2 x 2 + 2 x 2 + 4 x 2)
GROUPED_DOCS = [12, 1, 1, 1, 1, 9, 2, 3, 1, 1]


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
def test_pieces_in_groups_by_length_exact_float64(strategy):
    """Pieces that would pad past the budget in one batch (many short documents beside a long one) run in
    ``PIECE_GROUPS`` padded batches by length (``ChunkPieces.of(groups=...)``): each group its own kernel call, a
    row's first piece taking the incoming state in whichever group it is, its last piece's final state handed on.
    Here transformers' stabilised WKV loop (a document's start state is its "no state", its padding a key of
    -1e30): outputs and gradients as every document alone, float64. Mutation (by hand): every group's slot at the
    row's first piece's index taking the incoming state (``_states`` ignoring which group holds it) fails it."""
    from ringmaster.sharding.documents import PIECE_GROUPS, ChunkPieces

    docs = torch.repeat_interleave(torch.arange(len(GROUPED_DOCS)), torch.tensor(GROUPED_DOCS))[None]
    assert ChunkPieces.of(Runs.from_doc_ids(docs), [0, 16], 16, "cpu") is None   # one group: past the budget
    grouped = ChunkPieces.of(Runs.from_doc_ids(docs), [0, 16], 16, "cpu", groups=PIECE_GROUPS)
    assert [len(p.shapes) for p in grouped] == [PIECE_GROUPS] * 2, grouped
    _wkv_pieces_check(30.0, strategy, GROUPED_DOCS, 16, groups=PIECE_GROUPS)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", ["equal4", "uneven", "head_tail4"])
@pytest.mark.parametrize("keys", [1.0, 30.0])
def test_wkv_state_passing_exact_float64(keys, split, strategy):
    """transformers' stabilised WKV loop per chunk, composed by the log-sum-exp merge, against the
    unstabilised float64 recurrence; ``keys=30``: the chunks' running maxima differ by e^30 and more."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ringmaster.recurrent.rwkv import WkvSegment
    from ringmaster_tools.parity import keep_fp64

    g = torch.Generator().manual_seed(0)
    k = (keys * torch.randn(2, 24, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    v = torch.randn(2, 24, 5, generator=g, dtype=torch.float64, requires_grad=True)
    decay = torch.linspace(-6, 1, 5, dtype=torch.float64).requires_grad_(True)     # e^w from ~1 to ~0.07
    first = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    with keep_fp64():
        ref = naive.wkv_recurrence(decay, first, k, v)[0]
        b = SPLITS[split]
        y = _run([WkvSegment(rwkv_linear_attention_cpu, decay, first, k[:, s:e], v[:, s:e]) for s, e in zip(b, b[1:])],
                 strategy)
        _check_grads(y, ref, [k, v, decay, first], 1e-10)


@pytest.mark.parametrize("local", [False, True])
def test_documents_parts_pieces_exact_float64(local):
    """A ``load_balance="documents"`` shard's parts as padded pieces (the compiled path), for a kind whose padding
    moves a state (lightning attention with its padding live: its constant decay per token applies to the padding
    too; ``neutral_padding`` False). The split part (two chunks of 12, the first one piece of a 13-token document,
    which the state enters and leaves) is pieces and its lone piece fills its row exactly; the whole
    part's pieces (no state enters or leaves) pad to a power of two. Mutation (``local=True`` on the split part):
    its lone piece padded to 16, the state it hands on decays through the padding, and the next chunk's tokens of
    that document go wrong."""
    from ringmaster.recurrent.documents import PiecesSegment
    from ringmaster.recurrent.lightning import LightningSegment
    from ringmaster.sharding.documents import ChunkPieces

    inputs, slope = _lightning_inputs(b=1, l=33)

    def alone(lens, offset=0):
        out, start = [], offset
        for n in lens:
            out.append(naive.lightning_recurrence(*(t[:, start:start + n] for t in inputs.values()), slope)[0])
            start += n
        return torch.cat(out, dim=1)

    def segments(lens, offset, chunk, **kw):
        docs = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None]
        b = list(range(0, sum(lens) + 1, chunk))
        pieces = ChunkPieces.of(Runs.from_doc_ids(docs), b[:-1], chunk, "cpu", **kw)
        return [PiecesSegment(decaying(*(t[:, offset + s:offset + e] for t in inputs.values()),
                                       slope[:, None, None], 5), p) for s, e, p in zip(b, b[1:], pieces)]

    decaying = type("Decaying", (_DecayingPadding, LightningSegment), {"neutral_padding": False})

    split = _run(segments([13, 11], 0, 12, local=local), "scan")            # the split sub-row over two ranks
    whole = _run(segments([5, 1, 3], 24, 9, local=True), "sequential")    # a rank's whole documents
    err = max(_rel(split, alone([13, 11])), _rel(whole, alone([5, 1, 3], 24)))
    assert (err > 1e-3) if local else (err <= 1e-11), err


def _split_part_segments(make, tensors):
    """A documents shard's split part as the compiled path runs it with every layer padding neutrally
    (:func:`pieces_segments` with ``ChunkPieces.of(neutral=True)``): two chunks of 12, the first one
    piece of a 13-token document that the state enters and leaves, padded to 16 after it."""
    segs = pieces_segments(make, tensors, 1, (13, 11), 12, neutral=True)
    assert segs[0].L == 16, segs[0].L
    return segs


class _DecayingPadding:
    """Mutation of a segment whose padding decays nothing (``live``): its padded pieces marked all live, so the
    padding after the lone piece decays the state it hands on, still claiming neutral."""

    def with_tensors(self, fn):
        padded = super().with_tensors(fn)
        padded.live = torch.ones_like(padded.live)
        return padded


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("kind", ["rglru", "kda", "lightning", "rwkv", "rglru-zero-padded", "lightning-decaying",
                                  "rwkv-decaying"])
def test_split_part_power_of_two_pieces_exact_float64(kind, strategy):
    """A documents shard's split part as pieces a power of two long (its length is new per packing; a kernel that
    loops over the tokens in Python would compile a graph per length): the padding after a piece the state passes on
    must leave any state as it is (``neutral_padding``: RG-LRU pads ``a = 1, x = 0``, gated DeltaNet / KDA zeros, so
    ``g = beta = 0``; lightning and RWKV mark the padding not ``live``, so it decays nothing). Outputs and gradients
    as each document alone, float64. Mutations: RG-LRU padded with ``a = 0`` (``rglru-zero-padded``: a zero state
    stays zero, so the padding before a document is fine, but the state the lone piece hands on is wiped), lightning
    and RWKV with their padding decaying (``*-decaying``: a fixed decay per token, as before ``live``), each still
    claiming neutral: the next chunk's tokens of the document go wrong."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment
    from ringmaster.recurrent.lightning import LightningSegment
    from ringmaster.recurrent.rglru import RglruSegment
    from ringmaster.recurrent.rwkv import WkvSegment
    from ringmaster_tools.parity import keep_fp64

    lens = (13, 11)
    ends = [(0, lens[0]), (lens[0], sum(lens))]
    g = torch.Generator().manual_seed(0)
    if kind.startswith("rglru"):
        x = torch.randn(2, 24, 6, generator=g, dtype=torch.float64, requires_grad=True)
        a = (1 - torch.logspace(-4, -0.3, 6, dtype=torch.float64) * torch.rand(2, 24, 6, generator=g,
                                                                                dtype=torch.float64)).requires_grad_(True)
        reset = torch.zeros(2, 24, 1, dtype=torch.bool)
        reset[:, 13] = True                                   # the second document's start (the model's position 0)

        class ZeroPadded(RglruSegment):
            def with_tensors(self, fn):
                return ZeroPadded(self.kernel, fn(self.x), fn(self.a), fn(self.reset))

        seg = ZeroPadded if kind == "rglru-zero-padded" else RglruSegment

        def kernel(**kw):
            return RecurrentGemmaRglru._rnn_scan(None, **kw)

        leaves = [x, a]
        with keep_fp64():
            ref = naive.rglru_recurrence(x, a, reset)[0]
            y = _run(_split_part_segments(lambda *t: seg(kernel, *t), [x, a, reset]), strategy)
    elif kind.startswith("lightning"):
        inputs, slope = _lightning_inputs()
        leaves = list(inputs.values())
        seg = type("Decaying", (_DecayingPadding, LightningSegment), {}) if kind.endswith("decaying") else LightningSegment
        ref = torch.cat([naive.lightning_recurrence(*(t[:, s:e] for t in leaves), slope)[0] for s, e in ends], dim=1)
        y = _run(_split_part_segments(lambda *t: seg(*t, slope[:, None, None], 5), leaves), strategy)
    elif kind.startswith("rwkv"):
        k, v = (torch.randn(2, 24, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        decay = torch.linspace(-6, 1, 5, dtype=torch.float64).requires_grad_(True)
        first = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
        leaves = [k, v, decay, first]
        seg = type("Decaying", (_DecayingPadding, WkvSegment), {}) if kind.endswith("decaying") else WkvSegment
        with keep_fp64():
            ref = torch.cat([naive.wkv_recurrence(decay, first, k[:, s:e], v[:, s:e])[0] for s, e in ends], dim=1)
            y = _run(_split_part_segments(lambda kk, vv: seg(rwkv_linear_attention_cpu, decay, first, kk, vv),
                                          [k, v]), strategy)
    else:
        inputs = {k: v.requires_grad_(True) for k, v in _kda_inputs().items()}
        leaves = list(inputs.values())
        ref = torch.cat([naive.kda_recurrence(*(t[:, s:e] for t in inputs.values()))[0] for s, e in ends], dim=1)
        y = _run(_split_part_segments(lambda *t: GatedDeltaSegment(naive.chunk_kda_ref, *t, kwargs=dict(
            use_qk_l2norm_in_kernel=True)), leaves), strategy)
    if kind.endswith(("zero-padded", "decaying")):
        assert _rel(y, ref) > 1e-3, _rel(y, ref)
    else:
        _check_grads(y, ref, leaves, 1e-11)


def test_split_part_power_of_two_pieces_refused_where_padding_moves_the_state():
    """KDA with its gates computed in the kernel (``use_gate_in_kernel``: a zero gate input is no longer a zero
    decay), so its zero padding would move the state (``neutral_padding`` False): handed pieces padded after a piece
    the state passes on, its segment refuses (the batch of another runtime than the one that wired the model),
    rather than run them inexactly."""
    from ringmaster.recurrent.gated_deltanet import GatedDeltaSegment

    inputs = _kda_inputs()

    def make(*t):
        return GatedDeltaSegment(naive.chunk_kda_ref, *t, kwargs=dict(use_gate_in_kernel=True))
    assert not make(*inputs.values()).neutral_padding
    with pytest.raises(RuntimeError, match="pads neutrally"):
        _split_part_segments(make, list(inputs.values()))


def test_wkv_padding_skipped_only_where_ringmasters_loop_is_the_kernel():
    """RWKV's padded pieces skip their padding's decay by running ringmaster's WKV loop (``wkv_live``) instead of the
    module's: only where, on a random input, that loop computes the module's bit for bit (asked when wired). Another
    loop (a remote-code edit: here its outputs scaled) keeps its padded pieces on itself, their padding decaying,
    and says it does not pad neutrally (a documents split part's lone piece then fills its row), rather than run a
    loop that is not the model's."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from ringmaster.recurrent.rwkv import WkvSegment, same_as_torch_loop

    def edited(*args, **kwargs):
        out, state = rwkv_linear_attention_cpu(*args, **kwargs)
        return out * 1.0001, state

    assert same_as_torch_loop(rwkv_linear_attention_cpu) and not same_as_torch_loop(edited)
    k = torch.randn(2, 6, 3)
    for ok in (True, False):
        seg = WkvSegment(rwkv_linear_attention_cpu, torch.zeros(3), torch.zeros(3), k, k, live_ok=ok)
        padded = seg.with_tensors(lambda t, fill=0.0: torch.cat([t, torch.full_like(t[:, :2], fill)], dim=1))
        assert seg.neutral_padding is ok and (padded.live is not None) is ok
