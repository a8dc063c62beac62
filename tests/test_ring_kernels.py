"""Ring block kernels and the LSE merge against dense attention over the concatenation.

Every provider (math, aten, hf_kernels on the CPU flash stand-in: FA2, FA3, vllm's FA3) runs
forward and backward against a dense fp64/fp32 reference for every mask kind the ring plans
(unmasked, causal diagonal, window bands on and off the diagonal, documents alone and cut by a
band, rows that see nothing) plus arbitrary masks for the providers that take them. aten's CUDA
path is traced on ``meta`` tensors against the ops' meta kernels (shapes and arguments only).
"""

import itertools

import pytest
import torch

from ringmaster.attention.ring import aten_cuda
from ringmaster.attention.ring.aten import AtenKernel
from ringmaster.attention.ring.hub import HfKernelsKernel
from ringmaster.attention.ring.kernels import check_dtype, get_kernel
from ringmaster.attention.ring.masks import BlockMask, as_block_mask, flash_calls, flash_window
from ringmaster.attention.ring.merge import merge, merge_sink, reference_attention
from ringmaster.attention.ring.select import resolve_ring_impl
from ringmaster.config import RingImpl
from ringmaster.sharding.documents import Runs

HUB = {"fa2": "flash_attention_2", "fa3": "kernels-community/flash-attn3", "vllm-fa3": "kernels-community/vllm-flash-attn3"}


def _kernels():
    """(id, kernel, takes arbitrary dense masks)."""
    out = [("math", get_kernel(RingImpl.MATH), True), ("aten", get_kernel(RingImpl.ATEN), True),
           ("aten-tiled", AtenKernel(tile_rows=3), True)]
    try:
        out += [(f"hub-{k}", get_kernel(RingImpl.HF_KERNELS, v), False) for k, v in HUB.items()]
    except Exception as exc:  # pragma: no cover - reported as a failure by test_hub_kernels_load
        print(f"hub stand-in unavailable: {exc}")
    return out


KERNELS = _kernels()


def test_hub_kernels_load():
    """The stand-in hub kernels load through kernels.get_kernel + LOCAL_KERNELS (tests/conftest.py)."""
    names = {k[0] for k in KERNELS}
    assert {f"hub-{k}" for k in HUB} <= names, names
    assert {k[0]: k[1].ops.flavor for k in KERNELS if k[0].startswith("hub")} == {
        "hub-fa2": "fa2", "hub-fa3": "fa3", "hub-vllm-fa3": "fa3"}


