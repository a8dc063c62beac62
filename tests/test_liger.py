"""Liger-Kernel 0.8.5 under CP, on CPU: its Triton kernels (RMSNorm, SwiGLU / GeGLU, RoPE, the fused linear cross
entropy; Gemma's GeGLU at function level) run under Triton's interpreter in the real-kernel pool (tests/realkernels bridges the two gaps Liger hits:
float kernel arguments as fp32 scalars, libdevice functions imported by bare name). Patched as axolotl's plugin
does (the modeling classes, before the model is built) or on one instance; every worker's modeling module is
restored after each run.

Checked against the same model **without Liger and without CP** (fp32): the loss and every parameter's gradient
against its own norm (the fused head returns no logits in training), Ulysses, Ring and the documents mode, dense,
packed and sparse labels. And the loss path: Liger's fused loss called without ``num_items_in_batch`` (a mean
over the shard) is refused on every rank by the first CP forward's check, naming the keys; with the check's loss
test off (the mutation) it trains wrong."""

import jobs_liger as jl
import pytest

from ringmaster.architectures.mixing import LOSS_FIX

TOL = 1e-5        # loss, fp32
PARAM_TOL = 2e-5  # every parameter against its own norm (measured at most 1.1e-6)
ALL = jl.KERNELS

RUNS = {
    ("llama", "dense"): [("ulysses", ALL, "class"), ("ring", ALL, "instance")],
    ("llama", "packed"): [("ulysses", ALL, "instance"), ("documents", ALL, "class")],
    ("llama", "sparse"): [("ring", ALL, "class")],
}


@pytest.fixture(scope="module")
def liger_pool(real_pool):
    pytest.importorskip("liger_kernel", reason="liger-kernel is in the dev extra (pip install -e '.[dev]')")
    return real_pool


@pytest.mark.parametrize("model_type, batch", sorted(RUNS))
def test_liger_patched_model_is_exact_under_cp(liger_pool, model_type, batch):
    runs = RUNS[(model_type, batch)]
    for rank, results in enumerate(liger_pool.run(jl.cases, model_type, batch, runs)):
        for (layout, kernels, on), r in zip(runs, results):
            case = (rank, model_type, batch, layout, on)
            assert r["cp_size"] == 2 and not r["missing_grads"] and r["n_grads"] == r["n_params"], (case, r)
            if layout == "documents":
                assert r["layout"] == "documents" and 0.0 < r["split_fraction"] < 1.0, (case, r)
            # Liger really ran: its forward (the fused head), its rotary function, its modules on the class path
            assert r["liger"]["forward"].startswith("liger_kernel") and r["liger"]["rope"].startswith("liger_kernel"), r
            if on == "class":
                assert len(r["liger"]["modules"]) == 2, r   # its RMSNorm and its GLU MLP
            assert not r["after"]["modules"] and r["after"]["forward"].startswith("transformers"), r
            assert r["loss_err"] <= TOL and r["grad_err"] <= PARAM_TOL, (case, r)


def test_liger_geglu_runs_under_the_interpreter(liger_pool):
    """Gemma's GeGLU kernel (its tanh imported from libdevice by bare name: the interpreter's second gap) computes
    torch's tanh-approximated GELU times up, forward and backward (measured 1e-7; the stub returned None)."""
    assert liger_pool.run(jl.geglu_matches_torch)[0] <= 1e-5


def test_liger_fused_loss_without_num_items_is_refused_and_trains_wrong_unchecked(liger_pool):
    """Liger's fused linear cross entropy called without ``num_items_in_batch`` (a forward that drops it): a mean
    over the shard. Refused on every rank before backward under Ulysses, Ring and documents, the refusal naming
    the keys and the forward that dropped it. Mutation: without the check's loss test it runs, and its CP loss or
    gradient is off by more than 1e-3 (measured: loss 1.1e-4, whole gradient 2.2e-2)."""
    for r in liger_pool.run(jl.loss_refusals, ["ulysses", "ring", "documents"]):
        for layout, got in r.items():
            assert got["refused"] is not None and got["grads"] == 0, (layout, got)   # before any backward
            assert "the loss of" in got["refused"] and LOSS_FIX in got["refused"], (layout, got["refused"][:600])
            assert "jobs_liger.py" in got["refused"], got["refused"][:600]   # the forward that dropped the key
    for r in liger_pool.run(jl.loss_refusals, ["ulysses"], mutation="no_loss"):
        got = r["ulysses"]
        assert got["refused"] is None and max(got["loss_err"], got["grad_err_total"]) > 1e-3, r
