"""Dropout under CP (issue 27): each rank's forward draws from a random state forked per CP rank
(ringmaster/sharding/rng.py), so masks are independent across shards and reproducible from the seed; config
dropout fields the causal LM never reads do not refuse; with dropout off, CP stays exact.

P=2 on the gloo pool. Exactness with dropout on is checked against the model without CP run with the masks
the CP ranks drew (no per-position generator exists, so CP cannot draw one device's masks)."""

import jobs_dropout
import pytest

TOL = 1e-5
P = 2


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox"])
def test_default_config_wires(pool, model_type):
    """gpt2 (every *_pdrop 0.1, summary_first_dropout 0.1) and gpt_neox (classifier_dropout 0.1) with their
    default configs wire: real dropout runs forked per rank, unread fields are no reason to refuse."""
    for error, fields in pool.run(jobs_dropout.wire_default, model_type, P):
        assert error is None, error
        assert fields.get("summary_first_dropout" if model_type == "gpt2" else "classifier_dropout") == 0.1, fields


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox"])
def test_exact_with_dropout_off(pool, model_type, backend):
    """Dropout fields the model applies at 0 (gpt2's summary_first_dropout and gpt_neox's classifier_dropout left
    at 0.1): loss, gathered logits and every gradient equal the model's without CP."""
    for r in pool.run(jobs_dropout.parity, model_type, backend, P):
        assert r["n_grads"] == r["n_params"], r
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r


def check_masks(ranks, p=0.5, tol=0.05):
    """Masks differ across ranks at the same local positions, keep ~1-p, and the same seed gives the same masks
    (a different seed different ones)."""
    for group in range(0, len(ranks), P):   # the pool's ranks, P per CP group (its mesh is dp x cp)
        _check_group(ranks[group:group + P], p, tol)


def _check_group(ranks, p, tol):
    first, second = ranks
    for name in jobs_dropout.DROPS:
        a, b = first[0]["masks"][name], second[0]["masks"][name]
        assert a.shape == b.shape, (name, a.shape, b.shape)
        agree = (a == b).float().mean().item()   # independent masks: p^2 + (1-p)^2 = 0.5 at p=0.5
        assert abs(agree - (p * p + (1 - p) ** 2)) < tol, f"{name}: ranks' masks agree on {agree:.3f} of positions"
        for rank in ranks:
            kept = rank[0]["masks"][name].float().mean().item()
            assert abs(kept - (1 - p)) < tol, f"{name}: kept {kept:.3f}, expected {1 - p}"
            same, other = rank[1]["masks"][name], rank[2]["masks"][name]
            assert (rank[0]["masks"][name] == same).all(), f"{name}: the same seed drew different masks"
            assert not (rank[0]["masks"][name] == other).all(), f"{name}: another seed drew the same masks"
    for rank in ranks:
        assert rank[0]["loss"] == rank[1]["loss"] and rank[0]["loss"] != rank[2]["loss"], rank


def test_masks_independent_across_ranks_and_reproducible(pool):
    check_masks(pool.run(jobs_dropout.masks, 0.5, (0, 0, 1), P))


def test_masks_forked_under_gradient_checkpointing(pool):
    check_masks(pool.run(jobs_dropout.masks, 0.5, (0, 0, 1), P, checkpointing=True))


def test_mutation_without_fork_is_detected(pool):
    """Mutation: the forward's state not forked per rank (the fork seed ignores the rank): every rank draws the
    same masks at the same local positions, and the mask check fails."""
    ranks = pool.run(jobs_dropout.masks, 0.5, (0, 0, 1), P, mutation="no_fork")
    with pytest.raises(AssertionError, match="ranks' masks agree on 1.000"):
        check_masks(ranks)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_exact_with_the_masks_drawn(pool, checkpointing):
    """Dropout on (p=0.3, embedding/residual/MLP): the CP step equals the model without CP run with the masks
    the CP ranks drew; with gradient checkpointing the recomputation replays the forked state."""
    for r in pool.run(jobs_dropout.dropout_exact, 0.3, P, checkpointing=checkpointing):
        assert not r["missing"], r
        assert r["loss"] <= TOL and r["logits"] <= TOL and r["grad"] <= TOL, r


def test_mutation_recomputation_without_rng_state_is_detected(pool):
    """Mutation: checkpoint recomputation without the stashed random state (preserve_rng_state=False) draws new
    masks in backward; the gradients no longer match the forward's masks."""
    results = pool.run(jobs_dropout.dropout_exact, 0.3, P, checkpointing=True, preserve_rng_state=False)
    assert any(r["grad"] > 1e-2 for r in results), results


def test_default_gpt2_trains_under_ulysses_and_ring_refuses_attention_dropout(pool):
    """gpt2's default config (attention dropout 0.1 too) trains under Ulysses: each rank draws attention dropout
    for whole rows of its own heads. Ring cannot apply attention-probability dropout exactly: it refuses at the
    first training forward."""
    import math

    from ringmaster_tools.pool import RankError

    assert all(math.isfinite(x) for x in pool.run(jobs_dropout.default_step, "gpt2", "ulysses", P))
    with pytest.raises(RankError, match="ring attention is exact only without attention dropout"):
        pool.run(jobs_dropout.default_step, "gpt2", "ring", P)
