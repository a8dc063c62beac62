"""axolotl 0.21's built-in context_parallel plugin runs unchanged on ringmaster, and our own entry point.

The plugin is the real one from the installed ``axolotl==0.21.0`` (installed with ``--no-deps``
plus the few modules its imports need: peft, addict, trl, accelerate; see .ci/run). Nothing of it
is stubbed: the test drives ``pre_model_load`` / ``post_trainer_create`` / ``post_train_unload``
on a real HF ``Trainer`` and takes one ``training_step`` through it.
"""

import importlib.util

import jobs_adapters
import pytest

TOL = 1e-4
# hybrids in fp32: the loss and the whole gradient (all parameters concatenated) <= 2e-4 (measured
# 2.4e-7). Per parameter (each against its own norm) fp32 says nothing about the decay path: the
# A_log / dt_bias gradients of layer 2 cancel by ~1e5 and read 1.3e-2 in fp32 (in_proj_a 4e-3), so
# every parameter is checked in a second, fp64 step (keep_fp64): <= 1e-5, measured 7.2e-11 (A_log).
HYBRID_TOTAL_TOL, HYBRID_FP64_PARAM_TOL = 2e-4, 1e-5


def _axolotl_missing() -> str | None:
    if importlib.util.find_spec("axolotl") is None:
        return "axolotl is not installed (pip install --no-deps --ignore-requires-python axolotl==0.21.0)"
    try:
        import axolotl.integrations.context_parallel.plugin  # noqa: F401
    except ImportError as exc:
        return f"axolotl's context_parallel plugin cannot be imported here: {exc}"
    return None


needs_axolotl = pytest.mark.skipif(_axolotl_missing() is not None, reason=str(_axolotl_missing()))


def check(results, P, hybrid=False):
    for rank, r in enumerate(results):
        assert r["attn"].startswith("ringmaster"), r
        assert r["num_items"] == pytest.approx(r["num_items_expected"]), (rank, r)
        assert not r["missing"], r["missing"]
        assert r["loss_err"] <= TOL, (rank, r)
        if hybrid:
            assert r["grad_err_total"] <= HYBRID_TOTAL_TOL, (rank, r["grad_err_total"])
        else:
            assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"], r["grad_err_total"])
        # post_train_unload restores the model, the collator and the trainer
        assert r["restored_attn"] == "sdpa", r
        assert r["hooks_left"] == 0, r
        assert r["collator_restored"] and r["trainer_restored"] and r["runtime_dropped"], r
        assert r["unload_logits_err"] == 0.0, r


@needs_axolotl
@pytest.mark.parametrize("P", [2, 4])
def test_axolotl_plugin_collator_sharding(pool, P):
    """shard_in_collator (the plugin's default): collator_shard_fn -> shard_collated_batch, their _num_items."""
    results = pool.run(jobs_adapters.axolotl_plugin_step, P, "llama", True)
    assert all(r["collator_shards"] and r["presharded"] for r in results)
    check(results, P)


@needs_axolotl
def test_axolotl_plugin_prehook_sharding(pool):
    """shard_in_collator: false -> their TrainerContextParallelContextManager pre-hook cuts the full batch."""
    results = pool.run(jobs_adapters.axolotl_plugin_step, 2, "llama", False)
    assert not any(r["presharded"] for r in results)
    check(results, 2)


@needs_axolotl
def test_axolotl_plugin_hybrid_qwen3_5(pool):
    """A gated-DeltaNet hybrid through the plugin's recurrent_plan / wire_recurrent_layers path."""
    results = pool.run(jobs_adapters.axolotl_plugin_step, 2, "qwen3_5_text", True)
    check(results, 2, hybrid=True)
    check_fp64(pool.run(jobs_adapters.fp64_step, jobs_adapters.axolotl_plugin_step, 2, "qwen3_5_text", True))


