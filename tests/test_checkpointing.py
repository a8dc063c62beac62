"""The checkpointing x backend matrix: every CP backend exact with activation checkpointing on.

Backends: Ulysses, Ring p2p and allgather, USP (P=4, 2 x 2), gated-DeltaNet state passing by scan and
sequential (qwen3_5_text), pure Mamba2 (its mixers read the batch from the model's step carrier), jamba
(a hybrid whose Mamba decoder layers drop ``**kwargs``: the same) and falcon (a self-attention site: the
same). Modes: HF
``gradient_checkpointing_enable`` reentrant and non-reentrant, ``offload=True``, torch's non-reentrant
``checkpoint_wrapper`` around the decoder layers, and FSDP2 (``fully_shard``) with HF checkpointing.
Each cell runs two micro-batches (different packed documents) forward, then one backward, against the
same model without CP or checkpointing (fp64): loss, gathered logits, every parameter gradient against
its own norm, and the collectives the recomputation issued equal the forward's. All cells run
in one pool job (the pool's timeout turns a hang into a failure). See tests/jobs_checkpointing.py.
"""

import jobs_checkpointing as jobs
import pytest

BACKENDS = ("ulysses", "ring_p2p", "ring_allgather", "usp", "scan", "sequential", "mamba2", "falcon", "jamba")
# Mamba2 and falcon (the step carrier's paths: mixers / self-attention sites) under the modes whose checkpoint
# function differs: HF's (reentrant or not) and torch's checkpoint_wrapper; offload and FSDP2 go through
# HF's non-reentrant one
SKIP = {(b, m) for b in ("mamba2", "falcon") for m in ("hf_offload", "fsdp2")}
# offload moves the saved tensors, whatever the backend: one attention backend and one recurrent path
SKIP |= {(b, "hf_offload") for b in BACKENDS if b not in ("ulysses", "ring_p2p", "scan")}
CELLS = [(b, m) for m in jobs.MODES for b in BACKENDS if (b, m) not in SKIP]
# rm.tiled_mlp composed with CP and checkpointing (its own parity and memory: tests/test_tiled_mlp.py)
TILED = [("ulysses", "hf+tiled"), ("scan", "hf_reentrant+tiled"), ("ring_p2p", "torch+tiled")]


@pytest.fixture(scope="module")
def matrix(pool):
    """Every cell in one pool job (one reference per model type): the cells that need every rank (USP, FSDP2) on
    all four, each other cell on one of the two CP groups of P=2 (jobs.matrix's share). ``{"backend/mode (rank r)":
    result}`` for every rank that ran the cell."""
    out = {}
    for rank, per_rank in enumerate(pool.run(jobs.matrix, CELLS + TILED, share=True)):
        out.update({f"{name} (rank {rank})": r for name, r in per_rank.items()})
    ran = {name.split(" (")[0] for name in out}
    assert ran == {f"{b}/{m}" for b, m in CELLS + TILED}, sorted(ran)
    return out


def _cells(matrix, keys) -> dict:
    """Every rank's result of the cells ``keys`` (``"backend/mode"``); each cell ran on at least one CP group."""
    got = {name: r for name, r in matrix.items() if name.split(" (")[0] in keys}
    for key in keys:
        P = jobs.BACKENDS[key.split("/")[0]][2]
        assert sum(name.startswith(key + " (") for name in got) >= P, (key, sorted(got))
    return got


def check(results):
    bad = []
    for name, r in results.items():
        errs = (r["loss_err"], r["logits_err"], r["grad_err"])
        if not all(e <= jobs.TOL for e in errs) or r["missing"]:
            bad.append(f"{name}: loss {errs[0]:.1e} logits {errs[1]:.1e} grad {errs[2]:.1e} ({r['worst_param']}) "
                       f"missing {r['missing'][:3]}")
        if r["leftover_wrappers"]:
            bad.append(f"{name}: rm.unwire left checkpoint wrappers on {r['leftover_wrappers'][:3]}")
        if not r["recompute_matches"] or not r["fwd_collectives"]:
            bad.append(f"{name}: the recomputation issued {r['recompute_collectives']} forward collectives, "
                       f"not the forward's {r['fwd_collectives']}")
    assert not bad, "\n".join(bad)


