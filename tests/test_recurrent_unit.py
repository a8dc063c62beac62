"""State passing and the conv halo against the token-by-token references.

Single-process tests split one sequence into shards (equal, uneven, tiny) and run the same
segment math the ranks run (local maps -> fp32 prefix in sequence order -> outputs), in
float64 with the naive kernels (exact to rounding) and in fp32 with transformers' own torch
kernels (chunk sizes that do not divide the shards). Pool tests run the real collectives
(all-gather / p2p, forward and backward) for contiguous and head_tail layouts.
"""

import jobs_recurrent as jr
import pytest
import torch

from standins import naive
from ringmaster.recurrent.conv import conv_with_halo, halos_from_tails
from ringmaster.recurrent.scan import simulate_scan, simulate_sequential

SPLITS = {
    "whole": [0, 24],
    "equal4": [0, 6, 12, 18, 24],
    "uneven": [0, 1, 2, 9, 24],           # tiny shards: state crosses several of them
    "head_tail4": [0, 3, 6, 9, 12, 15, 18, 21, 24],  # the 2P chunks of P=4 in sequence order
    "single_tokens": list(range(0, 8)) + [24],
}
MAMBA_SHAPES = [dict(h=4, g=1), dict(h=4, g=2), dict(h=6, g=3, p=2, n=3)]
GDN_SHAPES = [dict(hk=2, hv=2), dict(hk=2, hv=4), dict(hk=1, hv=3, dk=5, dv=2)]


def run(kind, kernel, inputs, bounds, strategy, chunk_size):
    segs = [jr.segment(kind, kernel, inputs, slice(a, b), chunk_size) for a, b in zip(bounds, bounds[1:])]
    outs = (simulate_scan if strategy == "scan" else simulate_sequential)(segs)
    return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)