def check_fp64(results):
    """The same plugin step in float64 under keep_fp64: every parameter, A_log / dt_bias included."""
    for rank, r in enumerate(results):
        assert not r["missing"] and r["loss_err"] <= 1e-10, (rank, r["missing"], r["loss_err"])
        assert any(k.endswith("A_log") for k in r["grad_errs"]), sorted(r["grad_errs"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > HYBRID_FP64_PARAM_TOL}
        assert not worst, (rank, worst)


# -- ringmaster's own entry point (ringmaster.adapters.axolotl) ------------------------------

EXAMPLES = ["axolotl_llama.yaml", "axolotl_qwen3_5.yaml", "axolotl_nemotron_h.yaml"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_yaml_validates(name):
    """Every example loads, names our plugin, and its `ringmaster:` block becomes a RingmasterConfig."""
    import os

    import yaml

    from ringmaster.adapters.axolotl import RingmasterArgs, RingmasterPlugin, ringmaster_config, settings_of

    path = os.path.join(os.path.dirname(__file__), "..", "examples", name)
    with open(path) as f:
        data = yaml.safe_load(f)
    assert "ringmaster.adapters.axolotl.RingmasterPlugin" in data["plugins"]
    args = RingmasterArgs.model_validate(data)  # extra axolotl keys are ignored by our partial schema
    cfg = ringmaster_config(settings_of(args))
    assert cfg.size == data["ringmaster"]["size"] == data["context_parallel_size"]
    assert RingmasterPlugin().get_input_args() == "ringmaster.adapters.axolotl.RingmasterArgs"


def test_ringmaster_args_schema_errors():
    from pydantic import ValidationError

    from ringmaster.adapters.axolotl import RingmasterArgs

    with pytest.raises(ValidationError, match="conflicts with context_parallel_size"):
        RingmasterArgs.model_validate({"ringmaster": {"size": 4}, "context_parallel_size": 2})
    with pytest.raises(ValidationError, match="must divide"):
        RingmasterArgs.model_validate({"ringmaster": {"size": 4, "ulysses_size": 3}})
    with pytest.raises(ValidationError):
        RingmasterArgs.model_validate({"ringmaster": {"size": 2, "backend": "magic"}})
    assert RingmasterArgs.model_validate({"ringmaster": {}, "context_parallel_size": 2}).ringmaster.size == 2


@needs_axolotl
def test_ringmaster_args_merge_into_axolotl_schema():
    """axolotl merges plugin args by subclassing its input config with ours (integrations.config)."""
    from axolotl.utils.schemas.config import AxolotlInputConfig

    from ringmaster.adapters.axolotl import RingmasterArgs

    merged = type("Merged", (AxolotlInputConfig, RingmasterArgs), {})
    assert "ringmaster" in merged.model_fields


@needs_axolotl
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_ringmaster_plugin_trainer_step(pool, model_type):
    results = pool.run(jobs_adapters.axolotl_plugin_step, 2, model_type, True, None, True)
    assert not any(r["presharded"] for r in results)
    check(results, 2, hybrid=model_type != "llama")
    if model_type != "llama":
        check_fp64(pool.run(jobs_adapters.fp64_step, jobs_adapters.axolotl_plugin_step, 2, model_type, True,
                            ours=True))


@needs_axolotl
@pytest.mark.parametrize("ours", [True, False], ids=["ringmaster_plugin", "axolotl_builtin_plugin"])
def test_plugin_wires_a_separate_ref_model(pool, ours):
    """A trainer's ref_model is sharded like the policy: its attention must be CP attention too (its
    loss on the sharded batch equals the single-device loss), and unloading unwires it."""
    results = pool.run(jobs_adapters.axolotl_plugin_step, 2, "llama", True, None, ours, True)
    for r in results:
        assert r["ref_wired"] and r["ref_unwired"], r
        assert r["ref_loss_err"] <= 1e-4, r


# -- Ring and USP through axolotl's unchanged plugin ---------------------------------------------
# Every rotation and load balance axolotl 0.21's own settings (context_parallel/settings.py
# resolve_settings) allow with the CPU kernels: sdpa models get allgather + none only (its P2P
# schedules require flash_attention_2); flash_attention_2 (the CPU flash stand-in) gets p2p and
# allgather, none and head_tail. The plugin refuses Ring/USP when resolve_ring_impl answers
# TORCH_NATIVE; AUTO (and an explicit torch_native) now resolve to ATEN, which trains.

FA2 = "flash_attention_2"
GQA = dict(num_attention_heads=8, num_key_value_heads=2)
RING_CASES = [
    # id, P, attn, context_parallel block, (ring_impl, layout, rotate) ringmaster binds
    ("ring-sdpa-allgather", 2, "sdpa", dict(backend="ring"), ("aten", "contiguous", "allgather")),
    ("ring-sdpa-explicit-torch_native", 2, "sdpa", dict(backend="ring", ring_impl="torch_native"),
     ("aten", "contiguous", "allgather")),
    ("usp-sdpa-allgather", 4, "sdpa", dict(backend="usp", ulysses_size=2, ring_size=2),
     ("aten", "contiguous", "allgather")),
    ("ring-fa2-allgather-none", 2, FA2, dict(backend="ring", rotate_method="allgather", load_balance="none"),
     ("hf_kernels", "contiguous", "allgather")),
    ("ring-fa2-p2p-none", 2, FA2, dict(backend="ring", rotate_method="alltoall", load_balance="none"),
     ("hf_kernels", "contiguous", "alltoall")),
    ("ring-fa2-head_tail", 2, FA2, dict(backend="ring", load_balance="head_tail"),
     ("hf_kernels", "head_tail", "allgather")),
    ("ring-fa2-auto-balance", 2, FA2, dict(backend="ring"), ("hf_kernels", "head_tail", "allgather")),
    ("usp-fa2-allgather", 4, FA2, dict(backend="usp", ulysses_size=2, ring_size=2, rotate_method="allgather"),
     ("hf_kernels", "contiguous", "allgather")),
    ("usp-fa2-p2p", 4, FA2, dict(backend="usp", ulysses_size=2, ring_size=2, rotate_method="alltoall"),
     ("hf_kernels", "contiguous", "alltoall")),
]


@needs_axolotl
@pytest.mark.parametrize("case", RING_CASES, ids=[c[0] for c in RING_CASES])
def test_axolotl_plugin_trains_ring_and_usp(pool, case):
    """One Trainer step through axolotl's unchanged plugin, exact against the model without CP."""
    _, P, attn, cp, (impl, layout, rotate) = case
    results = pool.run(jobs_adapters.axolotl_plugin_step, P, "llama", True, GQA, False, False, cp, attn)
    for r in results:
        assert (r["backend"], r["ring_impl"], r["layout"], r["rotate"]) == (cp["backend"], impl, layout, rotate), r
    check(results, P)


DISTFLASH_CASES = [
    # id, P, model, hybrid: axolotl refuses head_tail for packed rows and recurrent layers, not distflash
    ("llama-P2", 2, "llama", False),
    ("llama-P4", 4, "llama", False),
    ("qwen3_5-hybrid-P2", 2, "qwen3_5_text", True),
]


@needs_axolotl
@pytest.mark.parametrize("case", DISTFLASH_CASES, ids=[c[0] for c in DISTFLASH_CASES])
def test_axolotl_plugin_trains_ring_distflash(pool, case):
    """``load_balance: distflash`` through the unchanged plugin. axolotl's settings allow it for
    flash_attention_2 only (a balance owns a P2P schedule, which needs flash), so: the stand-in.
    The plugin passes its default rotate_method (allgather); the schedule does not consult it, and
    batches are cut contiguously (what its collator and manager shard with)."""
    _, P, model_type, hybrid = case
    results = pool.run(jobs_adapters.axolotl_plugin_step, P, model_type, True, GQA if model_type == "llama" else None,
                       False, False, dict(backend="ring", load_balance="distflash"), FA2)
    for r in results:
        assert (r["backend"], r["ring_impl"], r["layout"], r["schedule"]) == (
            "ring", "hf_kernels", "contiguous", "distflash"), r
        assert r["collator_shards"] and r["presharded"], r
    check(results, P, hybrid=hybrid)


def test_settings_take_every_recurrent_strategy():
    """The plugin's ``ringmaster:`` block takes every ``RingmasterConfig.recurrent`` value (``fla_cp`` and ``heads``
    were refused by its schema before) and refuses others, naming them."""
    import pytest

    pytest.importorskip("pydantic")
    from ringmaster.adapters.axolotl import RingmasterSettings
    from ringmaster.config import RECURRENT_CHOICES

    for value in RECURRENT_CHOICES:
        assert RingmasterSettings(recurrent=value).recurrent == value
    with pytest.raises(ValueError, match="heads"):
        RingmasterSettings(recurrent="headwise")
