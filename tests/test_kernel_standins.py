"""ringmaster's recurrent kinds with the optional kernel packages *installed*, proven on CPU.

transformers resolves ``mamba_ssm`` / ``causal_conv1d`` / ``fla`` once, when a modeling module is imported
(``use_kernel_func_from_hub_with_fallback``). A separate 2-rank pool puts the CPU stand-ins of those
packages (``standins.kernels``: the real signatures, return conventions and quirks, pure
torch, fp64) first on its workers' ``sys.path`` before transformers runs, so the very same loading path a
GPU machine takes picks them up; the session's default pool and this process never see them.

Checked: every kernel name resolves to the stand-in; per-parameter fp64 parity at P=2, dense and packed,
for one family per kind (Mamba2, Mamba1, gated DeltaNet, KDA); ``recurrent="fla_cp"``, also under
``load_balance="documents"``; mutations (the stand-in ignoring its
initial state; ringmaster's Mamba1 map taken from mamba-ssm's ``return_last_state``, whose gradient the
real kernel drops) that the check must catch. The real kernels on a GPU: benchmarks/gpu_check.py.
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
    "mamba2": ("A_log", "dt_bias", "conv1d.weight"),
    "mamba": ("A_log", "dt_proj.bias", "conv1d.weight"),
    "qwen3_5_text": ("A_log", "dt_bias", "conv1d.weight"),
    "kimi_linear": ("A_log", "dt_bias", "conv1d.weight"),
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
    for package in ("mamba_ssm", "causal_conv1d", "fla"):
        spec = importlib.util.find_spec(package)
        assert spec is None or not (spec.origin or "").startswith(SITE), (package, spec)


def test_kernels_resolve_to_the_standins(standin_pool):
    for rank_result in standin_pool.run(jk.resolution):
        assert set(rank_result) == {f"{m}.{n}" for m, (_, names) in jk.RESOLVED.items() for n in names}
        for name, r in rank_result.items():
            assert r["standin"] and r["exported"], (name, r)
            # the package's own module, as the real kernel's: ringmaster cannot tell it from the real one
            assert r["module"].split(".")[0] in ("mamba_ssm", "causal_conv1d", "fla"), (name, r)
            assert r["package_file"].startswith(SITE), (name, r)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_exact_with_the_standin_kernels_fp64(standin_pool, model_type, packed):
    check_fp64(standin_pool.run(jk.parity, model_type, "scan", packed), FAMILIES[model_type])


def test_sequential_hands_the_state_to_mamba_chunk_scan_combined(standin_pool):
    """Mamba2's sequential strategy passes the state as the kernel's ``initial_states``."""
    check_fp64(standin_pool.run(jk.parity, "mamba2", "sequential"), FAMILIES["mamba2"])


@pytest.mark.parametrize("case", [("qwen3_5_text", False), ("qwen3_5_text", True), ("kimi_linear", False)],
                         ids=lambda c: f"{c[0]}-{'packed' if c[1] else 'dense'}")
def test_fla_cp_strategy_with_the_standin(standin_pool, case):
    """``recurrent="fla_cp"``: each row through FLA's ``cp_context`` (the stand-in's gathers the stream;
    the real FLA's exchange of states is a GPU check, benchmarks/gpu_check.py)."""
    model_type, packed = case
    check_fp64(standin_pool.run(jk.parity, model_type, "fla_cp", packed), FAMILIES[model_type])


def test_fla_cp_under_documents_with_the_standin(standin_pool):
    """``load_balance="documents"`` with ``recurrent="fla_cp"``: the split documents (contiguous under Ulysses)
    go through FLA's ``cp_context``, the whole ones run locally; pure Ring cuts them head_tail, refused by name."""
    results = standin_pool.run(jk.documents_parity, "qwen3_5_text", "ulysses")
    assert all(r["layout"] == "documents" and 0.0 < r["split_fraction"] < 1.0 for r in results), results
    check_fp64(results, FAMILIES["qwen3_5_text"])
    for out in standin_pool.run(jk.documents_parity, "qwen3_5_text", "ring"):
        assert "model.layers.0.linear_attn" in out["raised"] and "load_balance='auto'" in out["raised"], out


def test_fla_cp_is_refused_where_it_cannot_run(standin_pool):
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from ringmaster.recurrent.fla_cp import unavailable_reason

    # this process has no flash-linear-attention: transformers resolved the torch fallback
    reason = unavailable_reason(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    assert reason and "not flash-linear-attention's" in reason, reason
    for err in standin_pool.run(jk.fla_cp_refused_for, "mamba2"):
        assert "UnsupportedLayerError" in err and "does not offer recurrent='fla_cp'" in err, err
        assert "gated_deltanet" in err and "kda" in err, err


MARGIN = 100


def test_a_kernel_ignoring_its_initial_state_is_refused_by_the_wire_probe(standin_pool):
    """The FLA stand-in ignoring ``initial_state``: the probe sees the incoming state change nothing and
    refuses the layer, naming it and the kernel, before any CP step."""
    for out in standin_pool.run(jk.parity, "qwen3_5_text", "scan", False, "standin_ignores_initial_state"):
        assert "raised" in out, out
        assert "torch_chunk_gated_delta_rule" in out["raised"] and "model.layers.0.linear_attn" in out["raised"], out


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
