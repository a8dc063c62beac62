"""Mutation tests: a real bug in a recurrent CP mechanism must fail the model-level fp64 parity check.

Each case applies one mutation from jobs_mutations.py inside the pool workers (monkeypatched,
undone after), runs the fp64 per-parameter parity of test_hybrid_parity.py, and asserts the
check fails by a clear margin (>= MARGIN times its bound), then that the same run after the undo
passes (so the error is the mutation's, and the undo really restored the code).
"""

import jobs_mutations as jm
import pytest
from test_hybrid_parity import FP64_PARAM_TOL, FP64_SEQ, check_fp64

MARGIN = 100

CASES = [
    # mutation, model_type, P, strategy, parameter that must show the error (None: any)
    ("mamba2_decay_detached", "nemotron_h", 4, "scan", "mixer.A_log"),
    ("conv_halo_dropped", "qwen3_5_text", 4, "scan", "conv1d.weight"),
    ("conv_halo_dropped", "nemotron_h", 4, "scan", "conv1d.weight"),
    # recurrent="heads" moves the kernel's inputs after the conv: the conv before it keeps its halo
    ("conv_halo_dropped", "qwen3_5_text", 2, "heads", "conv1d.weight"),
    ("conv_halo_dropped", "nemotron_h", 2, "heads", "conv1d.weight"),
    ("gated_delta_state_dropped", "qwen3_5_text", 4, "scan", "linear_attn.A_log"),
    ("gated_delta_state_dropped", "qwen3_5_text", 4, "sequential", "linear_attn.A_log"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-P{c[2]}-{c[3]}" for c in CASES])
def test_mutation_fails_fp64_parity(pool, case):
    mutation, model_type, P, strategy, param = case
    results = pool.run(jm.mutated_parity, mutation, model_type, P, strategy, seq_len=FP64_SEQ)
    for rank, out in enumerate(results):
        if "raised" in out:
            continue
        r = out["mutated"]
        errs = {k: v for k, v in r["grad_errs"].items() if param in k}
        assert errs, (param, sorted(r["grad_errs"]))
        print(f"{mutation} {model_type} P={P} {strategy} rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, "
              f"{param} {max(errs.values()):.2e}, logits {r['logits_err']:.2e}, whole gradient {r['grad_err_total']:.2e}")
        assert max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
    check_fp64([out["clean"] for out in results], P)


def test_structural_zero_gradient_is_checked_against_its_module(pool):
    """Control of the metric: a key bias under position-free softmax has a zero gradient; against its own
    (noise) norm it reads O(1), listed as a structural zero it is checked ~0 next to k.weight's gradient."""
    r = pool.run(jm.structural_zero_metric, 2)[0]
    print(r["k_bias_max"], r["k_weight_max"], r["plain"]["k.bias"], r["listed"]["k.bias"])
    assert r["k_bias_max"] <= 1e-5 * r["k_weight_max"], r
    assert r["plain"]["k.bias"] > 1e-2, r["plain"]
    assert r["listed"]["k.bias"] <= 1e-5, r["listed"]
    assert max(v for k, v in r["listed"].items() if k != "k.bias") <= 1e-5, r["listed"]