def _docs(B, S, gen, lengths=None):
    rows = []
    for b in range(B):
        ids, doc = [], 0
        while len(ids) < S:
            n = int(torch.randint(1, max(2, S // 2), (1,), generator=gen)) if lengths is None else lengths[doc % len(lengths)]
            ids += [doc + 10 * b] * n
            doc += 1
        rows.append(ids[:S])
    return torch.tensor(rows)


def _doc_block(docs, q0, sq, k0, sk, **band):
    """The block of queries ``[q0, q0 + sq)`` against keys ``[k0, k0 + sk)`` of the rows ``docs``, cut by their
    documents as the ring plans it: the ids with their host runs and the block's global offsets."""
    return BlockMask(sq, sk, q_docs=docs[:, q0:q0 + sq], k_docs=docs[:, k0:k0 + sk], runs=Runs.from_doc_ids(docs),
                     q_start=q0, k_start=k0, **band)


def _masks(B, sq, sk, gen):
    """(name, mask, dense-only): every block kind the ring plans, and arbitrary ones."""
    out = [("none", None, False), ("band-off-diag-window", BlockMask(sq, sk, lo=-sk, hi=4 - sk), False),
           ("band-right-of-diag", BlockMask(sq, sk, lo=-3, hi=2), False),
           ("band-nothing", BlockMask(sq, sk, lo=sq + 1), False)]
    if sq == sk:
        out += [("causal", "causal", False), ("causal-window", BlockMask(sq, sk, lo=0, hi=3), False)]
    S = max(sq, sk) * 2
    docs = _docs(B, S, gen)
    if sq == sk:
        out.append(("docs-same-chunk-causal", _doc_block(docs, 0, sq, 0, sq, lo=0), False))
    # queries after keys: earlier documents never reach the queries
    out += [("docs", _doc_block(docs, S - sq, sq, 0, sk), False),
            ("docs-window", _doc_block(docs, S - sq, sq, 0, sk, lo=-sk, hi=5 - sk), False),
            ("docs-none-shared", _doc_block(torch.cat([torch.full((B, sk), 3), torch.full((B, sq), 7)], 1), sk, sq, 0,
                                            sk), False)]
    rnd = torch.rand(sq, sk, generator=gen) < 0.5
    rnd[0] = False
    out += [("random-with-empty-rows", rnd, True), ("empty", torch.zeros(sq, sk, dtype=torch.bool), True),
            ("random-per-row", torch.rand(B, 1, sq, sk, generator=gen) < 0.4, True)]
    return out


def _dense(mask, B, sq, sk):
    if mask is None:
        return None
    return as_block_mask(mask, sq, sk).to_dense("cpu")


SHAPES = [(1, (4, 4), 5, 5, 8), (2, (4, 2), 16, 16, 16), (2, (4, 1), 9, 7, 8)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kid", [k[0] for k in KERNELS])
def test_block_kernel_forward_backward_match_dense(kid, dtype):
    _, kernel, dense_ok = next(k for k in KERNELS if k[0] == kid)
    gen = torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
    checked = 0
    for B, (hq, hkv), sq, sk, D in SHAPES:
        for name, mask, dense_only in _masks(B, sq, sk, gen):
            if dense_only and not dense_ok:
                continue
            q = torch.randn(B, hq, sq, D, generator=gen, dtype=dtype)
            k, v = (torch.randn(B, hkv, sk, D, generator=gen, dtype=dtype) for _ in range(2))
            scale = D ** -0.5
            out, lse = kernel.forward(q, k, v, scale, mask)
            qr, kr, vr = (t.clone().double().requires_grad_(True) for t in (q, k, v))
            ref_out, ref_lse = reference_attention(qr, kr, vr, scale, _dense(mask, B, sq, sk))
            where = f"{kid} {dtype} B={B} heads={hq}/{hkv} {sq}x{sk} D={D} mask={name}"
            torch.testing.assert_close(out.double(), ref_out, **tol, msg=where)
            assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), where
            finite = ~torch.isneginf(ref_lse)
            torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **tol, msg=where)
            dout = torch.randn(out.shape, generator=gen, dtype=dtype)
            (ref_out * dout.double()).sum().backward()
            dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale, mask)
            for got, want, n in ((dq, qr.grad, "dq"), (dk, kr.grad, "dk"), (dv, vr.grad, "dv")):
                assert got.shape == want.shape and got.dtype == dtype, (where, n, got.shape, got.dtype)
                torch.testing.assert_close(got.double(), want, **tol, msg=f"{where} {n}")
            checked += 1
    assert checked >= (27 if not dense_ok else 36), checked


def test_hub_provider_refuses_dense_masks():
    kernel = next(k[1] for k in KERNELS if k[0] == "hub-fa2")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="ring_impl='aten'"):
        kernel.forward(q, q, q, 0.3, torch.ones(4, 4, dtype=torch.bool))


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


@pytest.mark.parametrize("kid", [k[0] for k in KERNELS])
def test_per_block_backward_with_merged_lse_is_exact(kid):
    """Each block's backward run with the merged (out, lse) sums to the full gradient."""
    kernel = next(k[1] for k in KERNELS if k[0] == kid)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 24, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    full_mask = torch.ones(8, 24, dtype=torch.bool).tril(diagonal=16)
    blocks = [(0, 8, None), (8, 16, None), (16, 24, "causal")]
    out = lse = None
    for lo, hi, m in blocks:
        o, l = kernel.forward(q, k[..., lo:hi, :], v[..., lo:hi, :], 0.25, m)
        out, lse = merge(out, lse, o, l)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, 0.25, full_mask)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * dout).sum().backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi, m in blocks:
        gq, gk, gv = kernel.backward(dout, q, k[..., lo:hi, :], v[..., lo:hi, :], out, lse, 0.25, m)
        dq += gq
        dk[..., lo:hi, :] += gk
        dv[..., lo:hi, :] += gv
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


# -- masks: the band algebra the flash providers rely on -----------------------------------------

