"""Modules no registry knows are shown per-token on the first CP forward, or refused on every rank.

Each case edits a tiny Llama the way user code and ``trust_remote_code`` repositories do (issue 27's table)
and runs it under CP against the same model without CP (``ringmaster_tools.parity.compare``). Before the
probe (:mod:`ringmaster.architectures.mixing`) every one of them trained silently wrong; now each is refused
on every rank, before any gradient, naming the module, and the unedited model stays exact.
"""

import jobs_token_mixing
import pytest

REFUSED = [
    ("running_mean_mlp", "model.layers.0.mlp"),          # x.cumsum(1) / arange around an MLP
    ("sequence_centred_norm", "model.norm"),              # the final norm after subtracting the sequence mean
    ("local_positions", "model.embed_tokens"),            # sinusoidal positions from the local length
    ("remote_sdpa", "model.layers.1.self_attn"),          # fused wqkv, local rotary, F.sdpa(is_causal=True)
    ("remote_alibi", "model.layers.1.self_attn"),         # softmax(QK^T + ALiBi) computed in the module
]


@pytest.mark.parametrize("case, path", REFUSED)
def test_token_mixing_module_is_refused_on_every_rank_before_backward(pool, case, path):
    for r in pool.run(jobs_token_mixing.llama_case, case):
        assert r["refused"] is not None, r
        assert "token-mixing probe" in r["refused"] and repr(path) in r["refused"], r["refused"]
        assert r["grads"] == 0, r   # raised before backward


def test_remote_attention_in_every_layer_is_refused(pool):
    for r in pool.run(jobs_token_mixing.llama_case, "remote_sdpa_everywhere"):
        assert r["refused"] is not None and r["grads"] == 0, r


def test_unedited_model_is_exact_and_the_probe_reports(pool):
    for r in pool.run(jobs_token_mixing.llama_case, "plain"):
        assert r["refused"] is None and r["loss"] < 1e-5 and r["logits"] < 1e-5 and r["grad"] < 1e-5, r
    for r in pool.run(jobs_token_mixing.probe_report):
        assert r["before"] is None and "shown per-token" in r["after"] and "token-mixing probe" in r["text"], r


def test_mutation_without_the_probe_the_running_mean_trains_wrong(pool):
    """Mutation: the probe sees no module. The edited model is not refused and its CP gradients are wrong,
    so the refusal test above fails."""
    for r in pool.run(jobs_token_mixing.llama_case, "running_mean_mlp", probe=False):
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
