"""Jobs for tests/test_real_mamba.py. They run only in the real-kernel pool (tests/conftest.py ``real_pool``), whose
workers call ``realkernels.enable_all_in_worker`` (Triton's interpreter, the bridges, ``mamba_ssm`` from its sdist) before
anything imports transformers, so ``modeling_mamba2`` resolves ``mamba_chunk_scan_combined`` to mamba-ssm's own
Triton kernel."""

from __future__ import annotations

import importlib
import inspect
import time

import torch

from ringmaster.recurrent.fla_cp import kernel_implementation   # what transformers' kernel wrapper calls

# modeling module -> {module-level kernel name: what it must resolve to (a qualified name) or "fallback"}
RESOLVED = {
    "transformers.models.mamba2.modeling_mamba2": {
        "mamba2_chunk_scan": "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined",
        "mamba2_split_conv1d_scan_combined": "fallback",   # needs causal_conv1d_cuda: set to None by the loader
        "causal_conv1d_fn": "fallback",                    # causal-conv1d imports causal_conv1d_cuda
        "causal_conv1d_update": "fallback",
        # mamba-ssm's Triton decode kernel (cached single-token decoding; not run here)
        "mamba2_selective_state_update": "mamba_ssm.ops.triton.selective_state_update.selective_state_update",
    },
    "transformers.models.mamba.modeling_mamba": {
        "mamba_selective_scan": "fallback",   # mamba_ssm.ops.selective_scan_interface imports selective_scan_cuda
        "causal_conv1d_fn": "fallback",
    },
}