def test_flash_window_reproduces_every_band():
    """For every band and block shape, the region + (left, right) that flash_calls emits, applied with
    flash's bottom-right alignment, is exactly the band."""
    for sq, sk in ((5, 5), (4, 7), (7, 4), (1, 6)):
        for lo, hi in itertools.product([None, -8, -3, -1, 0, 2, 5], [None, -6, -2, 0, 1, 4, 9]):
            m = BlockMask(sq, sk, lo=lo, hi=hi)
            want = m.to_dense("cpu")
            want = torch.ones(sq, sk, dtype=torch.bool) if want is None else want.view(sq, sk)
            got = torch.zeros(sq, sk, dtype=torch.bool)
            for kind, (q0, q1, k0, k1), (left, right) in flash_calls(m):
                i = torch.arange(q1 - q0)[:, None]
                j = torch.arange(k1 - k0)[None, :]
                rel = i - j + (k1 - k0) - (q1 - q0)
                keep = torch.ones_like(rel, dtype=torch.bool)
                if left is not None:
                    keep &= rel <= left
                if right is not None:
                    keep &= rel >= -right
                got[q0:q1, k0:k1] = keep
                assert keep.any(-1).all(), (sq, sk, lo, hi)  # every covered row sees a key
            assert torch.equal(got, want), (sq, sk, lo, hi, flash_calls(m))


def test_flash_window_bounds():
    assert flash_window(0, 4, 0, 4, 0, None) == (None, 0)        # causal diagonal
    assert flash_window(0, 4, 0, 4, None, None) == (None, None)  # everything
    assert flash_window(0, 4, 0, 4, 0, 2) == (2, 0)              # sliding window on the diagonal


# -- aten's CUDA path, traced on meta tensors ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_aten_cuda_path_traces_on_meta(dtype):
    """Every block kind reaches aten's CUDA ops with arguments their meta kernels accept and returns
    the interface's shapes and dtypes. (Numerics need a GPU: not yet run on one.) The memory-efficient
    backward's meta kernel in this torch lacks its ``out`` argument, so fp32/dense backward is not traced."""
    gen = torch.Generator().manual_seed(3)
    B, hq, hkv, sq, sk, D = 2, 4, 2, 16, 16, 12   # D=12: flash pads to a multiple of 8
    q = torch.empty(B, hq, sq, D, dtype=dtype, device="meta")
    k = torch.empty(B, hkv, sk, D, dtype=dtype, device="meta")
    for name, mask, dense_only in _masks(B, sq, sk, gen):
        m = as_block_mask(mask, sq, sk)
        out, lse = aten_cuda.forward(q, k, k, 0.3, m)
        assert out.shape == (B, hq, sq, D) and out.dtype == torch.float32, name
        assert lse.shape == (B, hq, sq) and lse.dtype == torch.float32, name
        if dtype == torch.bfloat16 and not dense_only:
            dq, dk, dv = aten_cuda.backward(out.to(dtype), q, k, k, out, lse, 0.3, m)
            assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape, name
    with pytest.raises(ValueError, match="ring_impl='math'"):
        aten_cuda.forward(q.double(), k.double(), k.double(), 0.3, as_block_mask(None, sq, sk))


# -- choosing a provider --------------------------------------------------------------------------

def test_resolve_ring_impl_trains_on_every_device():
    assert resolve_ring_impl("auto", "sdpa") is RingImpl.ATEN
    assert resolve_ring_impl("auto", "eager") is RingImpl.ATEN
    assert resolve_ring_impl("auto", None) is RingImpl.ATEN
    assert resolve_ring_impl("auto", "flex_attention") is RingImpl.ATEN
    for flash in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"):
        assert resolve_ring_impl(RingImpl.AUTO, flash) is RingImpl.HF_KERNELS
    assert resolve_ring_impl("torch_native", "sdpa") is RingImpl.ATEN  # the former name
    assert resolve_ring_impl("math", "flash_attention_2") is RingImpl.MATH
    assert resolve_ring_impl("aten", "flash_attention_2") is RingImpl.ATEN
    assert isinstance(get_kernel(RingImpl.TORCH_NATIVE), AtenKernel)


def test_check_dtype_math_only_when_asked():
    check_dtype(RingImpl.ATEN, "cuda", torch.float32)   # memory-efficient attention covers fp32
    check_dtype(RingImpl.ATEN, "cuda", torch.bfloat16)
    check_dtype(RingImpl.ATEN, "cpu", torch.float64)
    with pytest.raises(ValueError, match="no fused kernel for torch.float64.*ring_impl='math'"):
        check_dtype(RingImpl.ATEN, "cuda", torch.float64)
    with pytest.raises(ValueError, match="fp16/bf16 on GPU"):
        check_dtype(RingImpl.HF_KERNELS, "cuda", torch.float32)
    check_dtype(RingImpl.HF_KERNELS, "cpu", torch.float32)  # the CPU stand-in
    with pytest.raises(ValueError, match="runs on cpu and cuda"):
        check_dtype(RingImpl.ATEN, "mps", torch.float32)


