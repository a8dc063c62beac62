"""load_balance="documents" (length-aware CP): short documents whole on one rank, long ones split.

Host: the assignment covers every token once, keeps each short document whole, cuts the split sub-row evenly,
balances the work, and is the same on every rank. Model level: a packed row under Ulysses, Ring and USP (llama)
and through a gated-DeltaNet hybrid, a Mamba2 hybrid and one family of every other recurrent kind (Mamba1, RWKV,
RG-LRU, lightning, KDA, mLSTM, short conv; fp64, per parameter) against every document run alone: loss, gathered
logits, every gradient. Mutations: a whole document on two ranks, a split document's state not passed (gated
DeltaNet, RWKV), the local attention given the split document's keys.
"""

import jobs_documents as jd
import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_hybrid_parity import FP64_PARAM_TOL, FP64_TOL
from test_ulysses_parity import TOL

from ringmaster.sharding.assignment import Cost, assign, plan_documents
from ringmaster.sharding.documents import Runs

# S=96, threshold 16: a long mix (one 67-token document split, the rest whole), all short, every one long,
# one exactly at the threshold (kept whole), and a mix whose long documents do not cut evenly (fixed by short ones)
MIXES = {
    "one-long": [5, 67, 10, 14],
    "all-short": [12, 16, 9, 11, 14, 10, 8, 16],
    "all-long": [30, 66],
    "at-threshold": [16, 45, 3, 16, 16],
    "uneven": [7, 41, 9, 13, 4, 22],
}
THRESHOLD = 16


def _docs(lens):
    out, t = [], 0
    for n in lens:
        out.append((t, t + n))
        t += n
    return out


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=20), P=st.sampled_from([2, 4]),
       layout=st.sampled_from(["contiguous", "head_tail"]), threshold=st.integers(1, 64))
def test_assignment_covers_every_token_once_and_keeps_short_documents_whole(lens, P, layout, threshold):
    m = P * (2 if layout == "head_tail" else 1)
    lens = lens + [1] * (-sum(lens) % m)           # the row cuts evenly (a padded batch)
    S = sum(lens)
    a = assign(_docs(lens), S, P, layout, threshold)
    seen = torch.cat([a.local_index(r) for r in range(P)])
    assert sorted(seen.tolist()) == list(range(S))
    assert a.split_len % m == 0
    for s, e in _docs(lens):
        owners = [r for r in range(P) if (s, e) in a.whole[r]]
        if e - s > threshold:
            assert (s, e) in a.split and not owners
        else:
            assert len(owners) == 1 or (s, e) in a.split   # whole on one rank, or a filler of the split sub-row
    fillers = [d for d in a.split if d[1] - d[0] <= threshold]
    if fillers:   # short documents join the split sub-row only when the long ones do not cut evenly
        assert sum(e - s for s, e in a.split if e - s > threshold) % m != 0
    assert torch.equal(a.gathered.sort().values, torch.arange(S))


def test_lognormal_mix_is_balanced_and_moves_only_the_long_documents():
    g = torch.Generator().manual_seed(0)
    lens = (torch.empty(400).log_normal_(6.0, 1.0, generator=g).clamp(16, 16384)).long().tolist()
    lens.append(-sum(lens) % 4 or 4)
    S = sum(lens)
    a = plan_documents(Runs(S, (tuple(s for s, _ in _docs(lens)),)), S, 4, "contiguous", None, Cost())
    assert a.work_max_over_mean <= 1.10, a.describe()
    assert a.split_fraction < 0.5, a.describe()
    assert plan_documents(Runs(S, (tuple(s for s, _ in _docs(lens)),)), S, 4, "contiguous", None, Cost()) == a


def test_rows_with_different_documents_are_refused_before_any_collective():
    runs = Runs(8, ((0, 4), (0, 2)))
    with pytest.raises(ValueError, match="one row"):
        plan_documents(runs, 8, 2, "contiguous", 2)


def _check(results, fp64=False):
    for rank, r in enumerate(results):
        assert r["layout"] == "documents", r["layout"]
        assert not r["missing_grads"], r["missing_grads"]
        if fp64:
            assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
            worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
            assert not worst, (rank, worst)
        else:
            assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, (rank, r["loss_err"], r["logits_err"])
            assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"])


LLAMA = dict(num_attention_heads=8, num_key_value_heads=2)
BACKENDS = [("ulysses", 2, {}), ("ring", 2, {}), ("ulysses", 4, {}), ("ring", 4, {}),
            ("usp", 4, dict(ulysses_size=2, ring_size=2))]


# every backend on the one-long mix, the 4-rank ones also on the mix whose long documents need fillers
LLAMA_CASES = [("one-long", *b) for b in BACKENDS] + [("uneven", *b) for b in BACKENDS if b[1] == 4]


@pytest.mark.parametrize("mix,backend,P,cfg", LLAMA_CASES, ids=[f"{m}-{b}-P{P}" for m, b, P, _ in LLAMA_CASES])
def test_llama_documents_parity(pool, mix, backend, P, cfg):
    _check(pool.run(jd.documents_parity, P, "llama", backend, MIXES[mix], THRESHOLD, cfg, overrides=LLAMA))


