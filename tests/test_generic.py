"""The generic path: unregistered decoder families wire without a spec and are exact, or are refused
naming the layer; the first-forward accounting catches what wiring cannot see (mutations).

Every parity case compares loss, gathered logits and every parameter's gradient (each against its
own norm) with the same model without CP (ringmaster_tools.parity.compare) at P=2.
"""

import jobs_generic
import pytest

TOL = 1e-4

# unregistered families (the registry has none of them) that the generic path accepts
GENERIC = ["phi3", "olmo2", "granite", "glm4", "smollm3", "mixtral"]


def check(results):
    for r in results:
        assert r["attention_layers"] == 2
        assert r["n_grads"] == r["n_params"], "every parameter must get a gradient to compare"
        assert r["loss_err"] < TOL and r["logits_err"] < TOL, r
        assert r["grad_err"] < TOL, (r["worst_param"], r["grad_err"])


def test_generic_families_are_unregistered():
    import ringmaster as rm
    from ringmaster.architectures import registered_architecture
    from ringmaster_tools.parity import tiny_model

    for mt in GENERIC:
        model = tiny_model(mt, **jobs_generic.overrides_for(mt))
        assert registered_architecture(model) is None, mt
        spec = rm.get_architecture(model)
        assert spec.name == f"{mt} (generic)" and spec.attention_classes, spec


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
@pytest.mark.parametrize("model_type", GENERIC)
def test_generic_family_exact(pool, model_type, backend):
    check(pool.run(jobs_generic.parity, model_type, 2, backend))


# learned absolute position tables (gpt2, opt, biogpt, the BERT/RoBERTa decoders) are exact under CP now, or
# refused naming the table when the wire-time probe cannot number them: tests/test_position_embeddings.py


# the MoE router loss (output_router_logits=True) is exact or refused: tests/test_router_loss.py


def test_spec_refusal(pool):
    refused, restored = pool.run(jobs_generic.refused_spec)[0]
    assert refused is not None and refused[0] == "UnsupportedLayerError", refused
    assert "'olmo2' is refused" in refused[1] and "reason naming the feature" in refused[1], refused
    assert restored is None, restored


def test_attention_bypassing_the_interface_refused(pool):
    """A layer named like attention with projections that never reads ALL_ATTENTION_FUNCTIONS."""
    kind, msg = pool.run(jobs_generic.wire_error, "phi3", 2, None, _bypass)[0]
    assert kind == "UnsupportedLayerError", msg
    assert "'model.layers.1.cross_attn'" in msg and "attention interface" in msg, msg


def _bypass(model):
    import torch.nn as nn

    class HandRolledAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(4, 4)

        def forward(self, x):
            return x

    model.model.layers[1].cross_attn = HandRolledAttention()


@pytest.mark.parametrize("mutation,needle,backend", [
    ("drop_kwargs", "'model.layers.1.self_attn'", "ulysses"),   # the batch never reaches layer 1's attention
    ("drop_kwargs", "'model.layers.1.self_attn'", "ring"),
    # a second call over another length than the shard (pooled tokens); several full calls are exact
    ("pooled", "an attention call over 16 tokens, but this rank holds 32", "ulysses"),
    ("pooled", "an attention call over 16 tokens, but this rank holds 32", "ring"),
    ("never", "'model.layers.1.self_attn' never called", "ulysses"),
    ("never", "'model.layers.1.self_attn' never called", "ring"),
    ("own_mask", "'model.layers.0.self_attn' passed its own attention mask", "ulysses"),
])
def test_accounting_guard_trips_before_backward(pool, mutation, needle, backend):
    kind, msg, loss = pool.run(jobs_generic.mutated_forward, mutation, 2, "granite", backend)[0]
    assert loss is None, "the broken model's forward returned a loss: the accounting guard did not trip"
    assert kind in ("UnsupportedLayerError", "RuntimeError", "NotImplementedError"), msg
    assert needle in msg, msg


def test_accounting_disarms_after_first_forward(pool):
    armed_before, armed_after, handles, post_hooks, pre_hooks = pool.run(jobs_generic.accounting_passes_then_disarms)[0]
    assert armed_before and not armed_after and handles == 0 and post_hooks == 0 and pre_hooks == 0


def test_seed_oss_dropout_wires_and_exact_without(pool):
    """The llama-like family a naive generic path trained wrong (whole-gradient error 0.56 at P=2, every rank
    drawing the same masks): seed_oss ships residual_dropout=0.1, now run under each rank's forked random state
    (tests/test_dropout.py checks the masks), so it wires; exact with it off. A LayerDrop-like field the model
    reads still refuses (a draw shared along the sequence)."""
    assert pool.run(jobs_generic.wire_error, "seed_oss", 2, dict(residual_dropout=0.1))[0] is None
    check(pool.run(jobs_generic.parity, "seed_oss", 2, "ulysses", dict(residual_dropout=0.0)))


def test_shared_draw_refused(pool):
    """Dropout whose draw is shared along the sequence cannot be forked per rank: feature dropout is refused,
    naming the layer."""
    kind, msg = pool.run(jobs_generic.wire_error, "olmo2", 2, prepare=jobs_generic.add_feature_dropout)[0]
    assert kind == "UnsupportedLayerError" and "drops whole channels" in msg and "model.layers.0.mlp" in msg, msg


@pytest.mark.parametrize("model_type,needle", [("phimoe", "sparsemixer"), ("doge", "DogeAttention")])
def test_registered_refusals(pool, model_type, needle):
    kind, msg = pool.run(jobs_generic.wire_error, model_type)[0]
    assert kind == "UnsupportedLayerError" and f"{model_type!r} is refused" in msg and needle in msg, msg


# stablelm/nemotron (decoder layers that drop **kwargs) are bridged, diffllama (two calls per layer) is
# exact: tests/test_misc_families.py, with the mutation that takes the bridge out


def _conv(model):
    import torch.nn as nn

    model.model.layers[0].token_mixer = nn.Conv1d(64, 64, 3, padding=1, groups=64)


def test_conv_over_sequence_refused(pool):
    kind, msg = pool.run(jobs_generic.wire_error, "olmo2", 2, None, _conv)[0]
    assert kind == "UnsupportedLayerError" and "'model.layers.0.token_mixer'" in msg and "convolves" in msg, msg