def test_hub_provider_needs_a_flash_model():
    with pytest.raises(ValueError, match="needs a flash model"):
        HfKernelsKernel("sdpa")


# -- memory: no block-sized temporary outside a kernel's own tiles -------------------------------

class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any op returns inside the block (a fused op's own workspace is invisible)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


def test_aten_cpu_masked_blocks_build_no_block_sized_temporary():
    """Window, document and arbitrary-mask blocks run per query-row tile: no [c, c] mask or score
    tensor (the old path built an fp32 [c, c] additive mask per block). c=512, tiles of 128 rows."""
    c, D = 512, 8
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, c, D, generator=gen) for _ in range(3))
    docs = _docs(1, 2 * c, gen, lengths=[300, 200, 400])
    kernel = AtenKernel()
    for name, mask in (("window-off-diag", BlockMask(c, c, lo=-c, hi=200 - c)),
                       ("window-diag", BlockMask(c, c, lo=0, hi=63)),
                       ("docs-causal", _doc_block(docs, 0, c, 0, c, lo=0)),
                       ("docs", _doc_block(docs, c, c, 0, c))):
        with _Largest() as seen:
            out, lse = kernel.forward(q, k, v, 0.3, mask)
            kernel.backward(torch.ones_like(q), q, k, v, out, lse, 0.3, mask)
        assert seen.largest <= 128 * c, (name, seen.largest, seen.op)  # one tile's mask, never c * c


