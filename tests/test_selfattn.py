"""Attention modules that compute attention themselves (no ALL_ATTENTION_FUNCTIONS), wired through a
SelfAttentionSite: exact under Ulysses and Ring at P=2 and P=4 (float64 parity: loss, gathered logits,
every parameter's gradient against its own norm), a mutation per mechanism that a model-level check
catches, and the families without a site refused naming the layer."""

import jobs_selfattn as js
import pytest
import torch

import ringmaster as rm
from ringmaster.errors import UnsupportedLayerError
from ringmaster_tools.parity import tiny_model

TOL = 1e-6
DETECT = 1e-3
CASES = ["falcon", "falcon_gqa", "falcon_mha", "gpt_neo", "gpt_neox_japanese", "openai-gpt", "bloom", "mpt",
         "megatron-bert", "rembert", "roformer"]


def check(results, layers=2):
    for r in results:
        assert r["attention_layers"] == layers, r
        assert r["n_grads"] == r["n_params"], "every parameter must get a gradient to compare"
        assert r["loss_err"] <= TOL and r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, (r["worst_param"], r["grad_err"])


# P=2: a family's declared site is re-bound the same at any P; Ring at P=4 is tests/test_ring_parity.py's
@pytest.mark.parametrize("backend, P", [("ulysses", 2), ("ring", 2)])
@pytest.mark.parametrize("case", CASES)
def test_site_family_exact(pool, case, backend, P):
    check(pool.run(js.parity, case, P, backend))


@pytest.mark.parametrize("case", ["falcon_gqa", "bloom"])
def test_site_family_usp_exact(pool, case):
    check(pool.run(js.parity, case, 4, "usp"))


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_bert_style_bidirectional_exact(pool, backend):
    """megatron-bert with is_decoder=False attends both ways: the site reads causality from the module."""
    check(pool.run(js.parity, "megatron-bert_bidi", 2, backend))


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_alibi_six_heads_exact(pool, backend):
    """A head count that is not a power of two: BLOOM's interleaved slopes, 3 heads per rank."""
    check(pool.run(js.parity, "bloom_6h", 2, backend))


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
@pytest.mark.parametrize("case", ["gpt_neo", "falcon", "bloom"])
def test_site_family_padded_rows_exact(pool, case, backend):
    """Left padding and right padding (the model's local padding mask is dropped; the batch's doc ids
    rebuild it), with gpt_neo's window cutting the sequence."""
    check(pool.run(js.padded_parity, case, 2, backend))


def _assert_wrong(results, logits_detect=DETECT):
    for r in results:
        assert r["clean"]["grad_err"] <= TOL and r["clean"]["logits_err"] <= TOL, r["clean"]
        m = r["mutated"]
        assert "raised" not in m, m
        assert m["logits_err"] > logits_detect and m["grad_err"] > DETECT, m


@pytest.mark.parametrize("backend,P", [("ulysses", 2), ("ring", 4)])
def test_window_ignored_is_caught(pool, backend, P):
    _assert_wrong(pool.run(js.mutated_parity, "window_ignored", "gpt_neo", P, backend))


def test_scale_ignored_is_caught(pool):
    _assert_wrong(pool.run(js.mutated_parity, "scale_ignored", "gpt_neo", 2, "ring"))


@pytest.mark.parametrize("case", ["falcon", "openai-gpt"])
def test_not_causal_is_caught(pool, case):
    _assert_wrong(pool.run(js.mutated_parity, "not_causal", case, 2, "ulysses"))


def test_causality_ignored_is_caught(pool):
    _assert_wrong(pool.run(js.mutated_parity, "causality_ignored", "megatron-bert_bidi", 2, "ring"))


@pytest.mark.parametrize("backend", ["ulysses", "ring"])
def test_roformer_rotary_value_exact(pool, backend):
    """rotary_value=True: the module rotates v too (the site passes v through its own function)."""
    check(pool.run(js.parity, "roformer_rv", 2, backend))