def check_against_full(kind, kernel, inputs, bounds, strategy, chunk_size, tol):
    ref_in, cp_in = jr.leaves(inputs), jr.leaves(inputs)
    y_ref = jr.full_output(kind, kernel, ref_in, chunk_size)
    y = run(kind, kernel, cp_in, bounds, strategy, chunk_size)
    W = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(9), dtype=y_ref.dtype)
    (y_ref * W).sum().backward()
    (y * W).sum().backward()
    assert jr.rel(y, y_ref) <= tol, ("out", jr.rel(y, y_ref))
    for name in inputs:
        err = jr.rel(cp_in[name].grad, ref_in[name].grad)
        assert err <= tol, (name, err)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("shape", MAMBA_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_mamba2_state_passing_exact_float64(shape, split, strategy):
    check_against_full("mamba2", "ref", jr.mamba_inputs(**shape), SPLITS[split], strategy, 5, 1e-11)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_gated_delta_state_passing_exact_float64(shape, split, strategy):
    check_against_full("gated_deltanet", "ref", jr.gdn_inputs(**shape), SPLITS[split], strategy, 5, 1e-11)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
@pytest.mark.parametrize("chunk_size", [5, 16])
@pytest.mark.parametrize("split", ["equal4", "uneven", "head_tail4"])
@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
def test_state_passing_with_transformers_kernels(kind, split, chunk_size, strategy):
    """fp32 kernels, chunk sizes that do not divide the shards (or exceed them)."""
    make = jr.mamba_inputs if kind == "mamba2" else jr.gdn_inputs
    check_against_full(kind, "hf", make(dtype=torch.float32), SPLITS[split], strategy, chunk_size, 2e-5)


def test_kernels_agree_with_naive_reference():
    """The references define the recurrences the transformers kernels compute."""
    for kind, make in (("mamba2", jr.mamba_inputs), ("gated_deltanet", jr.gdn_inputs)):
        inputs = make(dtype=torch.float32)
        ref = jr.full_output(kind, "ref", {k: v.double() for k, v in inputs.items()})
        hf = jr.full_output(kind, "hf", inputs, chunk_size=7)
        assert jr.rel(hf, ref) < 1e-5, kind


def test_slow_decay_state_really_crosses_shards():
    """Guard against a vacuous grid: dropping the incoming state must change the outputs a lot,
    also on the last of many tiny shards (multi-hop)."""
    for kind, make in (("mamba2", jr.mamba_inputs), ("gated_deltanet", jr.gdn_inputs)):
        inputs = make()
        bounds = SPLITS["uneven"]
        segs = [jr.segment(kind, "ref", inputs, slice(a, b)) for a, b in zip(bounds, bounds[1:])]
        right = simulate_scan(segs)[-1]
        wrong = segs[-1].run(None)[0]
        assert jr.rel(wrong, right) > 1e-2, kind
        # and the state of the first two tokens alone still matters at the end (slow heads)
        segs2 = [jr.segment(kind, "ref", inputs, slice(a, b)) for a, b in ((0, 2), (2, 24))]
        skip = segs2[1].run(None)[0][:, -1]
        full = simulate_scan(segs2)[1][:, -1]
        assert jr.rel(skip, full) > 1e-4, kind


def test_scan_never_divides_by_a_decay():
    """A decay that underflows to exactly 0 (fast heads over a long chunk) must stay exact."""
    inputs = jr.mamba_inputs()
    inputs["A"] = inputs["A"].clone()
    inputs["A"][-1] = -1e4  # exp(A * dt) == 0
    check_against_full("mamba2", "ref", inputs, SPLITS["uneven"], "scan", 5, 1e-11)
    g = jr.gdn_inputs()
    g["g"] = g["g"].clone()
    g["g"][..., -1] = -1e4
    check_against_full("gated_deltanet", "ref", g, SPLITS["uneven"], "scan", 5, 1e-11)


@pytest.mark.parametrize("kernel_size", [2, 4])
@pytest.mark.parametrize("split", ["equal4", "uneven", "single_tokens"])
def test_conv_halo_single_process(split, kernel_size):
    """Halos built from zero-padded tails (chunks shorter than the halo included) give the full conv."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    inputs = jr.conv_inputs(k=kernel_size)
    full = naive.causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"], "silu")
    bounds = SPLITS[split]
    chunks = [inputs["x"][..., a:b] for a, b in zip(bounds, bounds[1:])]
    width = kernel_size - 1
    tails = [torch.nn.functional.pad(c[..., -width:], (max(0, width - c.shape[-1]), 0)) for c in chunks]
    halos = halos_from_tails(tails, [c.shape[-1] for c in chunks], width)
    for kernel in (naive.causal_conv1d_ref, causal_conv1d_fn):
        out = torch.cat([conv_with_halo(kernel, c, h, inputs["weight"], inputs["bias"], "silu")
                         for c, h in zip(chunks, halos)], dim=-1)
        assert jr.rel(out, full) < 1e-12


def test_conv_halo_compiles_once_over_chunks_shorter_than_the_conv():
    """The halo of a chunk (``_tail``, ``halos_from_tails``) as a compiled block sees it: the chunk lengths are dynamic
    sizes, and a chunk shorter than the conv's reach takes the same graph as a longer one (before: ``max(0, L - w)``
    and ``min(L, w)`` branched on the length, one more graph for a documents part of 2 tokens, late in training).
    Every length exact against the full conv."""
    import torch._dynamo
    from ringmaster.recurrent.conv import _tail

    inputs = jr.conv_inputs(k=4)
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    full = naive.causal_conv1d(x, weight, bias, "silu")
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    def second_chunk(first, second):
        halos = halos_from_tails([_tail(first, 3), _tail(second, 3)], [first.shape[-1], second.shape[-1]], 3)
        return conv_with_halo(naive.causal_conv1d_ref, second, halos[1], weight, bias, "silu")

    torch._dynamo.reset()
    compiled = torch.compile(second_chunk, backend=count, fullgraph=True, dynamic=True)
    for cut in (9, 2, 7, 3, 2, 12):   # the first chunk longer and shorter than the conv's 3 inputs of halo
        out = compiled(x[..., :cut], x[..., cut:])
        assert jr.rel(out, full[..., cut:]) < 1e-12, cut
    assert len(graphs) == 1, len(graphs)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- real collectives

POOL_CASES = [
    # P, layout, strategy
    (2, "contiguous", "scan"), (2, "contiguous", "sequential"),
    (4, "contiguous", "scan"), (4, "contiguous", "sequential"),
    (2, "head_tail", "scan"), (2, "head_tail", "sequential"),
    (4, "head_tail", "scan"), (4, "head_tail", "sequential"),
]


def _check(results, tol):
    for rank, errs in enumerate(results):
        for key, value in errs.items():
            if key != "bytes":
                assert value <= tol, (rank, key, value)


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"P{c[0]}-{c[1]}-{c[2]}")
def test_state_passing_collectives(pool, case, kind):
    P, layout, strategy = case
    _check(pool.run(jr.state_passing, P, layout, strategy, kind), 1e-11)


@pytest.mark.parametrize("strategy", ["scan", "sequential"])
def test_state_passing_collectives_uneven_shards(pool, strategy):
    for kind in ("mamba2", "gated_deltanet"):
        _check(pool.run(jr.state_passing, 4, "contiguous", strategy, kind, lengths=[1, 2, 13, 8]), 1e-11)


@pytest.mark.parametrize("layout", ["head_tail"])
def test_state_passing_collectives_transformers_kernels(pool, layout):
    for kind in ("mamba2", "gated_deltanet"):
        for strategy in ("scan", "sequential"):
            _check(pool.run(jr.state_passing, 4, layout, strategy, kind, kernel_name="hf", l=32, chunk_size=3), 3e-5)


@pytest.mark.parametrize("case", [(2, "contiguous", None), (4, "contiguous", None), (2, "head_tail", None),
                                  (4, "head_tail", None), (4, "contiguous", [2, 1, 13, 8])],
                         ids=["P2", "P4", "P2-head_tail", "P4-head_tail", "P4-uneven"])
def test_conv_halo_collectives(pool, case):
    P, layout, lengths = case
    _check(pool.run(jr.conv_halo, P, layout, lengths), 1e-12)