def test_ring_loop_plans_blocks_without_dense_masks():
    """block_pairs hands kernels structured masks (views of the doc ids), not [c, c] tensors."""
    from ringmaster.attention.ring.loop import RingPlan, block_pairs

    S, P = 2048, 4
    docs = _docs(1, S, torch.Generator().manual_seed(5), lengths=[700, 500, 848])
    plan = RingPlan("head_tail", P, 1, S // (2 * P), window=300, docs=docs, runs=Runs.from_doc_ids(docs))
    with _Largest() as seen:
        pairs = [p for src in range(P) for p in block_pairs(plan, src, "cpu")]
    assert pairs and all(isinstance(m, BlockMask) and m.dense is None for _, _, m in pairs)
    assert seen.largest < (S // (2 * P)) ** 2, seen.largest


# -- Gemma-2 logit softcap and MLA head dims (D_qk != D_v) in every provider ----------------------

# (no cap, equal dims) is test_block_kernel_forward_backward_match_dense's case: not repeated here
CAP_DIMS = [(cap, dims) for cap in (None, 1.5) for dims in ((8, 8), (12, 8), (8, 12)) if cap or dims != (8, 8)]


@pytest.mark.parametrize("softcap, dims", CAP_DIMS,
                         ids=[f"{'softcap' if c else 'nocap'}-d{d[0]}-{d[1]}" for c, d in CAP_DIMS])
@pytest.mark.parametrize("kid", [k[0] for k in KERNELS])
def test_block_kernel_softcap_and_head_dims_match_dense(kid, softcap, dims):
    """Forward and backward against dense fp64 attention with the cap inside the scores and value heads
    of another width, for every block kind the provider takes (aten CPU runs softcap blocks through the
    math kernel per tile: aten-tiled checks tiles of 3 rows). The cap is small (1.5) so that it bends
    most scores: a kernel that drops it is far off."""
    _, kernel, dense_ok = next(k for k in KERNELS if k[0] == kid)
    dk, dv = dims
    gen = torch.Generator().manual_seed(7)
    tol = dict(rtol=1e-9, atol=1e-9)
    checked = 0
    for B, (hq, hkv), sq, sk, _ in SHAPES:
        for name, mask, dense_only in _masks(B, sq, sk, gen):
            if dense_only and not dense_ok:
                continue
            q = torch.randn(B, hq, sq, dk, generator=gen, dtype=torch.float64) * 2
            k = torch.randn(B, hkv, sk, dk, generator=gen, dtype=torch.float64)
            v = torch.randn(B, hkv, sk, dv, generator=gen, dtype=torch.float64)
            scale = dk ** -0.5
            kernel.check(q, v, softcap)
            out, lse = kernel.forward(q, k, v, scale, mask, softcap=softcap)
            qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
            ref_out, ref_lse = reference_attention(qr, kr, vr, scale, _dense(mask, B, sq, sk), softcap=softcap)
            where = f"{kid} softcap={softcap} dims={dims} B={B} heads={hq}/{hkv} {sq}x{sk} mask={name}"
            assert out.shape == ref_out.shape, (where, out.shape)
            torch.testing.assert_close(out.double(), ref_out, **tol, msg=where)
            finite = ~torch.isneginf(ref_lse)
            assert torch.equal(torch.isneginf(lse), ~finite), where
            torch.testing.assert_close(lse.double()[finite], ref_lse[finite], **tol, msg=where)
            dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
            (ref_out * dout).sum().backward()
            dq, dk_, dv_ = kernel.backward(dout, q, k, v, out, lse, scale, mask, softcap=softcap)
            for got, want, n in ((dq, qr.grad, "dq"), (dk_, kr.grad, "dk"), (dv_, vr.grad, "dv")):
                assert got.shape == want.shape, (where, n, got.shape)
                torch.testing.assert_close(got.double(), want, **tol, msg=f"{where} {n}")
            checked += 1
    assert checked >= 27, checked


def test_softcap_changes_the_result():
    """The cap is not a no-op at this scale (so the tests above can fail when a kernel drops it)."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    a, _ = get_kernel(RingImpl.MATH).forward(q, k, v, 0.35, "causal")
    b, _ = get_kernel(RingImpl.MATH).forward(q, k, v, 0.35, "causal", softcap=1.5)
    assert (a - b).abs().max() > 1e-2


def test_aten_cuda_refuses_softcap_with_the_fix():
    q = torch.empty(1, 2, 16, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(NotImplementedError, match="ring_impl='hf_kernels'.*ring_impl='math'.*backend='ulysses'"):
        AtenKernel().check(q, q, 30.0)
    AtenKernel().check(q, q, None)
    AtenKernel().check(torch.empty(1, 2, 16, 8), torch.empty(1, 2, 16, 8), 30.0)  # CPU: math per tile


def test_aten_cuda_mla_traces_on_meta():
    """MLA blocks reach aten's CUDA ops padded to one head dim; outputs and grads come back sliced."""
    gen = torch.Generator().manual_seed(9)
    q = torch.empty(2, 4, 16, 24, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 16, 24, dtype=torch.bfloat16, device="meta")
    v = torch.empty(2, 2, 16, 16, dtype=torch.bfloat16, device="meta")
    for name, mask, dense_only in _masks(2, 16, 16, gen):
        if dense_only:
            continue
        out, lse = AtenKernel().forward(q, k, v, 0.3, mask)
        assert out.shape == (2, 4, 16, 16) and lse.shape == (2, 4, 16), name
        dq, dk, dv = AtenKernel().backward(out.to(q.dtype), q, k, v, out, lse, 0.3, mask)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, name


def test_hub_kernel_without_softcap_is_refused_by_name():
    """A flash kernel whose functions take no ``softcap`` is refused (before any collective: the ring
    calls ``check`` first), naming the kernel and the fix; without a cap it still binds."""
    from types import SimpleNamespace

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            return_softmax):
        raise AssertionError("not called")

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, deterministic):
        raise AssertionError("not called")

    kernel = HfKernelsKernel("org/nocap", module=SimpleNamespace(_flash_attn_forward=_flash_attn_forward,
                                                                   _flash_attn_backward=_flash_attn_backward))
    q = torch.randn(1, 2, 4, 8)
    kernel.check(q, q, None)
    with pytest.raises(NotImplementedError, match=r"'org/nocap' takes no softcap.*30.0.*ring_impl='math'"):
        kernel.check(q, q, 30.0)
    with pytest.raises(NotImplementedError, match="takes no softcap"):
        kernel.forward(q, q, q, 0.3, None, softcap=30.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_aten_cpu_gqa_blocks_pass_kv_unexpanded(monkeypatch, causal):
    """The CPU flash op takes fewer K/V heads itself (torch 2.13): an unmasked or causal GQA block
    must not expand K/V to the query heads (a copy of both, forward and backward, every block: ~9%
    of a P=2 ring step), and its dK/dV come back per K/V head, exact."""
    from ringmaster.attention.ring import aten

    assert aten._cpu_gqa_native()
    monkeypatch.setattr(aten, "expand_heads", lambda *a: (_ for _ in ()).throw(AssertionError("K/V expanded")))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 32, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 32, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = as_block_mask("causal" if causal else None, 32, 32)
    kernel = AtenKernel()
    out, lse = kernel.forward(q, k, v, 0.25, mask)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_out, _ = reference_attention(qr, kr, vr, 0.25, _dense("causal" if causal else None, 1, 32, 32))
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (ref_out * dout).sum().backward()
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, 0.25, mask)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