@pytest.mark.parametrize("backend,P", [("ulysses", 2), ("ring", 4)])
def test_rotary_at_local_positions_is_caught(pool, backend, P):
    # the tiny model's rotary moves its logits little (measured 1.4e-4, far above TOL); its gradients by O(1)
    _assert_wrong(pool.run(js.mutated_parity, "rotary_at_local_positions", "roformer", P, backend),
                  logits_detect=100 * TOL)


def test_alibi_slopes_not_sliced_per_rank_is_caught(pool):
    _assert_wrong(pool.run(js.mutated_parity, "alibi_slopes_not_sliced", "bloom", 2, "ulysses"))


@pytest.mark.parametrize("case", ["bloom", "mpt"])
def test_ring_alibi_offset_ignored_is_caught(pool, case):
    _assert_wrong(pool.run(js.mutated_parity, "ring_alibi_offset_ignored", case, 2, "ring"))


@pytest.mark.parametrize("kernel", ["math", "aten"])
@pytest.mark.parametrize("offset,lo,hi", [(0, 0, None), (-16, None, None), (-8, None, 5), (16, None, None)])
def test_alibi_block_kernels_match_dense(kernel, offset, lo, hi):
    """A ring block with ALiBi (``slopes[h] * (offset + j - i)``) against a dense softmax, forward and
    backward (GQA, a band or none), for the math and aten CPU kernels."""
    from ringmaster.attention.ring.kernels import AtenKernel, MathKernel
    from ringmaster.attention.ring.masks import BlockMask

    g = torch.Generator().manual_seed(0)
    B, H, Hk, S, D = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, Hk, Hk))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    mask = BlockMask(S, S, lo=lo, hi=hi, alibi_slopes=slopes, alibi_offset=offset)
    scale = D ** -0.5
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keep = torch.ones(S, S, dtype=torch.bool)
    if lo is not None:
        keep &= (i - j) >= lo
    if hi is not None:
        keep &= (i - j) <= hi
    kx, vx = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
    s = q @ kx.transpose(-1, -2) * scale + slopes.view(1, H, 1, 1) * (offset + j - i)
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vx
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    impl = MathKernel() if kernel == "math" else AtenKernel(tile_rows=5)
    with torch.no_grad():
        out, lse = impl.forward(q, k, v, scale, mask)
        grads = impl.backward(dout, q, k, v, out, lse, scale, mask)
    assert torch.allclose(out, ref, atol=1e-12), (out - ref).abs().max()
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()


def test_unwired_site_fails_first_forward_accounting(pool):
    """A site module left with its own attention computes over the local shard: the first CP forward
    raises before backward, naming it."""
    for r in pool.run(js.mutated_parity, "one_site_unwired", "falcon", 2, "ring"):
        kind, msg = r["mutated"]["raised"]
        assert kind == "UnsupportedLayerError", msg
        assert "first-forward accounting" in msg and "transformer.h.0.self_attention" in msg, msg


# xlm (bidirectional by default, causal=True too) and trocr: separate q/k/v sites; trocr's position table gets
# the shard's global positions, both losses (local means) are rescaled to the global mean
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("backend", ["ulysses", "ring"])
@pytest.mark.parametrize("case", ["xlm", "trocr"])
def test_xlm_trocr_exact(pool, case, backend, P):
    check(pool.run(js.parity, case, P, backend))


@pytest.mark.parametrize("case,backend,P", [("xlm_causal", "ring", 4), ("xlm", "ulysses", 2), ("xlm", "ring", 4)])
def test_xlm_right_padded_exact(pool, case, backend, P):
    """Right-padded rows (pad tokens where attention_mask is 0): XLMModel's shard-local padding mask is
    still the row's (valid tokens come first on every shard), against the padded batch without CP."""
    results = pool.run(js.xlm_padded, case, P, backend, 0)
    for r in results:
        assert "raised" not in r, r
    check(results)


def test_xlm_leading_pad_refused(pool):
    """A row with pad tokens before real ones: refused (on every rank alike) before the CP attention."""
    for r in pool.run(js.xlm_padded, "xlm", 2, "ring", 3):
        kind, msg = r["raised"]
        assert kind == "NotImplementedError" and "pad_index=2" in msg and "transformer.attentions.0" in msg, msg