@pytest.mark.parametrize("mix", ["all-short", "all-long", "at-threshold"])
def test_llama_documents_mixes(pool, mix):
    results = pool.run(jd.documents_parity, 4, "llama", "ring", MIXES[mix], THRESHOLD, overrides=LLAMA)
    if mix == "all-long":   # every document split: the static layout, exact as before
        assert all(r["layout"] == "documents" for r in results)
        assert all(r["split_fraction"] == 1.0 for r in results)
    if mix == "all-short":  # nothing travels but the fillers that make the split sub-row cut evenly (none here)
        assert all(r["split_fraction"] == 0.0 for r in results), [r["split_fraction"] for r in results]
    _check(results)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(3, 40), min_size=2, max_size=9), threshold=st.integers(4, 40),
       backend=st.sampled_from(["ring", "ulysses"]))
def test_random_mixes_are_exact(pool, lens, threshold, backend):
    lens = lens + [1] * (-sum(lens) % 4)          # the row cuts evenly (padding tokens, each a document)
    _check(pool.run(jd.documents_parity, 2, "llama", backend, lens, threshold, overrides=LLAMA))


def test_llama_documents_through_the_trainer_hooks(pool):
    _check(pool.run(jd.documents_parity, 2, "llama", "ulysses", MIXES["one-long"], THRESHOLD, via="hooks",
                    overrides=LLAMA))


def test_token_logprobs_in_row_order(pool):
    for r in pool.run(jd.logprobs_parity, 2, "ring", MIXES["uneven"], THRESHOLD):
        assert r["lp_err"] <= 1e-10 and r["ent_err"] <= 1e-10, r
        assert r["grad_err"] <= 1e-8 and not r["missing"], r


@pytest.mark.parametrize("model_type,backend", [("llama", "ring"), ("qwen3_5_text", "ulysses")])
def test_activation_checkpointing(pool, model_type, backend):
    _check(pool.run(jd.documents_parity, 2, model_type, backend, MIXES["uneven"], THRESHOLD, checkpointing=True,
                    overrides=LLAMA if model_type == "llama" else None))


HYBRIDS = [("qwen3_5_text", 2, "ulysses"), ("qwen3_5_text", 4, "ring"), ("nemotron_h", 2, "ring"),
           ("nemotron_h", 4, "ulysses")]


@pytest.mark.parametrize("model_type,P,backend", HYBRIDS, ids=[f"{m}-P{P}-{b}" for m, P, b in HYBRIDS])
def test_hybrid_documents_parity_fp64(pool, model_type, P, backend):
    _check(pool.run(jd.documents_parity, P, model_type, backend, MIXES["uneven"], THRESHOLD, fp64=True), fp64=True)


# every other recurrent kind by parts (one family each; kimi_linear's KDA is gated DeltaNet's path with its own
# kernel, lfm2's short conv the conv of the hybrids above): Ulysses at P=2, Ring's head_tail split layout at P=4,
# and a row with nothing to split (every rank's shard is its whole documents: no split part)
RECURRENT = [("falcon_mamba", 2, "ulysses", "uneven"), ("rwkv", 2, "ulysses", "uneven"),
             ("recurrent_gemma", 2, "ulysses", "uneven"), ("minimax", 2, "ulysses", "uneven"),
             ("kimi_linear", 2, "ulysses", "uneven"), ("xlstm", 2, "ulysses", "uneven"), ("lfm2", 2, "ulysses", "uneven"),
             ("mamba", 4, "ring", "uneven"), ("rwkv", 4, "ring", "uneven"), ("rwkv", 2, "ulysses", "all-short")]


@pytest.mark.parametrize("model_type,P,backend,mix", RECURRENT, ids=[f"{m}-P{P}-{b}-{x}" for m, P, b, x in RECURRENT])
def test_recurrent_documents_parity_fp64(pool, model_type, P, backend, mix):
    results = pool.run(jd.documents_parity, P, model_type, backend, MIXES[mix], THRESHOLD, fp64=True)
    print(model_type, P, backend, mix, "worst per-parameter gradient error",
          max(max(r["grad_errs"].values()) for r in results))
    fractions = [r["split_fraction"] for r in results]
    assert all(0.0 < f < 1.0 for f in fractions) if mix == "uneven" else all(f == 0.0 for f in fractions), fractions
    _check(results, fp64=True)


# a compiled runtime's parts (rm.wire(compile=True), run eagerly: what its batches carry is what a compiled block
# runs): every rank's whole part runs spare tokens past its documents, a spare-only whole part where a rank holds no
# whole document (all-long), and with the threshold chosen per batch something is split where an eager runtime splits
# nothing (all-short: the longest document alone; rwkv's token shift, Mamba1's conv halo through the parts); the
# attention and gated-DeltaNet hybrid at 4 ranks, the others at 2
COMPILED = [("qwen3_5_text", "uneven", THRESHOLD, 4), ("rwkv", "all-long", THRESHOLD, 2),
            ("falcon_mamba", "all-short", None, 2)]


