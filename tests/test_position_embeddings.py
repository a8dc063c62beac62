"""Learned absolute position tables under CP: exact, or refused naming the table.

A family with a position table numbers the row itself when the batch has no position_ids, each
its own way (GPT-2/BERT/BioGPT: 0..S-1; OPT: the attention-mask cumsum; RoBERTa: the pad-token
cumsum from padding_idx + 1). ``rm.wire`` finds the rule with a probe forward; the shard step
passes the full row's numbering, cut for the shard; the first CP forward checks each table saw it.
Every case compares loss, logits (real tokens) and every parameter's gradient (each against its
own norm) with the same float64 model run on one device without position_ids, at P=2 (a (2, 2)
mesh) and P=4, under Ulysses and Ring.
"""

import jobs_position_embeddings as jobs
import pytest

TOL = 1e-6   # float64, the zoo's tolerance

BOTH = [("ulysses", 2, None, "region"), ("ring", 2, None, "region"), ("ulysses", 4, None, "region"),
        ("ring", 4, None, "region")]
CONVENTION = {"gpt2": "arange: 'transformer.wpe'",
              "opt": "mask_cumsum: 'model.decoder.embed_positions' (+2)",
              "roberta": "pad_cumsum, padding_idx=0: 'roberta.embeddings.position_embeddings'",
              "biogpt": "arange: 'biogpt.embed_positions' (+2)"}


def check(results, family, n):
    assert len(results) == n, results   # rank 0 ran every case (a solo pool's other CP group skips its P=2 ones)
    for r in results:
        assert r["positions"] == CONVENTION[family], r["positions"]
        assert not r["missing"], r["missing"]
        assert r["loss_err"] < TOL and r["logits_err"] < TOL, r
        assert r["grad_err"] < TOL, (r["backend"], r["P"], r["worst_param"], r["grad_err"])


@pytest.mark.parametrize("kind", ["dense", "padded"])
@pytest.mark.parametrize("family", ["gpt2", "opt", "roberta", "biogpt"])
def test_exact(pool, family, kind):
    check(pool.run(jobs.parity, family, kind, BOTH)[0], family, len(BOTH))


@pytest.mark.parametrize("family,kind,cases", [
    ("roberta", "padded", [("ring", 4, "head_tail", "region"), ("ring", 2, "head_tail", "hooks")]),
    ("opt", "padded", [("ulysses", 2, None, "hooks"), ("ring", 4, "distflash", "region")]),
    ("opt", "packed", [("ulysses", 4, None, "region"), ("ring", 2, None, "region")]),   # position_ids given
    ("roberta", "embeds", [("ulysses", 2, None, "region"), ("ring", 4, None, "region")]),
])
def test_exact_layouts_hooks_packed_embeds(pool, family, kind, cases):
    """Head-tail shards (positions cut out of order), distflash, the trainers' forward-hook path, a
    packed row whose own position_ids are used as given, and inputs_embeds (RoBERTa counts every
    token then, as on one device)."""
    check(pool.run(jobs.parity, family, kind, cases)[0], family, len(cases))


@pytest.mark.parametrize("family,kind,table", [("roberta", "dense", "'roberta.embeddings.position_embeddings'"),
                                               ("opt", "padded", "'model.decoder.embed_positions'")])
def test_mutation_skipped_rewrite_trips_accounting(pool, family, kind, table):
    """The shard step passes ringmaster's plain global arange: the first CP forward raises, before
    backward, naming the table."""
    kind_, msg = pool.run(jobs.mutated_error, family, kind, "ring", 2)[0]
    assert kind_ == "UnsupportedLayerError", msg
    assert f"position table {table}" in msg and "own numbering" in msg, msg


@pytest.mark.parametrize("family,kind", [("roberta", "dense"), ("opt", "padded")])
def test_mutation_skipped_rewrite_is_wrong(pool, family, kind):
    """Mechanism off (no rewrite, no accounting check): the model-level parity check sees the error."""
    results = pool.run(jobs.parity, family, kind, [("ulysses", 2, None, "region"), ("ring", 4, None, "region")],
                       "skip_rewrite_unchecked")[0]
    assert len(results) == 2, results
    for r in results:
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) > 1e-3, r


@pytest.mark.parametrize("kind,needle", [
    ("ignore_given", "not indexed by position_ids plus a constant"),
    ("unknown", "follows none of the rules"),
    ("also_read", "something besides the table reads position_ids"),
])
def test_probe_refuses_what_it_cannot_number(pool, kind, needle):
    kind_, msg = pool.run(jobs.wire_error, kind)[0]
    assert kind_ == "UnsupportedLayerError", msg
    assert "'transformer.wpe'" in msg and needle in msg, msg