def test_xlm_batch_rule_skipped_is_caught(pool):
    for r in pool.run(js.xlm_padded, "xlm", 2, "ring", 3, mutation="batch_rule_skipped"):
        assert "raised" not in r, r
        assert r["logits_err"] > DETECT and r["grad_err"] > DETECT, r


def test_trocr_positions_not_steered_is_caught(pool):
    _assert_wrong(pool.run(js.mutated_parity, "positions_not_steered", "trocr", 2, "ulysses"))


def test_local_mean_loss_is_caught(pool):
    """Without the rescale, the group's mean of per-shard means is not the batch mean (logits unchanged)."""
    for r in pool.run(js.mutated_parity, "local_mean_loss", "xlm", 4, "ring"):
        assert r["clean"]["loss_err"] <= TOL, r["clean"]
        # the tiny batch's shards hold similar label counts: the loss moves little (measured 3e-4), gradients by 0.3
        assert r["mutated"]["loss_err"] > 100 * TOL and r["mutated"]["grad_err"] > DETECT, r["mutated"]


def test_trocr_sinusoidal_positions_and_cross_attention_refused():
    from ringmaster.architectures.selfattn import TROCR
    from ringmaster.attention import selfattn

    model = tiny_model("trocr", attn_implementation="eager", **{**js.TINY["trocr"],
                                                                "use_learned_position_embeddings": False})
    with pytest.raises(UnsupportedLayerError, match=r"embed_positions.*position_ids"):
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ring"))
    paths = ["model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"]
    assert selfattn.split_cross(TROCR, paths) == (paths[:1], paths[1:])
    with pytest.raises(NotImplementedError, match="encoder_attn.*cross-attention"):
        selfattn._refuse_cross(paths[1])(None, (), {})


def test_falcon_alibi_and_output_attentions_refused():
    model = tiny_model("falcon", dtype=torch.float64, **{**js.TINY["falcon"], "alibi": True})
    with pytest.raises(UnsupportedLayerError, match=r"transformer\.h\.0\.self_attention.*alibi"):
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ring"))
    assert "forward" not in vars(model.transformer.h[0].self_attention)  # nothing changed


def test_dropout_inside_the_replaced_attention_refused():
    """openai-gpt's attention dropout is applied inside ``_attn``, which its CP site replaces: refused, naming it.
    Its residual dropout runs outside the site, under each rank's forked random state (tests/test_dropout.py):
    no refusal."""
    from ringmaster.attention.selfattn import check_sites

    model = tiny_model("openai-gpt", attn_implementation="eager", **{**js.TINY["openai-gpt"], "attn_pdrop": 0.1})
    with pytest.raises(UnsupportedLayerError, match=r"attn_dropout \(p=0.1\) is applied inside its method '_attn'"):
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ring"))
    model = tiny_model("openai-gpt", attn_implementation="eager", **{**js.TINY["openai-gpt"], "resid_pdrop": 0.1})
    spec = rm.get_architecture(model)
    check_sites(model, spec, [n for n, m in model.named_modules() if type(m).__name__ in spec.self_attention])


def test_falcon_eager_refused():
    model = tiny_model("falcon", attn_implementation="eager", **js.TINY["falcon"])
    with pytest.raises(ValueError, match="sdpa"):
        rm.wire(model, rm.RingmasterConfig(size=2, backend="ring"))


def test_falcon_guard_refuses_a_branch_that_bypasses_the_site():
    """Per call (the accounting runs only on the first forward): output_attentions=True, or a config switched
    off "sdpa" after wiring, would send FalconAttention down its inline branch over the local shard."""
    from ringmaster.architectures.selfattn import FALCON
    from ringmaster.attention import selfattn

    model = tiny_model("falcon", **js.TINY["falcon"])
    module = model.transformer.h[0].self_attention
    guard = selfattn._guard(FALCON.self_attention["FalconAttention"], "transformer.h.0.self_attention", module)
    guard((), {"output_attentions": False})
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        guard((), {"output_attentions": True})
    model.config._attn_implementation = "eager"
    with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
        guard((), {})
