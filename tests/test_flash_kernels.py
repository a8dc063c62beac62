"""Ulysses with flash inner kernels (``flash_attention_2/3`` and hub repos), which ringmaster resolves
and calls itself: transformers' flash path would look the library up from the renamed
``config._attn_implementation``. In CI the hub kernels are ringmaster's CPU stand-in, loaded by
``kernels.get_kernel`` through LOCAL_KERNELS (tests/conftest.py); ``flash_attn`` is not installed,
so ``flash_attention_2`` resolves to the hub's flash-attn2, ``flash_attention_3`` to
vllm-flash-attn3 and ``flash_attention_4`` to flash-attn4, as transformers' own fallback does.

Each case runs against the same weights without CP (sdpa, or eager where the model needs it):
loss, gathered logits and every parameter gradient against its own norm, at P=2 and P=4.
"""

import jobs_flash
import pytest
import torch

pytest.importorskip("kernels")

from ringmaster.attention import flash_kernels  # noqa: E402

TOL = 1e-4
DETECT = 1e-2
FA2, FA3, VLLM = "kernels-community/flash-attn2", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3"
FA4 = "kernels-community/flash-attn4"
LLAMA_GQA = dict(num_attention_heads=8, num_key_value_heads=2)
MISTRAL_W = dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=16)
# a cap far below the tiny model's raw logits (|s| ~ 1e-2), so capping changes every score
GEMMA2_CAP = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                  query_pre_attn_scalar=16, attn_logit_softcapping=0.002)

CASES = [
    # id, inner, model_type, overrides, batch kind, reference kernel, P values
    ("fa2-llama-causal", FA2, "llama", LLAMA_GQA, "plain", "sdpa", (2, 4)),
    ("fa2-mistral-window", FA2, "mistral", MISTRAL_W, "plain", "sdpa", (2, 4)),
    ("fa2-llama-packed", FA2, "llama", LLAMA_GQA, "packed", "sdpa", (2, 4)),
    ("fa2-mistral-window-packed", FA2, "mistral", MISTRAL_W, "packed", "sdpa", (2,)),
    ("fa2-gemma3-mixed-scale", FA2, "gemma3_text", {}, "plain", "sdpa", (2,)),
    ("fa2-gemma2-softcap", FA2, "gemma2", GEMMA2_CAP, "plain", "eager", (2,)),
    ("flash_attention_2-mistral-window-packed", "flash_attention_2", "mistral", MISTRAL_W, "packed", "sdpa", (2, 4)),
    ("fa3-mistral-window-packed", FA3, "mistral", MISTRAL_W, "packed", "sdpa", (2, 4)),
    ("vllm-fa3-gpt-oss-sinks", VLLM, "gpt_oss", {}, "plain", "eager", (2, 4)),
    ("vllm-fa3-gpt-oss-sinks-packed", VLLM, "gpt_oss", {}, "packed", "eager", (2,)),
    ("flash_attention_3-gpt-oss-sinks", "flash_attention_3", "gpt_oss", {}, "plain", "eager", (2,)),
    ("fa4-gpt-oss-sinks-packed", FA4, "gpt_oss", {}, "packed", "eager", (2, 4)),
    ("flash_attention_4-mistral-window", "flash_attention_4", "mistral", MISTRAL_W, "plain", "sdpa", (2,)),
]
PARAMS = [pytest.param(c, P, id=f"{c[0]}-P{P}") for c in CASES for P in c[-1]]


def check(results, P):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["backend"] == "ulysses"
        assert r["attention_layers"] >= 2 and r["a2a_bytes"] > 0, r
        assert not r["missing_grads"], r["missing_grads"]
        assert r["n_grads"] == r["n_params"], "every parameter must get a gradient to compare"
        assert r["loss_err"] <= TOL, (rank, r["loss_err"])
        assert r["logits_err"] <= TOL, (rank, r["logits_err"])
        assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"])


@pytest.mark.parametrize("case,P", PARAMS)
def test_ulysses_flash_matches_single_device(pool, case, P):
    _, inner, model_type, overrides, kind, ref_attn, _ = case
    check(pool.run(jobs_flash.flash_parity, P, inner, model_type, overrides, kind, ref_attn), P)


def test_ulysses_flash_padded_rows(pool):
    """B=2 with a padded row: every padding token is its own varlen document, never attended."""
    for r in pool.run(jobs_flash.flash_padded_logits_ok, 2, FA2):
        assert not r["nan"] and not r["missing"], r
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= TOL, r


def test_sinks_without_kernel_support_refused_before_any_collective(pool):
    """gpt_oss has sinks; flash-attn2 has no s_aux: refused by name, before the all-to-all."""
    for res in pool.run(jobs_flash.flash_refusal, 2, FA2, "gpt_oss"):
        assert res is not None, "a sinks model ran on a kernel without sinks"
        kind, msg, a2a_bytes = res
        assert kind == "NotImplementedError" and "sink" in msg and FA2 in msg, res
        assert a2a_bytes == 0, "refused only after a collective"