def test_tiled_mlp_composes_with_cp_and_checkpointing(matrix):
    check(_cells(matrix, [f"{b}/{m}" for b, m in TILED]))


@pytest.mark.parametrize("mode", jobs.MODES)
def test_every_backend_exact_under_checkpointing(matrix, mode):
    results = _cells(matrix, [f"{b}/{m}" for b, m in CELLS if m == mode])
    check(results)
    if mode == "hf_offload":   # the layers' saved inputs went through save_on_cpu (2 micro-batches x layers)
        assert all(r["offloaded_calls"] > 0 for r in results.values()), results


def test_transformers_offload_kwarg_is_an_argument():
    """transformers 5.24 takes ``offload`` as an argument of ``(gradient|activation)_checkpointing_enable``;
    inside ``gradient_checkpointing_kwargs`` it would reach torch's checkpoint, which refuses it."""
    import inspect

    from transformers import PreTrainedModel

    assert "offload" in inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters


def test_mutation_stale_slot_is_caught(pool):
    """Without the step carrier's replay (ringmaster/checkpointing.py; the carrier left holding the last
    forward's batch), Mamba2's recomputation of the first micro-batch reads the second's documents: under reentrant checkpointing the gradients are silently
    wrong (measured 0.87 relative), and the matrix's gradient check fails."""
    r = pool.run(jobs.matrix, [("mamba2", "hf_reentrant")], mutation="stale_slot",
                 share=True)[0]["mamba2/hf_reentrant"]
    assert r["grad_err"] > 1e-3, r
    with pytest.raises(AssertionError, match="grad"):
        check({"mamba2/hf_reentrant": r})


def test_mutation_stale_site_slot_is_caught(pool):
    """The same for a self-attention site (falcon): without the replay, measured 0.91 relative."""
    r = pool.run(jobs.matrix, [("falcon", "hf_reentrant")], mutation="stale_site_slot",
                 share=True)[0]["falcon/hf_reentrant"]
    assert r["grad_err"] > 1e-3, r


def test_mutation_other_collective_path_in_recompute_is_caught(pool):
    """A path chosen by grad mode (q, k, v unfused when the reentrant forward runs without grad, fused in the
    recomputation): the loss and gradients stay exact, the collective check is what fails."""
    r = pool.run(jobs.matrix, [("ulysses", "hf_reentrant")], mutation="grad_path",
                 share=True)[0]["ulysses/hf_reentrant"]
    assert r["grad_err"] <= jobs.TOL and not r["recompute_matches"], r
    with pytest.raises(AssertionError, match="recomputation issued"):
        check({"ulysses/hf_reentrant": r})


def test_mutation_carrier_not_replayed_is_caught(pool):
    """The one step carrier (ringmaster/sharding/carrier.py) neither replayed by the checkpoint functions nor
    cleared after the step: the checkpointed hybrid's Mamba mixers (jamba: its Mamba decoder layers drop
    ``**kwargs``, so the mixers read the carrier) recompute the first micro-batch with the second's documents.
    Under reentrant checkpointing that is silent (measured 1.25 relative) and the parity check fails;
    non-reentrant checkpointing notices the shapes differ (``CheckpointError``) on some ranks only."""
    r = pool.run(jobs.matrix, [("jamba", "hf_reentrant")], mutation="stale_carrier",
                 share=True)[0]["jamba/hf_reentrant"]
    assert r["grad_err"] > 1e-3, r
    with pytest.raises(AssertionError, match="grad"):
        check({"jamba/hf_reentrant": r})


def test_unreplayed_carrier_fails_closed(pool):
    """Not replayed, but cleared when the step ends (as the shard step does): the recomputation in backward
    finds no step context and raises naming it, instead of reading another forward's."""
    for r in pool.run(jobs.raised, [("jamba", "hf_reentrant")], mutation="unreplayed_carrier"):
        assert r is not None and r[0] == "RuntimeError" and "ringmaster_batch" in r[1], r
