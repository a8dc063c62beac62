"""Zoo families that were refused for a mechanism ringmaster lacked, now exact (or refused precisely):

- the head split read from each attention layer (architectures/heads.py): jetmoe (KV tiled top_k
  times), laguna (heads per layer), mimo_v2_flash (more KV heads on sliding layers), gpt_bigcode
  (multi-query), deepseek_v4 (one shared KV head; its compressors are refused);
- repeated CP attention calls per module (attention/accounting.py): diffllama (two calls per layer),
  hrm_text (the same layers run every H/L cycle);
- the batch bridge (attention/bridge.py): stablelm, nemotron (decoder layers that drop **kwargs);
- towers derived for a multimodal model of a registered text family (architectures/towers.py):
  gemma3 (SigLIP), moss_transcribe_diarize (audio encoder);
- doge refused (its dynamic mask is built from the shard's own states).

Parity is the zoo's (ringmaster_tools.zoo): loss, gathered logits and every parameter gradient
against the same model without CP, float64, tolerance 1e-6. P=2 runs on a (2, 2) mesh, P=4 on (1, 4).
"""

import jobs_misc_families as jobs
import pytest

P2 = (("ulysses", 2), ("ring", 2))
P4 = (("ulysses", 4), ("ring", 4))


def exact(verdicts, n):
    assert len(verdicts) == n, verdicts
    for case, v in verdicts.items():
        assert v["verdict"] == "exact", (case, v)


@pytest.mark.parametrize("family", ["jetmoe", "laguna", "deepseek_v4", "hrm_text", "nemotron", "gemma3"])
def test_family_exact_p2(pool, family):
    exact(pool.run(jobs.parity, family, P2)[0], 2)


# gpt_bigcode: one KV head (multi_query) for four query heads, which Ulysses replicates to every rank
@pytest.mark.parametrize("family", ["mimo_v2_flash", "gpt_bigcode", "diffllama", "stablelm", "moss_transcribe_diarize"])
def test_family_exact_p2_p4(pool, family):
    exact(pool.run(jobs.parity, family, P2 + P4)[0], 4)


# ---- the head split of each layer
def test_head_split_read_from_each_layer():
    from ringmaster.architectures.heads import head_splits
    from ringmaster_tools import zoo

    expect = {"gpt_bigcode": {(4, 1)}, "jetmoe": {(4, 4)}, "laguna": {(48, 2)}, "mimo_v2_flash": {(4, 2), (4, 4)},
              "deepseek_v4": {(4, 1)}}
    for family, splits in expect.items():
        model = zoo.build_tiny(family, jobs.config_for(family))
        paths = [p for p, m in model.named_modules() if hasattr(m, "num_key_value_groups")]
        got = head_splits(model, paths, model.config)
        assert set(got.values()) == splits, (family, got)
    mimo = zoo.build_tiny("mimo_v2_flash", jobs.config_for("mimo_v2_flash"))
    assert head_splits(mimo, ["model.layers.1.self_attn"], mimo.config) == {"model.layers.1.self_attn": (4, 4)}


def test_head_split_refused_at_wire_naming_the_layer(pool):
    """Mutation target: heads.py. Laguna's layer 0 has 6 query heads (config.num_attention_heads says 4):
    Ulysses at P=4 must refuse at wire time, naming that layer; read from the config, wire would accept
    and the first forward would fail instead."""
    err = pool.run(jobs.wire_error, "laguna", 4, "ulysses", dict(num_attention_heads_per_layer=[6, 4]))[0]
    assert err is not None and err[0] == "ValueError", err
    assert "query heads (6)" in err[1] and "'model.layers.0.self_attn'" in err[1], err


# ---- repeated calls
def test_repeated_calls_counted(pool):
    kind, msg, repeated = pool.run(jobs.repeated_calls, "diffllama")[0]
    assert kind is None, msg
    assert repeated == {"model.layers.0.self_attn": 2, "model.layers.1.self_attn": 2}, repeated


# ---- the batch bridge
def test_drops_kwargs_read_from_the_source():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.stablelm.modeling_stablelm import StableLmDecoderLayer

    from ringmaster.attention.bridge import drops_kwargs

    assert drops_kwargs(StableLmDecoderLayer, "self_attn")
    assert not drops_kwargs(LlamaDecoderLayer, "self_attn")
    assert not drops_kwargs(StableLmDecoderLayer, "mlp_not_called")


def test_bridge_installed_and_removed(pool):
    bridged, left = pool.run(jobs.bridged_report, "stablelm")[0]
    assert bridged == ["model.layers.0.self_attn", "model.layers.1.self_attn"], bridged
    assert left == 0, "rm.unwire left hooks behind"


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_without_bridge_the_accounting_trips(pool, backend):
    """Mutation: no bridge, so stablelm's attention never gets ringmaster_batch; the first CP forward raises
    naming the module and **kwargs, before any backward."""
    kind, msg, loss = pool.run(jobs.without_bridge, "stablelm", 2, backend)[0]
    assert loss is None and kind == "RuntimeError", (kind, msg)
    assert "'model.layers.0.self_attn'" in msg and "**kwargs" in msg, msg


def test_bridge_under_gradient_checkpointing(pool):
    exact(pool.run(jobs.checkpointed_parity, "stablelm", P2)[0], 2)


# ---- towers
def test_tower_spec_derived():
    import ringmaster as rm
    from ringmaster_tools import zoo

    for family, towers in [("gemma3", ("model.vision_tower", "model.multi_modal_projector")),
                           ("moss_transcribe_diarize", ("model.audio_tower", "model.multi_modal_projector"))]:
        spec = rm.get_architecture(zoo.build_tiny(family, jobs.config_for(family)))
        assert spec.language_model == "model.language_model" and spec.vision_modules == towers, spec


@pytest.mark.parametrize("family", ["gemma3", "moss_transcribe_diarize"])
def test_tower_batch_exact(pool, family):
    """An image / audio clip encoded by the tower on every rank, its 4 tokens straddling a P=4 shard edge:
    exact, the tower's gradients included."""
    exact(pool.run(jobs.tower_parity, family, P2 + P4)[0], 4)


def test_gemma3_bidirectional_image_span_refused(pool):
    verdicts = pool.run(jobs.tower_parity, "gemma3", P2, True)[0]
    for case, v in verdicts.items():
        assert v["verdict"] == "refused" and "bidirectional image spans" in v["reason"], (case, v)


def test_tower_running_after_the_text_model_refused(pool):
    """Mutation target: multimodal.TowerOrder. A module declared as a tower that runs on the language
    model's (sharded) output raises in the forward, naming it."""
    kind, msg, loss = pool.run(jobs.tower_after_text)[0]
    assert loss is None and kind == "UnsupportedLayerError", (kind, msg)
    assert "'lm_head'" in msg and "ran after the language model" in msg, msg


# ---- refusals
def test_deepseek_v4_compressor_refused(pool):
    err = pool.run(jobs.wire_error, "deepseek_v4", 2, "ulysses",
                   dict(layer_types=["sliding_attention", "compressed_sparse_attention", "sliding_attention"]))[0]
    assert err is not None and err[0] == "UnsupportedLayerError", err
    assert "'model.layers.1.self_attn.compressor'" in err[1] and "DeepseekV4CSACompressor" in err[1], err


def test_doge_refused(pool):
    err = pool.run(jobs.wire_error, "doge")[0]
    assert err is not None and err[0] == "UnsupportedLayerError", err
    assert "'doge' is refused" in err[1] and "DogeAttention" in err[1], err