def test_setup_resolves_flash_names_without_transformers(pool):
    for inner, source in (("flash_attention_2", FA2), (FA3, FA3), ("flash_attention_3", VLLM),
                          ("flash_attention_4", FA4)):
        r = pool.run(jobs_flash.setup_without_transformers_registration, inner)[0]
        assert r["source"] == source and r["standin"] and "/" not in r["name"], r


MUTATIONS = [
    # mutation, inner, model_type, overrides, batch kind, reference kernel
    ("cu_seqlens_one_document", FA2, "llama", LLAMA_GQA, "packed", "sdpa"),
    ("window_dropped", FA2, "mistral", MISTRAL_W, "plain", "sdpa"),
    ("sink_grad_dropped", VLLM, "gpt_oss", {}, "plain", "eager"),
    ("softcap_dropped", FA2, "gemma2", GEMMA2_CAP, "plain", "eager"),
    ("sinks_not_sliced", VLLM, "gpt_oss", {}, "plain", "eager"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(pool, mutation):
    """Break what Ulysses passes the kernel: the model-level check must fail (the same case passes
    unmutated in test_ulysses_flash_matches_single_device)."""
    name, inner, model_type, overrides, kind, ref_attn = mutation
    for r in pool.run(jobs_flash.flash_parity, 2, inner, model_type, overrides, kind, ref_attn, name):
        if name == "sink_grad_dropped":  # forward untouched; only the sink logits lose their gradient
            assert r["logits_err"] <= TOL
            assert any("sinks" in p for p in r["missing_grads"]) or r["grad_err"] > DETECT, r
        elif name == "sinks_not_sliced":  # the tiny model's sinks move the logits little, its gradients a lot
            assert r["logits_err"] > TOL and r["grad_err"] > DETECT, (r["logits_err"], r["grad_err"])
        else:
            assert r["logits_err"] > DETECT and r["grad_err"] > DETECT, r


def test_window_size_convention():
    """HF: key visible iff 0 <= q - k < w (causal), |q - k| < w otherwise; flash: inclusive (left, right)."""
    assert flash_kernels.window_size(None, True) is None
    assert flash_kernels.window_size(4, True) == (3, 0)
    assert flash_kernels.window_size(4, False) == (3, 3)


def test_loader_names_and_errors(monkeypatch):
    assert flash_kernels.is_flash("flash_attention_2") and flash_kernels.is_flash("org/repo@v1")
    assert not flash_kernels.is_flash("sdpa") and not flash_kernels.is_flash("paged|flash_attention_2")
    k = flash_kernels.load(FA2)
    assert k is flash_kernels.load(FA2) and k.sink_kwarg is None
    assert flash_kernels.load(VLLM).sink_kwarg == "s_aux"
    with pytest.raises(NotImplementedError, match="sink"):
        k.check(sinks=True, dropout=0.0, softcap=None, window=False)
    with pytest.raises(ImportError, match="LOCAL_KERNELS"):
        flash_kernels.load("kernels-community/no-such-kernel-here")


def test_installed_package_wins_over_the_hub(monkeypatch):
    """With ``flash_attn`` importable, flash_attention_2 is its interface module (what transformers
    imports), not the hub kernel."""
    import sys

    from ringmaster_tools.flash_standin import fa2

    monkeypatch.setattr(flash_kernels, "_LOADED", {})
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2)
    k = flash_kernels.load("flash_attention_2")
    assert k.module is fa2 and k.source == "flash_attn.flash_attn_interface"


def test_sink_grad_matches_autograd():
    """SinkGrad's d s_aux from (out, lse) equals autograd through an explicit sink softmax."""
    g = torch.Generator().manual_seed(0)
    T, H, D = 7, 3, 4
    s = torch.randn(H, T, T, generator=g, dtype=torch.float64)
    v = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    logits = torch.cat([s, sinks[:, None, None].expand(H, T, 1)], -1)
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1)[..., :-1], v)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, sinks, dout)[0]
    leaf = sinks.detach().requires_grad_(True)
    got = torch.autograd.grad(flash_kernels.SinkGrad.apply(out.detach(), lse.detach(), leaf), leaf, dout)[0]
    torch.testing.assert_close(got, want)


def test_varlen_bounds_rows_documents_and_padding():
    """Rows flattened row-major; documents never span two rows; each padding token is its own
    document (doc ids may skip values where padding bumps them)."""
    from ringmaster.sharding.documents import CPBatch, batch_documents

    assert CPBatch(0, 2, "contiguous", 8).varlen_bounds(3, "cpu")[0].tolist() == [0, 8, 16, 24]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    cu, longest = CPBatch(0, 2, "contiguous", 6, batch_documents({"attention_mask": mask}, 6)).varlen_bounds(2, "cpu")
    assert cu.tolist() == [0, 6, 7, 10, 11, 12] and longest == 6 and cu.dtype == torch.int32
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    cu, longest = CPBatch(0, 2, "contiguous", 6, batch_documents({"position_ids": pos}, 6)).varlen_bounds(1, "cpu")
    assert cu.tolist() == [0, 3, 5, 6] and longest == 3
