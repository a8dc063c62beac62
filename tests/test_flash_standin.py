"""The CPU flash stand-in against a dense fp64 reference: the conventions the real kernels have
(bottom-right causal, windows around that diagonal, GQA groups, softcap, sinks, varlen, LSE
layout, +inf LSE for empty rows) and a backward from (out, lse) equal to autograd of the
reference. Loaded through ``kernels.get_kernel`` + ``LOCAL_KERNELS`` (set by conftest)."""

import math

import pytest
import torch

kernels = pytest.importorskip("kernels")

from standins import flash_repos as flash_standin  # noqa: E402
from ringmaster_tools.flash_standin import core  # noqa: E402


def hub(name):
    return kernels.get_kernel(f"kernels-community/{name}", version=1)


def dense_ref(q, k, v, scale, causal=False, left=-1, right=-1, softcap=0.0, sink=None):
    """q [Sq,H,D], k/v [Sk,Hk,D] -> out [Sq,H,D], lse [H,Sq]; fp64, explicit mask."""
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= rel <= 0
    if right >= 0:
        ok &= rel <= right
    if left >= 0:
        ok &= rel >= -left
    s = s.masked_fill(~ok, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink[:, None, None].expand(h, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    if sink is not None:
        p = p[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _qkv(b, sq, sk, h, hk, d=8, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return [x.requires_grad_(grad) for x in t]


CASES = [
    dict(sq=9, sk=9, causal=True),
    dict(sq=4, sk=11, causal=True),          # fewer queries than keys: bottom-right
    dict(sq=11, sk=4, causal=True),          # more queries: leading rows see nothing
    dict(sq=10, sk=10, causal=True, left=3),  # sliding window
    dict(sq=6, sk=10, causal=False, left=2, right=1),
    dict(sq=10, sk=10, causal=True, softcap=5.0),
    dict(sq=300, sk=300, causal=True, left=70),  # several query tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_fa2_forward_and_backward_match_dense(case):
    fa = hub("flash-attn2")
    sq, sk = case["sq"], case["sk"]
    left, right, cap = case.get("left", -1), case.get("right", -1), case.get("softcap", 0.0)
    q, k, v = _qkv(2, sq, sk, 4, 2, grad=True)
    scale = 0.37
    out = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=case["causal"],
                             window_size=(left, right), softcap=cap)
    refs = [dense_ref(q[b], k[b], v[b], scale, case["causal"], left, right, cap) for b in range(2)]
    ref = torch.stack([r[0] for r in refs])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)

    # low level: lse layout [B,H,Sq], +inf where a row sees nothing
    o2, lse, _, rng = fa._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, scale,
                                             case["causal"], left, right, cap, None, False)
    ref_lse = torch.stack([r[1] for r in refs]).detach()
    ref_lse = torch.where(ref_lse == -math.inf, torch.full_like(ref_lse, math.inf), ref_lse)
    assert lse.shape == (2, 4, sq)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)

    # backward from (out, lse), never via autograd of the forward
    dout = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), dout)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d = fa._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), o2, lse, dq, dk, dv, 0.0,
                                scale, case["causal"], left, right, cap, None, False, rng)
    for got, want in ((dq, gq), (dk, gk), (dv, gv)):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9)
    torch.testing.assert_close(d, (dout * o2).sum(-1).transpose(1, 2).float())
    # and the autograd entry point agrees
    aq, ak, av = torch.autograd.grad(out, (q, k, v), dout)
    for got, want in ((aq, gq), (ak, gk), (av, gv)):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("window", [(-1, -1), (2, 0)])
def test_fa2_varlen_matches_per_document_dense(window):
    fa = hub("flash-attn2")
    lens = [3, 7, 1, 5]
    cu = torch.tensor([0, 3, 10, 11, 16], dtype=torch.int32)
    q, k, v = (x[0].requires_grad_(True) for x in _qkv(1, 16, 16, 4, 1, seed=3))
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=window)
    ref = torch.cat([dense_ref(q[a:b], k[a:b], v[a:b], 8 ** -0.5, True, *window)[0]
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    o, lse, _, _ = fa._flash_attn_varlen_forward(q.detach(), k.detach(), v.detach(), cu, cu, 7, 7, 0.0,
                                                 None, True, *window)
    assert lse.shape == (4, 16)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    got = [torch.empty_like(x) for x in (q, k, v)]
    fa._flash_attn_varlen_backward(dout, q.detach(), k.detach(), v.detach(), o, lse, *got, cu, cu, 7, 7,
                                   0.0, None, True, *window, 0.0, None, False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)


def test_fa2_hub_ops_and_refusals():
    fa = hub("flash-attn2")
    q, k, v = _qkv(1, 5, 5, 2, 2)
    out, lse, _, _ = fa.fwd(q, k, v, None, None, 0.0, 0.5, True, -1, -1, 0.0, False, None)
    torch.testing.assert_close(out[0], dense_ref(q[0], k[0], v[0], 0.5, True)[0])
    dq, dk, dv, d = fa.bwd(torch.ones_like(out), q, k, v, out, lse, None, None, None, None, 0.0, 0.5, True,
                           -1, -1, 0.0, False, None, None)
    assert dq.shape == q.shape and d.shape == (1, 2, 5)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)


def test_fa3_interface_and_vllm_sinks():
    fa3, vl = hub("flash-attn3"), hub("vllm-flash-attn3")
    q, k, v = _qkv(2, 6, 6, 4, 2, grad=True)
    out = fa3.flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    ref = torch.stack([dense_ref(q[b], k[b], v[b], 8 ** -0.5, True, 2, 0)[0] for b in range(2)])
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.shape == (2, 4, 6)
    o, l, *_ = fa3._flash_attn_forward(q.detach(), k.detach(), v.detach(), causal=True)
    dq = torch.empty_like(q)
    fa3._flash_attn_backward(torch.ones_like(o), q.detach(), k.detach(), v.detach(), o, l, dq=dq,
                             dk=torch.empty_like(k), dv=torch.empty_like(v), is_causal=True)
    ref = torch.stack([dense_ref(q[b], k[b], v[b], 8 ** -0.5, True)[0] for b in range(2)])
    torch.testing.assert_close(dq, torch.autograd.grad(ref.sum(), q)[0], atol=1e-11, rtol=1e-9)

    # vllm FA3: s_aux joins the denominator and the LSE; out and (q, k, v) grads exact; no sink grad
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = vl.flash_attn_func(q, k, v, causal=True, s_aux=sink)
    refs = [dense_ref(q[b], k[b], v[b], 8 ** -0.5, True, sink=sink) for b in range(2)]
    torch.testing.assert_close(out, torch.stack([r[0] for r in refs]), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, torch.stack([r[1] for r in refs]).detach(), atol=1e-12, rtol=1e-10)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(torch.stack([r[0] for r in refs]), (q, k, v, sink), dout)
    for g, w in zip(got, want[:3]):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)
    out2, _ = vl.flash_attn_func(q, k, v, causal=True, s_aux=sink)
    assert torch.autograd.grad(out2, sink, dout, allow_unused=True)[0] is None
    # what a caller must add for d s_aux: -sum exp(s_aux - lse) * rowsum(dout * out)
    delta = (dout * out).sum(-1).transpose(1, 2)
    dsink = -(torch.exp(sink.detach()[None, :, None] - lse) * delta).sum((0, 2))
    torch.testing.assert_close(dsink, want[3], atol=1e-11, rtol=1e-9)


