"""One CP context per wired model: every runtime's attention and recurrent layers are bound at
setup/wire time; the per-step layout and documents come only from the batch kwarg.

These are the checks that failed before the binding existed (second ``wire`` re-pointing the
first model, a trainer-built manager cutting contiguous for a head_tail Ring model, a
reference model sharded but never wired, ``wire`` refusing the HF default ``use_cache=True``,
``wire`` rolling back only part of what it did)."""

import jobs_binding as jb
import pytest

TOL = 1e-4            # loss and gathered logits, relative
TOTAL_TOL = 1e-4      # whole gradient, relative max-norm
WRONG = 1e-2          # a mutation must be far beyond the tolerance


def _exact(r):
    assert not r.get("error"), r
    assert not r["missing"], r["missing"]
    assert r["loss_err"] <= TOL, r
    assert r["logits_err"] <= TOL, r
    assert r["grad_err_total"] <= TOTAL_TOL, r


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("pair", ["ring_contiguous+ring_head_tail", "ulysses+ring", "ring_allgather+usp"])
def test_two_wired_models_alternating_are_both_exact(pool, P, pair):
    cfgs = {
        "ring_contiguous+ring_head_tail": [dict(backend="ring", load_balance="none"),
                                           dict(backend="ring", load_balance="head_tail")],
        "ulysses+ring": [dict(backend="ulysses"), dict(backend="ring")],
        "ring_allgather+usp": [dict(backend="ring", rotate_method="allgather"),
                               dict(backend="usp", ulysses_size=2) if P == 4 else dict(backend="ulysses")],
    }[pair]
    for rank, results in enumerate(pool.run(jb.two_models, P, cfgs)):
        assert len(results) == 2
        assert results[0]["attn"] != results[1]["attn"], "each runtime registers its own attention name"
        for r in results:
            _exact(r)


def test_two_models_on_two_cp_groups_are_both_exact(pool):
    """A Ring model over CP groups of 2 and a Ulysses model over the CP group of 4, in one process."""
    cfgs = [dict(backend="ring", P=2), dict(backend="ulysses", P=4)]
    for results in pool.run(jb.two_models, 2, cfgs):
        assert [r["backend"] for r in results] == ["ring", "ulysses"]
        for r in results:
            _exact(r)


@pytest.mark.parametrize("load_balance", ["unset", None, "none", "contiguous", "head_tail", "auto", "distflash"])
@pytest.mark.parametrize("P", [2, 4])
def test_manager_with_every_layout_and_ring_auto_is_exact(pool, P, load_balance):
    """Built the way a trainer builds it (no load_balance, or any given one) around a Ring-AUTO model."""
    for r in pool.run(jb.manager_layout, P, load_balance):
        _exact(r)
        assert r["backend"] == "ring" and r["layout"] == "head_tail", r
        expected = "head_tail" if load_balance in ("unset", None, "auto", "head_tail") else "contiguous"
        assert r["cut"] == expected, r


def test_manager_head_tail_for_ulysses_is_refused_before_any_collective(pool):
    for r in pool.run(jb.manager_layout, 2, "head_tail", "ulysses"):
        assert r.get("error") == "ValueError", r
        assert "needs contiguous" in r["message"], r


def test_wrong_layout_on_one_rank_is_caught(pool):
    """Mutation: one rank cuts head_tail, the others contiguous. The per-forward agreement check
    raises; with the check off, the parity check sees a wrong answer."""
    for r in pool.run(jb.wrong_layout_on_one_rank, 2):
        assert r.get("error") == "InputMismatchError" and "layout" in r["message"], r
    for r in pool.run(jb.wrong_layout_on_one_rank, 2, False):
        assert r.get("error") or r["logits_err"] > WRONG, r


def test_batch_cut_for_another_model_is_refused(pool):
    for result in pool.run(jb.batch_for_another_model, 2):
        assert result is not None, "a head_tail shard reached a Ulysses model"
        name, message = result
        assert name == "RuntimeError" and "'head_tail' layout" in message and "needs contiguous" in message, message


@pytest.mark.parametrize("P", [2, 4])
def test_wire_on_a_default_hf_model_in_train_mode_trains_exactly(pool, P):
    for r in pool.run(jb.default_config_trains, P):
        _exact(r)
        assert (r["before"], r["during"], r["after"]) == (True, False, True), r
        assert r["warned"], "switching use_cache off must warn"


@pytest.mark.parametrize("step", ["probe", "attention"])
def test_wire_is_atomic(pool, step):
    for r in pool.run(jb.wire_fails_midway, 2, step):
        assert r["error"] and "injected" in r["error"], r
        assert r["same"], (r["before"], r["after"])
        assert r["current_kept"], r


@pytest.mark.parametrize("mode,fragment", [("blind", "does not change the layer's output"),
                                           ("bypass", "never called")])
def test_wire_probe_fails_closed(pool, mode, fragment):
    for r in pool.run(jb.probe_outcome, mode):
        assert r["error"] and fragment in r["error"] and "'mixer'" in r["error"], r
        assert r["restored"], r


def test_wire_probe_passes_on_a_layer_that_uses_its_state(pool):
    for r in pool.run(jb.probe_outcome, "honest"):
        assert r["error"] is None and r["wired"] and r["restored"], r


def test_kernel_names_come_from_the_family_spec(pool):
    """A layer calling its scan kernel under another name: refused unless its family spec declares
    the name (ArchitectureSpec.recurrent_kernels), then wired and probed through it."""
    for r in pool.run(jb.probe_outcome, "renamed"):
        assert r["error"] and "never called ['torch_chunk_gated_delta_rule']" in r["error"], r
    for r in pool.run(jb.probe_outcome, "renamed", True):
        assert r["error"] is None and r["wired"] and r["restored"], r


@pytest.mark.parametrize("model_type,fragment", [("opt", "absolute position table"),
                                                 ("stablelm", "without **kwargs"),
                                                 ("nemotron_h", "not wired for CP"),
                                                 ("falcon", "computes attention itself")])
def test_setup_path_refuses_what_only_wire_installs(pool, model_type, fragment):
    """rm.setup + set_attn_implementation swaps the attention kernel only: OPT's mask-counted position
    table, stablelm's kwargs-dropping decoder layer and an unwired Mamba2 mixer are refused at the
    first sharded forward (without the check OPT's padded rows train silently wrong)."""
    for r in pool.run(jb.setup_path, model_type, True):
        assert fragment in r.get("refused", ""), r
        assert "rm.wire(model, cfg)" in r["refused"], r


def test_setup_path_trains_a_model_that_needs_only_attention(pool):
    for r in pool.run(jb.setup_path, "llama"):
        _exact(r)


def test_setup_path_without_the_check_trains_opt_wrong(pool):
    """The mutation: with the low-level-path check removed, OPT's padded rows run (nothing raises) and
    the gradient is far from the single-device one."""
    for r in pool.run(jb.setup_path, "opt", True, False):
        assert "refused" not in r, r
        assert r["grad_err_total"] > WRONG, r
