"""Token mixing outside what ringmaster routes is refused on every rank before any backward (issues 27 and 37).

Each case edits a tiny Llama the way user code and ``trust_remote_code`` repositories do. Before the check of
issue 37 (:mod:`ringmaster.architectures.mixing`), the cases of its table trained silently wrong (mixing in a
decoder layer's own forward, at lags past 16 tokens, only in training, only above 16 tokens, through a
channels-first conv, anything under ``load_balance="documents"``); now every one is refused under Ulysses,
Ring, USP and documents, naming the module (or the loss), and the unedited model stays exact.
"""

import jobs_token_mixing
import pytest

from ringmaster.architectures.mixing import LOSS_FIX

# case -> what the refusal names
EXPECTED = {
    "running_mean_mlp": "'model.layers.0.mlp'",
    "sequence_centred_norm": "'model.norm'",
    "local_positions": "'model.embed_tokens'",
    "remote_sdpa": "'model.layers.1.self_attn'",
    "remote_alibi": "'model.layers.1.self_attn'",
    "layer_running_mean": "'model.layers.0' (LlamaDecoderLayerEdited, own forward",
    "layer_shift": "'model.layers.1' (LlamaDecoderLayerEdited, own forward",
    "long_lag": "'model.layers.0.mlp'",
    "training_only": "'model.layers.0.mlp'",
    "longer_than_16": "'model.layers.0.mlp'",
    "channels_first_conv": "'model.layers.0.mlp' (ChannelsFirstConv",
    "local_scale": "'model.layers.0.mlp'",
    "first_token_state": "'model.layers.0.mlp'",
    "fft_filter": "'model.layers.0.mlp'",
    "unfold_window": "'model.layers.0.mlp'",
    "custom_function": "'model.layers.0.mlp'",
    "local_rotary": "'model.rotary_emb'",
    "attention_q_shift": "'model.layers.0.self_attn.q_proj'",
    "loss_statistic": "the loss of",
    "loss_local_mean": "the loss of",
    "loss_shifts_labels": "the loss of",
    "loss_mean_all_tokens": "the loss of",
}
# honest losses: never refused (a false alarm is a bug too), exact
HONEST = ["plain", "per_token_routing", "loss_custom_sum"]


@pytest.mark.parametrize("layout, P", [("ulysses", 2), ("ring", 2), ("documents", 2), ("usp", 4)])
def test_every_edit_is_refused_on_every_rank_before_backward(pool, layout, P):
    cases = [*HONEST, *EXPECTED]
    for ranks in [pool.run(jobs_token_mixing.refusals, cases, layout, P=P)]:
        for case in HONEST:   # the unedited model, per-token routing and an honest loss of its own run
            assert all(r[case] is None for r in ranks), [r[case] for r in ranks]
        for case, named in EXPECTED.items():
            found = [r[case] for r in ranks]
            assert all(f is not None and f["grads"] == 0 for f in found), (case, found)
            assert all("token-mixing check" in f["error"] for f in found), (case, found)
            # the rank(s) that measured it name what mixes; the others say which rank did
            assert any(named in f["error"] for f in found), (case, [f["error"][:400] for f in found])
            if case.startswith("loss_"):   # the fix names the keys the loss must use
                assert any(LOSS_FIX in f["error"] for f in found), (case, [f["error"][-600:] for f in found])


COMPILED_CASES = ["running_mean_mlp", "layer_shift", "remote_sdpa", "local_rotary"]


def test_compiled_first_step_is_checked_too(pool):
    """Blocks compiled before the first CP step, which then runs compiled: edits inside a block (the MLP, the
    layer's own code), attention outside the interface and a local rotary are still refused on every rank
    before backward (the checks record an eager replay of that step)."""
    for r in pool.run(jobs_token_mixing.refusals, COMPILED_CASES, "ulysses", 2, compiled=True):
        for case in COMPILED_CASES:
            assert r[case] is not None and r[case]["grads"] == 0, (case, r[case])