@pytest.mark.parametrize("model_type,mix,threshold,P", COMPILED, ids=[f"{m}-{x}-P{P}" for m, x, _, P in COMPILED])
def test_compiled_runtime_parts_exact_fp64(pool, model_type, mix, threshold, P):
    results = pool.run(jd.documents_parity, P, model_type, "ulysses", MIXES[mix], threshold, fp64=True,
                       compiled=True)
    assert all(r["split_fraction"] > 0.0 for r in results), [r["split_fraction"] for r in results]
    _check(results, fp64=True)


def test_a_compiled_runtime_keeps_the_parts_cases():
    """Host only: a compiled runtime's assignment splits something where anything can be split, with a share of at
    least 2 tokens (an eager runtime splits nothing on these rows), and every rank has a whole part, its spare tokens
    a document of their own past the whole documents; an eager runtime's parts are as before."""
    from ringmaster.sharding.assignment import SPARE
    from ringmaster.sharding.documents import CPBatch

    for lens in (MIXES["all-short"], [8] * 8, MIXES["uneven"]):
        S, runs = sum(lens), Runs(sum(lens), (tuple(s for s, _ in _docs(lens)),))
        eager = plan_documents(runs, S, 2, "contiguous", None)
        compiled = plan_documents(runs, S, 2, "contiguous", None, compiled=True)
        assert eager.split_len == 0 and eager.spare == 0, eager.describe()
        assert compiled.split_share >= 2 and compiled.spare == SPARE, compiled.describe()
    lens = MIXES["all-long"]   # every document split: no rank holds a whole one
    runs = Runs(sum(lens), (tuple(s for s, _ in _docs(lens)),))
    for compiled in (False, True):
        a = plan_documents(runs, sum(lens), 2, "contiguous", THRESHOLD, compiled=compiled)
        batch = CPBatch(1, 2, "documents", sum(lens), torch.zeros(1, sum(lens), dtype=torch.long), runs=runs,
                        assignment=a)
        whole = batch.parts[1]
        assert (whole is None) != compiled
        assert batch.whole_marker.shape[1] == (SPARE if compiled else 0)
        if compiled:
            assert whole.runs.row(0) == (0,) and whole.seq_len == SPARE and whole.origin.tolist() == [0] * SPARE


def _fails(results, fp64=False):
    try:
        _check(results, fp64)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("mutation,model_type,fp64", [("whole_on_two_ranks", "llama", False),
                                                       ("local_sees_split_keys", "llama", False),
                                                       ("split_state_not_passed", "qwen3_5_text", True),
                                                       ("split_state_not_passed", "rwkv", True)])
def test_mutation_fails_parity(pool, mutation, model_type, fp64):
    results = pool.run(jd.documents_parity, 2, model_type, "ulysses", MIXES["uneven"], THRESHOLD, fp64=fp64,
                       mutation=mutation, overrides=LLAMA if model_type == "llama" else None)
    assert _fails(results, fp64), f"{mutation}: parity still holds, the test cannot see it"


def test_ringmaster_axolotl_plugin_with_documents(pool):
    """The `ringmaster:` block with load_balance: documents through a HF Trainer step (the trainer's pre-hook cuts
    the row: 45 tokens and 3 padding tokens, each its own document; the long one split, padding kept whole)."""
    pytest.importorskip("axolotl")
    import jobs_adapters
    from test_adapters_axolotl import check

    results = pool.run(jobs_adapters.axolotl_plugin_step, 2, "llama", True, None, True,
                       cp=dict(load_balance="documents", documents_threshold=16), lens=[45])
    assert all(r["layout"] == "documents" for r in results)
    check(results, 2)


def test_plan_prints_the_documents_choice(capsys):
    from ringmaster.cli import main

    assert main(["plan", "--heads", "32", "--kv-heads", "8", "--world", "8", "--hidden", "4096", "--seq", "1048576",
                 "--documents", "lognormal:7,1.5", "--tflops", "200", "--intra-gbps", "450"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line and "backend" not in line}
    assert set(rows) == {"ulysses", "ring"}, out
    for threshold, split, balance, static, docs, ratio in rows.values():
        assert int(threshold) > 0 and split.endswith("%") and float(balance) <= 1.10, out
        assert float(ratio) == pytest.approx(float(docs) / float(static), abs=0.01), out
    assert float(rows["ring"][-1]) < 1.0, out   # Ring on a packed row: less traffic and the imbalance gone


def test_gather_sequence_under_documents_names_the_assignment_a_shard_has():
    """The error names a key the shard really has (issue 39: it named shard['_cp_shard']['assignment'])."""
    import ringmaster as rm

    with pytest.raises(ValueError, match=r"assignment=shard\['ringmaster_batch'\]\.assignment"):
        rm.gather_sequence(torch.zeros(1, 4), dim=1, group=object(), layout="documents")
