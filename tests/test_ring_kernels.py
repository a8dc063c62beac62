"""Ring block kernels and the LSE merge against dense attention over the concatenation."""

import itertools

import pytest
import torch

from ringmaster.config import RingImpl
from ringmaster.attention.ring.kernels import get_kernel
from ringmaster.attention.ring.merge import merge, merge_sink, reference_attention

PROVIDERS = [RingImpl.MATH, RingImpl.TORCH_NATIVE]


def _mask(kind, sq, sk, gen):
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "random":  # includes fully masked rows
        m = torch.rand(sq, sk, generator=gen) < 0.5
        m[0] = False
        return m
    if kind == "empty":
        return torch.zeros(sq, sk, dtype=torch.bool)
    raise ValueError(kind)


def _dense_mask(mask, sq, sk):
    if mask is None:
        return None
    if isinstance(mask, str):
        return torch.ones(sq, sk, dtype=torch.bool).tril()
    return mask


GRID = list(itertools.product([1, 2], [(4, 4), (4, 2), (4, 1)], [1, 5, 16], [8, 16],
                              ["none", "causal", "random", "empty"]))


@pytest.mark.parametrize("impl", PROVIDERS, ids=lambda i: i.value)
def test_block_kernel_forward_backward_match_dense(impl):
    kernel = get_kernel(impl)
    gen = torch.Generator().manual_seed(0)
    for B, (hq, hkv), S, D, kind in GRID:
        q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float32) for h in (hq, hkv, hkv))
        mask = _mask(kind, S, S, gen)
        scale = D ** -0.5
        out, lse = kernel.forward(q, k, v, scale, mask)
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref_out, ref_lse = reference_attention(qr, kr, vr, scale, _dense_mask(mask, S, S))
        where = f"{impl.value} B={B} heads={hq}/{hkv} S={S} D={D} mask={kind}"
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=where)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), where
        finite = ~torch.isneginf(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, msg=where)
        dout = torch.randn(out.shape, generator=gen)
        (ref_out * dout).sum().backward()
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale, mask)
        for got, want, name in ((dq, qr.grad, "dq"), (dk, kr.grad, "dk"), (dv, vr.grad, "dv")):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{where} {name}")


def test_merge_equals_softmax_over_concatenation():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)
    mask = torch.rand(6, 12, generator=gen) < 0.6
    mask[:, 8:] = False  # the last block is fully masked: it must contribute nothing (and no NaN)
    mask[:, 0] = True
    sinks = torch.randn(4, generator=gen)
    want, want_lse = reference_attention(q, k, v, 0.3, mask, sink=sinks)
    kernel = get_kernel(RingImpl.MATH)
    out = lse = None
    for lo, hi in ((4, 8), (0, 4), (8, 12)):  # any order
        o, l = kernel.forward(q, k[..., lo:hi, :], v[..., lo:hi, :], 0.3, mask[:, lo:hi])
        out, lse = merge(out, lse, o, l)
    out, lse = merge_sink(out, lse, sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", PROVIDERS, ids=lambda i: i.value)
def test_per_block_backward_with_merged_lse_is_exact(impl):
    """Each block's backward run with the merged (out, lse) sums to the full gradient."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 16, generator=gen)
    k, v = torch.randn(1, 2, 24, 16, generator=gen), torch.randn(1, 2, 24, 16, generator=gen)
    full_mask = torch.ones(8, 24, dtype=torch.bool).tril(diagonal=16)
    blocks = [(0, 8, None), (8, 16, None), (16, 24, "causal")]
    kernel = get_kernel(impl)
    out = lse = None
    for lo, hi, m in blocks:
        o, l = kernel.forward(q, k[..., lo:hi, :], v[..., lo:hi, :], 0.25, m)
        out, lse = merge(out, lse, o, l)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, 0.25, full_mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    dout = torch.randn(ref.shape, generator=gen)
    (ref * dout).sum().backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi, m in blocks:
        gq, gk, gv = kernel.backward(dout, q, k[..., lo:hi, :], v[..., lo:hi, :], out, lse, 0.25, m)
        dq += gq
        dk[..., lo:hi, :] += gk
        dv[..., lo:hi, :] += gv
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