def resolution(ctx) -> dict:
    """Every kernel name of :data:`RESOLVED`: the qualified name transformers resolved (``fallback`` for its own
    torch function), plus where ``mamba_ssm`` comes from."""
    import os

    import mamba_ssm

    out = {"mamba_ssm": getattr(mamba_ssm, "__ringmaster_bare_sdist__", getattr(mamba_ssm, "__file__", None)),
           "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for module_name, names in RESOLVED.items():
        module = importlib.import_module(module_name)
        for name in names:
            wrapped = getattr(module, name)
            impl = kernel_implementation(wrapped)
            out[f"{module_name}.{name}"] = ("fallback" if impl is inspect.unwrap(wrapped) or
                                            impl.__module__ == module_name else f"{impl.__module__}.{impl.__name__}")
    return out


def kernel_matches_reference(ctx, cases=((40, 12, True, True),)):
    """mamba-ssm's ``mamba_chunk_scan_combined`` (fp32, under the interpreter) against the stand-in's token-by-token
    reference (``standins.kernels.reference``, fp64): b=1, 8 heads of 16, 2 groups, state 16, D, dt_bias, softplus;
    ``(seqlen, chunk, initial_states?, seq_idx?)`` per case. Relative max errors of the output, the final state and
    every input's gradient, and the seconds forward and backward took. Rank 0 only (the others return {})."""
    if ctx.rank != 0:
        return {}
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    from standins.kernels import reference

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    out = {}
    for L, chunk, with_h0, with_seq_idx in cases:
        gen = torch.Generator().manual_seed(L + chunk)
        b, h, p, g, n = 1, 8, 16, 2, 16
        vals = {"x": torch.randn(b, L, h, p, generator=gen), "dt": torch.randn(b, L, h, generator=gen) * 0.5,
                "A": -torch.rand(h, generator=gen) - 0.5, "B": torch.randn(b, L, g, n, generator=gen),
                "C": torch.randn(b, L, g, n, generator=gen), "D": torch.randn(h, generator=gen),
                "dt_bias": torch.randn(h, generator=gen) * 0.1}
        if with_h0:
            vals["initial_states"] = torch.randn(b, h, p, n, generator=gen)
        seq_idx = None
        if with_seq_idx:   # three documents, cut inside chunks
            pos = torch.arange(L)[None]
            seq_idx = ((pos >= L // 3).int() + (pos >= 2 * L // 3).int()).int()
        gy = torch.randn(b, L, h, p, generator=gen)
        gf = torch.randn(b, h, p, n, generator=gen)

        def run(kernel, dtype):
            leaves = {k: v.detach().to(dtype, copy=True).requires_grad_() for k, v in vals.items()}
            t0 = time.perf_counter()
            y, final = kernel(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"],
                              dt_bias=leaves["dt_bias"], initial_states=leaves.get("initial_states"),
                              seq_idx=seq_idx, dt_softplus=True, return_final_states=True)
            t1 = time.perf_counter()
            ((y * gy.to(dtype)).sum() + (final * gf.to(dtype)).sum()).backward()
            t2 = time.perf_counter()
            return y, final, {k: v.grad for k, v in leaves.items()}, (t1 - t0, t2 - t1)

        y, final, grads, (fwd_s, bwd_s) = run(mamba_chunk_scan_combined, torch.float32)
        ry, rfinal, rgrads, _ = run(reference.mamba_chunk_scan_combined, torch.float64)
        key = f"L{L}-chunk{chunk}" + ("-h0" if with_h0 else "") + ("-seq_idx" if with_seq_idx else "")
        out[key] = {"errs": {"y": rel(y, ry), "final": rel(final, rfinal),
                             **{f"d{k}": rel(grads[k], rgrads[k]) for k in vals}},
                    "fwd_s": fwd_s, "bwd_s": bwd_s}
    return out


def mamba2_cases(ctx, cases, seq_len=64, overrides=None, mode="dense", doc_lens=None) -> list[dict]:
    """fp32 parity of the tiny Mamba2 at P=2 on mamba-ssm's kernel against the same model without CP (also on
    it): jobs_real_kernels.family_cases (one reference shared by the ``(backend, recurrent[, mutation])`` cases;
    the mutations of :data:`MUTATIONS` are added to its table), and the seconds the whole job took."""
    import jobs_real_kernels as jr

    for name, mutation in MUTATIONS.items():
        jr.MUTATIONS.setdefault(name, mutation)
    t0 = time.perf_counter()
    results = jr.family_cases(ctx, "mamba2", 2, mode, cases, seq_len=seq_len, overrides=overrides, doc_lens=doc_lens)
    for r in results:
        r["job_s"] = time.perf_counter() - t0
    return results


def conv_reference(ctx) -> dict:
    """causal-conv1d's own pure-torch ``causal_conv1d_ref`` (from its sdist; realkernels.mamba.load_causal_conv1d_ref)
    against transformers' Mamba2 torch fallback ``causal_conv1d_fn`` (the conv ringmaster's CP conv runs here),
    silu and none, fp32; and what the archive's ``causal_conv1d_fn`` does without its CUDA extension."""
    import torch.nn.functional as F
    from transformers.models.mamba2 import modeling_mamba2

    import realkernels.mamba as rkm

    interface = rkm.load_causal_conv1d_ref()
    fallback = kernel_implementation(modeling_mamba2.causal_conv1d_fn)
    gen = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(2, 6, 19, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    out = {"fallback_module": fallback.__module__}
    for activation in (None, "silu"):
        ref = interface.causal_conv1d_ref(x, w, bias, activation=activation)
        got = fallback(x, w, bias, activation=activation)
        out[f"err_{activation}"] = ((ref - got).abs().max() / ref.abs().max()).item()
    # causal_conv1d_ref with initial_states: the halo ringmaster concatenates is the same thing
    halo = torch.randn(2, 6, 3, generator=gen)
    with_state = interface.causal_conv1d_ref(x, w, bias, initial_states=halo, activation="silu")
    concat = F.silu(fallback(torch.cat([halo, x], dim=-1), w, bias)[..., 3:])
    out["err_initial_states_vs_halo"] = ((with_state - concat).abs().max() / with_state.abs().max()).item()
    try:
        interface.causal_conv1d_fn(x, w, bias, activation="silu")
        out["causal_conv1d_fn"] = "ran"
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        out["causal_conv1d_fn"] = f"{type(exc).__name__}: {exc}"
    return out


def mamba2_state_not_passed():
    """ringmaster's Mamba2 state passing off (``ringmaster.recurrent.mamba2.pass_state``): every shard starts
    from a zero state (``wire``'s probe calls the segment directly: only the parity check can see this)."""
    from ringmaster.recurrent import mamba2

    original = mamba2.pass_state

    def local_only(segments, strategy, group, layout, *path):
        return [seg.run(None) for seg in segments]

    mamba2.pass_state = local_only
    return lambda: setattr(mamba2, "pass_state", original)


MUTATIONS = {"mamba2_state_not_passed": mamba2_state_not_passed}


def split_part_pieces(ctx, lens=(13, 11), chunk=12) -> dict:
    """A ``load_balance="documents"`` split part as the compiled path runs it (``PiecesSegment`` over
    ``ChunkPieces.of(neutral=True)``: the first chunk's lone piece of a 13-token document, which the state
    enters and leaves, padded to 16 after it with the step size ``PAD_DT``), on mamba-ssm's real Triton SSD scan
    (interpreted, fp32), scan strategy; against each document alone on the fp64 reference kernel: the output and
    every input's gradient. ``zero_dt``: the mutation, padding ``dt = 0`` (``softplus(0 + dt_bias) > 0``: the padding
    decays the state the lone piece hands on), still claiming neutral. Rank 0 only (the others return {})."""
    if ctx.rank != 0:
        return {}
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    from standins.kernels import reference
    from test_linear_recurrent import _run, pieces_segments

    from ringmaster.recurrent.mamba2 import Mamba2Segment

    class ZeroDt(Mamba2Segment):
        def with_tensors(self, fn):
            return ZeroDt(self.kernel, fn(self.x), fn(self.dt), self.A, fn(self.B), fn(self.C), self.chunk_size, self.D,
                          self.dt_bias, self.dt_softplus, self.dt_limit, self.kwargs)

    gen = torch.Generator().manual_seed(7)
    b, h, p, g, n, L = 1, 2, 4, 1, 4, sum(lens)
    vals = {"x": torch.randn(b, L, h, p, generator=gen), "dt": torch.randn(b, L, h, generator=gen) * 0.5,
            "B": torch.randn(b, L, g, n, generator=gen), "C": torch.randn(b, L, g, n, generator=gen),
            "A": -torch.rand(h, generator=gen) - 0.5, "D": torch.randn(h, generator=gen),
            "dt_bias": torch.randn(h, generator=gen) * 0.1 + 0.5}
    gy = torch.randn(b, L, h, p, generator=gen)
    ends = torch.tensor(lens).cumsum(0).tolist()

    def leaves(dtype):
        return {k: v.detach().to(dtype, copy=True).requires_grad_() for k, v in vals.items()}

    def grads(y, t):
        (y * gy.to(y.dtype)).sum().backward()
        return {k: v.grad for k, v in t.items()}

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    r = leaves(torch.float64)
    ref = torch.cat([reference.mamba_chunk_scan_combined(
        *(r[k][:, s:e] for k in ("x", "dt")), r["A"], *(r[k][:, s:e] for k in ("B", "C")), 8, D=r["D"],
        dt_bias=r["dt_bias"], dt_softplus=True) for s, e in zip([0, *ends], ends)], dim=1)
    ref_grads = grads(ref, r)
    out = {}
    for name, seg in (("pad_dt", Mamba2Segment), ("zero_dt", ZeroDt)):
        t = leaves(torch.float32)
        segs = pieces_segments(lambda x, dt, B, C: seg(mamba_chunk_scan_combined, x, dt, t["A"], B, C, 8, t["D"],
                                                       t["dt_bias"], True), [t[k] for k in ("x", "dt", "B", "C")],
                               1, lens, chunk, neutral=True)
        y = _run(segs, "scan")
        errs = {"y": rel(y, ref.detach())}
        if name == "pad_dt":
            errs.update({f"d{k}": rel(v, ref_grads[k]) for k, v in grads(y, t).items()})
        out[name] = {"errs": errs, "L": segs[0].L}
    return out