def test_tiles_bound_the_temporaries():
    """No [Sq, Sk] temporary: with a window the per-tile key range is the band, not all keys."""
    m = core.Mask(causal=True, left=16).normalized(4096)
    lo, hi = core._key_range(1024, 1024 + core.TILE, 4096, 4096, m)
    assert hi - lo == core.TILE + 16
    assert core._key_range(0, core.TILE, 4096, 4096, core.Mask(causal=True).normalized(4096)) == (0, core.TILE)


def test_local_kernels_value_names_every_standin(tmp_path):
    value = flash_standin.local_kernels(f"kernels-community/flash-attn2={tmp_path}")
    entries = dict(e.split("=", 1) for e in value.split(":"))
    assert entries["kernels-community/flash-attn2"] == str(tmp_path)
    assert set(entries) == set(flash_standin.REPOS)


def test_fa4_interface_sinks_and_lse_gradient():
    fa4 = hub("flash-attn4")
    q, k, v = _qkv(2, 9, 9, 4, 2, grad=True)
    sink = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), learnable_sink=sink, return_lse=True)
    refs = [dense_ref(q[b], k[b], v[b], 8 ** -0.5, True, 3, 0, sink=sink) for b in range(2)]
    ref_out, ref_lse = torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs])
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    # a loss on out and on the LSE: FA4 sends dlse into the backward, and the sink gets its gradient
    dout, dl = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * dout).sum() + (lse * dl).sum(), (q, k, v, sink))
    want = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dl).sum(), (q, k, v, sink))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)
    # low level: (out, lse, None, None) and (dq, dk, dv, dsink)
    o, l, *_ = fa4._flash_attn_fwd(q.detach(), k.detach(), v.detach(), causal=True, learnable_sink=sink.detach())
    dq, dk, dv, ds = fa4._flash_attn_bwd(q.detach(), k.detach(), v.detach(), o, dout, l, causal=True,
                                         learnable_sink=sink.detach())
    refs = [dense_ref(q[b], k[b], v[b], 8 ** -0.5, True, sink=sink) for b in range(2)]
    want = torch.autograd.grad(torch.stack([r[0] for r in refs]), (q, k, v, sink), dout)
    for g, w in zip((dq, dk, dv, ds), want):
        torch.testing.assert_close(g, w, atol=1e-11, rtol=1e-9)


def test_fa4_empty_rows_have_minus_inf_lse():
    """FA4 writes -inf for a row that sees nothing (FA2/FA3: +inf); the backward treats both as empty."""
    fa4, fa2 = hub("flash-attn4"), hub("flash-attn2")
    q, k, v = _qkv(1, 6, 3, 2, 2, grad=True)  # 6 queries, 3 keys, causal bottom-right: rows 0-2 see nothing
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isneginf(lse[0, :, :3]).all() and (out[0, :3] == 0).all()
    _, lse2, _, _ = fa2._flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, None, True, -1, -1, 0.0,
                                            None, False)
    assert torch.isposinf(lse2[0, :, :3]).all()
    g = torch.autograd.grad(out.sum(), q)[0]
    assert torch.isfinite(g).all() and (g[0, :3] == 0).all()


def test_no_op_allocates_a_full_score_matrix():
    """Forward + backward at S=1024: the largest single allocation is a [H, TILE, S] tile, far below
    one head's [S, S] fp32 scores (what the torch profiler reports per op)."""
    from torch.profiler import ProfilerActivity, profile

    S, H, D = 1024, 2, 16
    q, k, v = (torch.randn(1, S, H, D, requires_grad=True) for _ in range(3))
    fa = hub("flash-attn2")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fa.flash_attn_func(q, k, v, causal=True).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= H * core.TILE * S * 4, largest
    assert largest < S * S * 4 / 2
