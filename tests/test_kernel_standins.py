"""ringmaster's Mamba1 with the optional kernel packages mamba-ssm and causal-conv1d *installed*, on CPU stand-ins
of ``selective_scan_fn`` and ``causal_conv1d_fn`` (their real code is CUDA C++; what does run on CPU runs for real
instead: flash-linear-attention in tests/test_real_kernels.py, mamba-ssm's Triton SSD scan in
tests/test_real_mamba.py).

transformers resolves ``mamba_ssm`` / ``causal_conv1d`` once, when a modeling module is imported
(``use_kernel_func_from_hub_with_fallback``). A separate 2-rank pool puts the CPU stand-ins of those
packages (``standins.kernels``: the real signatures, return conventions and quirks, pure
torch, fp64) first on its workers' ``sys.path`` before transformers runs, so the very same loading path a
GPU machine takes picks them up; the session's default pool and this process never see them.

Checked: every kernel name resolves to the stand-in; per-parameter fp64 parity at P=2, dense and packed,
for Mamba1 (``mamba``); a mutation (ringmaster's Mamba1 map taken from mamba-ssm's
``return_last_state``, whose gradient the real kernel drops) that the check must catch. The real kernels on a
GPU: benchmarks/gpu_check.py.
"""

import importlib.util
import sys

import jobs_kernel_standins as jk
import pytest

from standins.kernels import SITE

P = 2
FP64_PARAM_TOL = 1e-5
FP64_TOL = 1e-10
FAMILIES = {   # model_type -> gradients that must be among the checked ones
    "mamba": ("A_log", "dt_proj.bias", "conv1d.weight"),
}


@pytest.fixture(scope="module")
def standin_pool():
    from ringmaster_tools.pool import LocalPool

    pool = LocalPool(P, timeout=240, grace=15, sys_path=(SITE,))
    yield pool
    pool.close(force=True)   # nothing to flush: killing the workers is quicker than their gloo teardown


def check_fp64(results, needed):
    for rank, r in enumerate(results):
        assert r["cp_size"] == P and r["recurrent_layers"] >= 1, r
        assert not r["missing_grads"] and r["n_grads"] == r["n_params"], (r["missing_grads"], r["n_grads"])
        for name in needed:
            assert any(name in k for k in r["grad_errs"]), (name, sorted(r["grad_errs"]))
        assert r["loss_err"] <= FP64_TOL and r["logits_err"] <= FP64_TOL, (rank, r["loss_err"], r["logits_err"])
        worst = {k: v for k, v in r["grad_errs"].items() if v > FP64_PARAM_TOL}
        assert not worst, (rank, worst)


def test_this_process_and_the_default_pool_never_see_the_standins():
    assert SITE not in sys.path
    for package in ("mamba_ssm", "causal_conv1d"):
        spec = importlib.util.find_spec(package)
        assert spec is None or not (spec.origin or "").startswith(SITE), (package, spec)


def test_kernels_resolve_to_the_standins(standin_pool):
    for rank_result in standin_pool.run(jk.resolution):
        assert set(rank_result) == {f"{m}.{n}" for m, (_, names) in jk.RESOLVED.items() for n in names}
        for name, r in rank_result.items():
            assert r["standin"] and r["exported"], (name, r)
            # the package's own module, as the real kernel's: ringmaster cannot tell it from the real one
            assert r["module"].split(".")[0] in ("mamba_ssm", "causal_conv1d"), (name, r)
            assert r["package_file"].startswith(SITE), (name, r)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_exact_with_the_standin_kernels_fp64(standin_pool, model_type, packed):
    check_fp64(standin_pool.run(jk.parity, model_type, "scan", packed), FAMILIES[model_type])


MARGIN = 100


def test_mamba1_map_from_the_kernels_last_state_fails_fp64_parity(standin_pool):
    """mamba-ssm's ``selective_scan_fn`` drops its last state's gradient: a map built from it keeps the loss
    and logits exact and silently cuts the gradient through the carried state. The per-parameter fp64
    check must catch it (what ringmaster did before it computed the end state itself)."""
    for rank, r in enumerate(standin_pool.run(jk.parity, "mamba", "scan", False, "mamba1_map_from_last_state")):
        assert "raised" not in r, r["raised"]
        errs = {k: v for k, v in r["grad_errs"].items() if "mixer.A_log" in k}
        assert errs, sorted(r["grad_errs"])
        print(f"mamba1_map_from_last_state rank {rank}: worst {r['worst_param']} {r['grad_err']:.2e}, "
              f"A_log {max(errs.values()):.2e}, loss {r['loss_err']:.2e}, logits {r['logits_err']:.2e}")
        assert max(errs.values()) >= MARGIN * FP64_PARAM_TOL, (rank, errs)
