"""xLSTM's mLSTM (kind ``mlstm``) exact under CP.

Function level (single process): transformers' own mLSTM backend (chunkwise kernel + token loop, kept in
float64) run per chunk and composed by :mod:`ringmaster.recurrent.mlstm`, against the float64
token-by-token reference with the memory unstabilised (:func:`naive.mlstm_recurrence`), outputs and
gradients; resets at document starts. Model level: fp64 end to end every parameter within 1e-5 at P=2
and P=4, Ulysses and Ring, scan and sequential, head_tail; fp32 loss / logits / whole gradient; packed
rows against every document alone; a padded batch; and the mutation (the carried state dropped) that the
same fp64 check catches by a wide margin, which wire's probe does not.
"""

import jobs_xlstm as jx
import pytest
import torch

from standins import naive
from ringmaster.recurrent.documents import DocumentSegment
from ringmaster.recurrent.scan import simulate_scan, simulate_sequential
from ringmaster.sharding.documents import Runs
from ringmaster_tools.parity import keep_fp64

FP64_PARAM_TOL = 1e-5   # every parameter, fp64
FP64_TOL = 1e-10        # fp64 loss and gathered logits
TOL = 1e-4              # fp32 loss and gathered logits
TOTAL_TOL = 2e-4        # fp32 whole gradient
MARGIN = 100            # the mutation must break the fp64 bound by this factor

SPLITS = {"equal4": [0, 6, 12, 18, 24], "uneven": [0, 1, 2, 9, 24], "head_tail4": [0, 3, 6, 9, 12, 15, 18, 21, 24]}
# parameters whose gradient only the state passing gets right
NEEDED = ("mlstm_layer.igate_preact.weight", "mlstm_layer.fgate_preact.bias", "mlstm_layer.k.weight")


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _backend_kernel(chunk_size=4):
    from transformers import xLSTMConfig
    from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

    backend = xLSTMBackend(xLSTMConfig(hidden_size=64, num_heads=4, chunk_size=chunk_size, num_hidden_layers=1))

    def kernel(q, k, v, igate, fgate, c, n, m):
        return type(backend).forward(backend, query=q, key=k, value=v, igate=igate, fgate=fgate, c_initial=c,
                                     n_initial=n, m_initial=m, mode="inference")
    return kernel


def _inputs(b=2, h=3, L=24, dk=4, dv=5, spread=3.0):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, L, d, generator=g, dtype=torch.float64, requires_grad=True) for d in (dk, dk, dv))
    igate = (spread * torch.randn(b, h, L, generator=g, dtype=torch.float64)).requires_grad_(True)
    fgate = (2 + 2 * torch.randn(b, h, L, generator=g, dtype=torch.float64)).requires_grad_(True)
    return [q, k, v, igate, fgate]


def _run(segs, strategy):
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=2)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("spread", [0.5, 8.0])
def test_mlstm_state_passing_exact_float64(spread, split, strategy):
    """``spread``: input gates ~N(0, spread²); at 8 the stabiliser jumps between its branches (the carried
    ``m + log f`` and a new input gate) inside and across chunks, at 0.5 it mostly decays from m_0 = 0."""
    from ringmaster.recurrent.mlstm import MlstmSegment

    kernel, inputs = _backend_kernel(), _inputs(spread=spread)
    with keep_fp64():
        ref = naive.mlstm_recurrence(*inputs)[0]
        b = SPLITS[split]
        y = _run([MlstmSegment(kernel, *(t[:, :, s:e] for t in inputs)) for s, e in zip(b, b[1:])], strategy)
        W = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=ref.dtype)
        g_ref = torch.autograd.grad((ref * W).sum(), inputs, retain_graph=True)
        g = torch.autograd.grad((y * W).sum(), inputs)
    assert _rel(y, ref) <= 1e-12, _rel(y, ref)
    for a, r in zip(g, g_ref):
        assert _rel(a, r) <= 1e-11, _rel(a, r)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
def test_mlstm_resets_at_document_starts(strategy):
    from ringmaster.recurrent.mlstm import MlstmSegment

    kernel, inputs = _backend_kernel(), _inputs(b=1)
    lens = [2, 15, 7]
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[None]
    with keep_fp64():
        ref, start = [], 0
        for n in lens:
            ref.append(naive.mlstm_recurrence(*(t[:, :, start:start + n] for t in inputs))[0])
            start += n
        ref = torch.cat(ref, dim=2)
        b = SPLITS["head_tail4"]
        runs = Runs.from_doc_ids(docs)
        segs = [DocumentSegment(MlstmSegment(kernel, *(t[:, :, x:y] for t in inputs)), runs.pattern(x, y), y - x)
                for x, y in zip(b, b[1:])]
        y = _run(segs, strategy)
    assert _rel(y, ref) <= 1e-12, _rel(y, ref)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