def test_unedited_model_is_exact_and_the_check_reports_each_mode(pool):
    for case, layout, P in (("plain", "ulysses", 2), ("per_token_routing", "ulysses", 2),
                            ("per_token_routing", "ring", 4)):
        for r in pool.run(jobs_token_mixing.exactness, case, layout=layout, P=P):
            assert r["refused"] is None and r["loss"] < 1e-5 and r["logits"] < 1e-5 and r["grad"] < 1e-5, (case, r)
    for r in pool.run(jobs_token_mixing.check_report):
        assert r["before"] is None and "training mode" in r["train"] and "eval mode" in r["after"], r
        assert "shown per-token at its 32-token shard" in r["after"] and "token-mixing" in r["text"], r
        assert r["disarmed"] and r["timed"] == [False, True], r   # both modes checked (and timed): no hook left


def test_honest_custom_loss_is_exact_and_mutation_without_the_loss_test_trains_wrong(pool):
    """A loss of the model's own that sums over the shard's ``shift_labels`` and divides by ``num_items_in_batch`` is
    exact (never refused). Mutation: the check without its loss test: a loss that takes a mean over the shard
    (``num_items_in_batch`` dropped, as a fused head with ``reduction="mean"`` does) is not refused, and its CP loss
    and gradients are wrong."""
    for r in pool.run(jobs_token_mixing.exactness, "loss_custom_sum"):
        assert r["refused"] is None and r["loss"] < 1e-5 and r["grad"] < 1e-5, r
    for r in pool.run(jobs_token_mixing.exactness, "loss_local_mean", mutation="no_loss"):
        assert r["refused"] is None and max(r["loss"], r["grad"]) > 1e-3, r


def test_mutation_a_module_the_check_skips_trains_wrong(pool):
    """Mutation: the check stands in for layer 0's MLP as if ringmaster routed it. The running mean it adds is
    then not refused and the CP gradients are wrong, so the refusal test above fails."""
    for r in pool.run(jobs_token_mixing.exactness, "running_mean_mlp", mutation="skip"):
        assert r["refused"] is None and r["grad"] > 1e-2, r
    for r in pool.run(jobs_token_mixing.exactness, "running_mean_mlp", layout="documents", mutation="off"):
        assert r["refused"] is None and r["grad"] > 1e-2, r


def test_attention_that_mixes_before_the_interface_is_refused_precisely():
    """xglm computes attention in the module (bmm + softmax, no attention interface); zaya convolves q/k and
    delays v inside its attention module: both refused at rm.wire's lookup, naming what mixes."""
    import ringmaster as rm
    from ringmaster.architectures.generic import refuse_if_unsafe
    from ringmaster_tools.parity import tiny_model

    xglm = tiny_model("xglm", num_layers=1)
    with pytest.raises(rm.UnsupportedLayerError, match=r"XGLMAttention.*computes it itself"):
        rm.get_architecture(xglm)
    zaya = tiny_model("zaya", num_experts_per_tok=1)
    spec = rm.get_architecture(zaya)
    with pytest.raises(rm.UnsupportedLayerError, match=r"conv_qk_depthwise.*v_proj_delayed"):
        refuse_if_unsafe(zaya, spec)


def test_generate_on_a_wired_model_says_unwire(pool):
    """Generation decodes unsharded: a wired model refuses it at once, naming rm.unwire; unwired, it generates."""
    for r in pool.run(jobs_token_mixing.generate_while_wired):
        assert r["wired"] is not None and "rm.unwire(model)" in r["wired"], r
        assert r["unwired_tokens"] == 6 and r["restored"], r


@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_a_rank_with_no_target_is_exact_not_nan(pool, layout):
    """All of a row's targets on one rank's shard (either rank): the other rank's share is 0, not NaN, and the loss
    and gradient match the model without CP."""
    for ranks in [pool.run(jobs_token_mixing.targets_on_one_rank, layout)]:
        for r in ranks:
            for half in r:
                assert half["loss"] < 1e-5 and half["grad"] < 1e-5, r   # a NaN loss fails both
