"""The MoE router loss under CP (output_router_logits=True): the balancing statistics summed over the CP group
(ringmaster/sharding/router.py), so the loss, the reported aux_loss and every gradient, the routers' included, are
the model's without CP; what is not recognised is refused naming the function.

Each parity case: the tiny model with router_aux_loss_coef=0.5, the group mean of the rank losses and aux_loss
against the model without CP, every parameter's gradient against its own norm (fp32)."""

import jobs_router
import pytest

TOL = 1e-4


def check(results, router=True):
    for r in results:
        assert not r["missing"], r["missing"]
        assert r["aux"] > 0, r
        assert r["loss_err"] < TOL and r["aux_err"] < TOL, r
        assert r["grad_err"] < TOL, (r["worst"], r["grad_err"])
        if router:
            assert r["n_router"] > 0 and r["router_grad_err"] < TOL, r


# every router style of transformers' causal LMs that computes a router loss: softmax top-k (mixtral, qwen3_moe,
# olmoe), shared experts (qwen2_moe), gpt_oss's router, and the hybrids (gated DeltaNet, Mamba1, Mamba2 layers)
FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "qwen3_next", "jamba", "granitemoehybrid"]


HYBRIDS = ("qwen3_next", "jamba", "granitemoehybrid")   # per parameter in fp64 (recurrent layers)


@pytest.mark.parametrize("P, backend", [(2, "ulysses"), (4, "ring")])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_router_loss_exact(pool, model_type, P, backend):
    check(pool.run(jobs_router.router_parity, model_type, P, backend, fp64=model_type in HYBRIDS))


@pytest.mark.parametrize("model_type, P, backend, kind, extra", [
    ("mixtral", 4, "ulysses", "dense", {}),
    ("qwen3_moe", 4, "usp", "packed", {"cfg_kwargs": dict(ulysses_size=2, ring_size=2)}),
    ("qwen3_moe", 2, "ring", "packed", {}),                            # position_ids restarting per document
    ("qwen3_moe", 2, "ulysses", "padded", {}),                         # B=2, the padding mask weights the tokens
    ("qwen3_moe", 2, "ulysses", "packed", {"load_balance": "documents"}),   # uneven token counts per rank
    ("qwen3_moe", 2, "ring", "dense", {"rows": 2, "steps": 2, "checkpointing": True}),   # B=2, accumulation
], ids=["mixtral-ulysses-4", "usp-2x2-packed", "packed-ring", "padded-ulysses", "documents", "accumulate-ckpt"])
def test_router_loss_exact_layouts(pool, model_type, P, backend, kind, extra):
    check(pool.run(jobs_router.router_parity, model_type, P, backend, kind, **extra))


def test_mutation_router_statistics_not_summed_over_the_group(pool):
    """Each rank's statistics alone (the group reduction skipped): the aux_loss and the router gradients move."""
    results = pool.run(jobs_router.router_parity, "qwen3_moe", 2, "ulysses", mutate="local")
    assert max(r["aux_err"] for r in results) > 1e-2 or max(r["router_grad_err"] for r in results) > 1e-2, results


def test_flag_without_a_router_loss_is_not_refused(pool):
    """llama4 carries output_router_logits but computes no router loss from it: nothing to refuse."""
    from ringmaster_tools.parity import tiny_model  # noqa: F401  (the job builds it)

    results = pool.run(jobs_router.flag_only, "llama4_text", 2)
    assert all(r is None for r in results), results


@pytest.mark.parametrize("flag", [True, False])
def test_unknown_router_loss_refused(pool, flag):
    wire_error, call_error = pool.run(jobs_router.unknown_router_loss, 2, flag)[0]
    if flag:
        assert wire_error is not None and wire_error[0] == "UnsupportedLayerError", wire_error
        assert "config.output_router_logits=True" in wire_error[1] and "_own_formula" not in wire_error[1] \
            and "load_balancing_loss_func" in wire_error[1] and "output_router_logits=False" in wire_error[1], wire_error
    else:
        assert wire_error is None, wire_error
        assert call_error is not None and "output_router_logits=True was passed" in call_error[1], call_error


def test_styles_recognise_transformers_router_losses():
    """Every modeling module of transformers that defines load_balancing_loss_func is recognised (switch: the 31
    MoE causal LMs of 5.24, 26 with a ForCausalLM class; product_keys: doge); a function of another formula is not."""
    import importlib
    import os
    import pkgutil

    import transformers.models as tm

    from ringmaster.sharding.router import recognise

    found = {}
    for info in pkgutil.iter_modules(tm.__path__):
        name = f"transformers.models.{info.name}.modeling_{info.name}"
        path = os.path.join(tm.__path__[0], info.name, f"modeling_{info.name}.py")
        if not os.path.exists(path) or "def load_balancing_loss_func" not in open(path).read():
            continue
        try:
            module = importlib.import_module(name)
        except Exception:   # an optional dependency missing: not a module this check can read
            continue
        fn = getattr(module, "load_balancing_loss_func", None)
        if fn is not None and fn.__module__ == name and any(n.endswith("ForCausalLM") for n in vars(module)):
            style = recognise(fn)
            found[info.name] = style.name if style else None
    assert found.get("mixtral") == "switch" and found.get("qwen3_next") == "switch", found
    assert found.get("doge") == "product_keys", found
    assert len(found) >= 25 and all(found.values()), {k: v for k, v in found.items() if not v}
    assert recognise(jobs_router._own_formula) is None


# the trainers run the model's own forward, which adds router_aux_loss_coef * aux_loss (0.5 here)
def test_cpsfttrainer_router_loss(pool):
    """CPSFTTrainer's chunked head adds the router loss (three steps against trl's SFTTrainer without CP, whose fused
    head adds it); trl's own head (cp_loss='trl') would compute it per shard and is refused."""
    pytest.importorskip("trl", reason="trl is not installed (pip install trl)")
    import jobs_adapters

    results = pool.run(jobs_adapters.sft_steps, 2, "qwen3_moe", "chunked_nll", overrides=jobs_router.router_on("qwen3_moe"))
    for rank, r in enumerate(results):
        # weights after three AdamW steps: Adam divides each gradient by its own running norm, so the fp32 rounding
        # of the router's small gradients reaches the weights at ~1e-4 (measured 1.3e-4; without the router term
        # the loss is 45% off and the weights 55%)
        assert r["weights_moved"] > 1e-3 and r["loss_err"] <= TOL and r["weight_err"] <= 5 * TOL, (rank, r)
    with pytest.raises(Exception, match="cp_loss='chunked_nll'"):
        pool.run(jobs_adapters.sft_steps, 2, "qwen3_moe", "trl", steps=1, overrides=jobs_router.router_on("qwen3_moe"))


def test_accelerate_fsdp2_dp_x_cp_router_loss(pool):
    import jobs_adapters

    for rank, r in enumerate(pool.run(jobs_adapters.fsdp2_dp_cp, "qwen3_moe", "sdpa", jobs_router.router_on("qwen3_moe"), {})):
        assert r["sharded_grads"] > 0 and r["loss_err"] <= TOL, (rank, r)
        assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"])


def test_axolotl_plugin_router_loss(pool):
    import jobs_adapters
    from test_adapters_axolotl import _axolotl_missing, check

    if _axolotl_missing() is not None:
        pytest.skip(str(_axolotl_missing()))
    check(pool.run(jobs_adapters.axolotl_plugin_step, 2, "qwen3_moe", True, jobs_router.router_on("qwen3_moe"), True), 2)
