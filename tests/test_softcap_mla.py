"""Gemma-2 logit softcap and MLA (query/key head dim != value head dim) under Ulysses and Ring,
against the same model without CP: loss, gathered logits, every gradient (fp32), at P=2 and P=4.

gemma2: attention softcap (small, 2.0, so that it bends the scores: a ring kernel that drops it is
far off; see tests/test_mutations_softcap_mla.py), final logit softcap, sliding + full layers.
Ulysses runs the model's eager kernel (HF's sdpa has no softcap: refused before the all-to-all).
deepseek_v3 / deepseek_v2: MLA, D_qk = 24 != D_v = 16, MoE with no aux loss.
Ring runs every CPU provider: math, aten (softcap blocks through the math kernel per tile; MLA padded
to one head dim), hf_kernels on the CPU flash stand-in (softcap passed to the kernel)."""

from types import SimpleNamespace

import jobs
import jobs_softcap_mla
import pytest
import torch

from ringmaster.attention.binding import AttentionBinding
from ringmaster.attention.ring.hf import ring_attention_hf
from ringmaster.attention.ring.kernels import get_kernel
from ringmaster.attention.ulysses import ulysses_attention
from ringmaster.attention.usp import usp_attention_hf
from ringmaster.config import RingImpl
from test_ring_parity import _check_ring
from test_ulysses_parity import check

GEMMA2 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
              attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
              initializer_range=0.2)  # scores of O(1): the cap bends them (a dropped cap is far off)
DEEPSEEK_V3 = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                   moe_intermediate_size=32, n_shared_experts=1)
DEEPSEEK_V2 = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                   moe_intermediate_size=32, n_shared_experts=1, aux_loss_alpha=0.0)

MINICPM3 = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
GLM4_MOE_LITE = dict(DEEPSEEK_V3)

# id, model_type, attn for Ulysses, overrides
CASES = [("gemma2-softcap", "gemma2", "eager", GEMMA2),
         ("deepseek_v3-mla", "deepseek_v3", "sdpa", DEEPSEEK_V3),
         ("deepseek_v3-mla-eager", "deepseek_v3", "eager", DEEPSEEK_V3),
         ("deepseek_v2-mla", "deepseek_v2", "sdpa", DEEPSEEK_V2)]
# the other registered MLA families, once each at P=2 (Ulysses sdpa, Ring aten)
MORE_MLA = [("minicpm3", MINICPM3), ("glm4_moe_lite", GLM4_MOE_LITE)]
RING_IMPLS = ["math", "aten"]


def _case(cid):
    return next(c for c in CASES if c[0] == cid)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_ulysses_softcap_mla_match_single_device(pool, cid, P):
    _, model_type, attn, overrides = _case(cid)
    check(pool.run(jobs.parity, model_type, P, attn, overrides), P)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("impl", RING_IMPLS)
@pytest.mark.parametrize("cid", ["gemma2-softcap", "deepseek_v3-mla", "deepseek_v2-mla"])
def test_ring_softcap_mla_match_single_device(pool, cid, impl, P):
    _, model_type, attn, overrides = _case(cid)
    rotate = "alltoall" if P == 2 else "allgather"
    results = pool.run(jobs.parity, model_type, P, attn, overrides, backend="ring",
                       cfg_kwargs=dict(ring_impl=impl, rotate_method=rotate, load_balance="head_tail"))
    _check_ring(results, P)


@pytest.mark.parametrize("model_type, overrides", MORE_MLA, ids=[m[0] for m in MORE_MLA])
def test_more_mla_families_match_single_device(pool, model_type, overrides):
    check(pool.run(jobs.parity, model_type, 2, "sdpa", overrides), 2)
    _check_ring(pool.run(jobs.parity, model_type, 2, "sdpa", overrides, backend="ring",
                         cfg_kwargs=dict(ring_impl="aten")), 2)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("cid", ["gemma2-softcap", "deepseek_v3-mla"])
def test_ring_hf_kernels_softcap_mla_match_single_device(pool, cid, P):
    """The hub flash provider on the CPU stand-in (which applies softcap in forward and backward),
    against the model's own eager/sdpa attention without CP."""
    _, model_type, attn, overrides = _case(cid)
    _check_ring(pool.run(jobs_softcap_mla.hub_parity, P, model_type, overrides, attn), P)