def test_mlstm_pieces_exact_float64(strategy, spread=8.0):
    """Packed rows as padded pieces (the compiled path): padding with input gate -1e30 and forget gate 1e4 leaves
    (C, n, m) as they are, and a piece that starts a document maps from transformers' zero state; outputs and
    gradients as every document alone, float64."""
    from test_linear_recurrent import PIECES_DOCS, _check_grads, pieces_segments

    from ringmaster.recurrent.mlstm import MlstmSegment

    kernel, inputs = _backend_kernel(), _inputs(L=sum(PIECES_DOCS), spread=spread)
    with keep_fp64():
        ends = torch.tensor(PIECES_DOCS).cumsum(0).tolist()
        ref = torch.cat([naive.mlstm_recurrence(*(t[:, :, s:e] for t in inputs))[0]
                         for s, e in zip([0, *ends], ends)], dim=2)
        segs = pieces_segments(lambda *t: MlstmSegment(kernel, *t), inputs, 2)
        _check_grads(_run(segs, strategy), ref, inputs, 1e-12)


def test_mutation_mlstm_pieces_map_documents_from_no_state():
    """Mutation: a piece that starts a document mapped from the "no state" ``m = -1e38`` (``starts`` dropped), not
    from transformers' zero state: the check above fails on it (measured 1.4e-9 at spread 8, scan)."""
    from test_linear_recurrent import PIECES_DOCS, pieces_segments

    from ringmaster.recurrent.mlstm import MlstmSegment

    class NoStarts(MlstmSegment):
        def with_tensors(self, fn):
            padded = super().with_tensors(fn)
            padded.starts = None
            return padded

    kernel, inputs = _backend_kernel(), _inputs(L=sum(PIECES_DOCS), spread=8.0)
    with keep_fp64():
        ends = torch.tensor(PIECES_DOCS).cumsum(0).tolist()
        ref = torch.cat([naive.mlstm_recurrence(*(t[:, :, s:e] for t in inputs))[0]
                         for s, e in zip([0, *ends], ends)], dim=2)
        y = _run(pieces_segments(lambda *t: NoStarts(kernel, *t), inputs, 2), "scan")
    assert _rel(y, ref) > 1e-10, _rel(y, ref)


# --------------------------------------------------------------------------- model level


def check(results, P, fp64):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] == 2, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], r["missing_grads"]
        for name in NEEDED:
            assert any(name in k for k in r["grad_errs"]), (name, sorted(r["grad_errs"]))
        if fp64:
            assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
            worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
        else:
            assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
            assert r["grad_err_total"] <= TOTAL_TOL, (rank, r["grad_err_total"])
            worst = {}
        assert not worst, (rank, worst)


GRID = [("ulysses", 2, "sequential"), ("ring", 2, "scan"), ("ulysses", 4, "scan"), ("ring", 4, "sequential")]


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}")
def test_exact_fp64_per_parameter(pool, case):
    backend, P, strategy = case
    check(pool.run(jx.parity, P, strategy, backend, fp64=True), P, True)


def test_head_tail_dense_fp64(pool):
    """Ring with the head_tail layout (2 chunks a rank, composed in sequence order), one dense row."""
    results = pool.run(jx.parity, 4, "scan", "ring", fp64=True, cfg_kwargs=dict(load_balance="head_tail"))
    assert all(r["layout"] == "head_tail" for r in results)
    check(results, 4, True)


def test_train_mode_chunkwise_reference_fp64(pool):
    """``config.mode="train"``: the reference runs only the chunkwise kernel (64 tokens in 16-token chunks);
    under CP every chunk runs the backend's inference path (chunkwise + token loop) from its state."""
    check(pool.run(jx.parity, 4, "scan", "ulysses", fp64=True, overrides=dict(mode="train", chunk_size=16)), 4, True)


def test_fp32_loss_and_whole_gradient(pool):
    check(pool.run(jx.parity, 4, "scan", "ulysses"), 4, False)


PACKED = [("ulysses", 4, "scan", None), ("ring", 2, "sequential", dict(load_balance="head_tail"))]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"{c[0]}-P{c[1]}-{c[2]}{'-ht' if c[3] else ''}")
def test_packed_rows_match_documents_alone(pool, case):
    backend, P, strategy, cfg_kwargs = case
    check(pool.run(jx.packed_parity, P, strategy, backend, cfg_kwargs), P, True)


def test_padded_rows(pool):
    for r in pool.run(jx.padded_parity, 4, "scan"):
        assert not r["nan"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL and r["grad_err_total"] <= TOTAL_TOL, r


@pytest.mark.parametrize("P,strategy", [(4, "scan"), (2, "sequential")])
def test_mutation_state_dropped_fails_fp64_parity(pool, P, strategy):
    """Dropping the carried state passes wire's probe (the model wires and runs: nothing raised) and the
    fp64 model-level check fails by a wide margin; undone, the same run is exact."""
    for rank, out in enumerate(pool.run(jx.mutated_parity, P, strategy)):
        assert "raised" not in out, out["raised"]
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if "mlstm_layer" in k}
        print(f"mlstm state dropped P={P} {strategy} rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, "
              f"logits {r['logits_err']:.2e}")
        assert errs and max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
        assert r["logits_err"] >= MARGIN * FP64_TOL, (rank, r["logits_err"])
        clean = out["clean"]
        assert max(clean["grad_errs"].values()) <= FP64_PARAM_TOL, (rank, clean["worst_param"])