@pytest.mark.parametrize("impl", ["aten", "hf_kernels"])
@pytest.mark.parametrize("cid", ["gemma2-softcap", "deepseek_v3-mla"])
def test_ring_packed_rows_softcap_mla(pool, cid, impl):
    """Packed documents crossing shard edges (document blocks: aten's tiles, the flash varlen calls)."""
    _, model_type, attn, overrides = _case(cid)
    for r in pool.run(jobs_softcap_mla.packed_parity, 2, model_type, overrides, attn, impl):
        assert r["bytes_sent"] > 0 and r["attention_layers"] == 2, r
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= 1e-4 and not r["missing_grads"], r


@pytest.mark.parametrize("cid", ["gemma2-softcap", "deepseek_v3-mla"])
def test_usp_softcap_mla_match_single_device(pool, cid):
    """USP 2x2: Ulysses' all-to-all (separate for the narrower value heads) then the Ring with softcap."""
    _, model_type, attn, overrides = _case(cid)
    results = pool.run(jobs.parity, model_type, 4, attn, overrides, backend="usp",
                       cfg_kwargs=dict(ulysses_size=2, ring_size=2, ring_impl="aten"))
    assert {x["backend"] for x in results} == {"usp"}
    _check_ring(results, 4)


class _Module(torch.nn.Module):
    is_causal = True


def _binding(backend, inner="eager", kernel="aten", schedule="ring"):
    """No process group at all: a refusal that came after any collective would fail on the missing group."""
    return AttentionBinding(backend=backend, inner=inner, cp_group=None, cp_rank=0, cp_size=2,
                            ring_kernel=get_kernel(RingImpl(kernel)), schedule=schedule)


def _qkv(device="cpu", dk=8, dv=8):
    q = torch.randn(1, 4, 8, dk, device=device)
    return q, torch.randn(1, 4, 8, dk, device=device), torch.randn(1, 4, 8, dv, device=device)


def test_ulysses_sdpa_softcap_refused_before_the_all_to_all():
    """HF's sdpa has no softcap (it raises itself, but only after the all-to-all): refused first."""
    with pytest.raises(NotImplementedError, match=r"_Module.*softcap=2.0.*attn_implementation='eager'"):
        ulysses_attention(_Module(), *_qkv(), binding=_binding("ulysses", inner="sdpa"), cpb=None, softcap=2.0)


@pytest.mark.parametrize("backend", ["ring", "usp"])
def test_ring_refusals_come_before_any_collective(backend):
    """distflash (softcap, MLA) and aten on CUDA (softcap) refuse with the fix, before the ring (or USP's
    all-to-all) touches a group."""
    attend = ring_attention_hf if backend == "ring" else usp_attention_hf
    cpb = SimpleNamespace(layout="contiguous")  # nothing else of the batch is read before the refusal
    distflash = _binding(backend, schedule="distflash")
    with pytest.raises(NotImplementedError, match=r"distflash.*softcap=2.0.*load_balance='head_tail'"):
        attend(_Module(), *_qkv(), binding=distflash, cpb=cpb, softcap=2.0)
    with pytest.raises(NotImplementedError, match=r"distflash.*head dim 24 != value head dim 16.*head_tail"):
        attend(_Module(), *_qkv(dk=24, dv=16), binding=distflash, cpb=cpb)
    with pytest.raises(NotImplementedError, match=r"ring_impl='aten' on meta.*softcap=2.0.*ring_impl='hf_kernels'"):
        attend(_Module(), *_qkv("meta"), binding=_binding(backend), cpb=cpb, softcap=2.0)


# -- mutations: break the mechanism, the model-level check must see it ---------------------------

@pytest.mark.parametrize("mutation, cid", [("ring_kernels_drop_softcap", "gemma2-softcap"),
                                           ("aten_mla_keeps_the_wrong_columns", "deepseek_v3-mla")])
def test_mutations_are_caught(pool, mutation, cid):
    _, model_type, attn, overrides = _case(cid)
    results = pool.run(jobs_softcap_mla.mutated_parity, mutation, model_type, 2,
                       dict(overrides, attn_implementation=attn), dict(ring_impl="aten"))
    for rank, r in enumerate(results):
        clean, mutated = r["clean"], r["mutated"]
        assert max(clean[k] for k in ("loss_err", "logits_err", "grad_err")) <= 1e-4, (rank, clean)
        assert "raised" not in mutated, (rank, mutated)
        assert mutated["logits_err"] > 1e-3 and mutated["grad_err"] > 1e-3, (rank, mutation, mutated)
