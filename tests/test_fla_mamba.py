"""axolotl 0.21's ``mamba_backend: fla`` mixers under CP, through axolotl's real loading path on CPU.

The model is built by transformers with axolotl's own class patch mapping (its MambaMixer /
Mamba2Mixer holding a view of flash-linear-attention's layer); flash-linear-attention and the hub
kernels (kernels-community/mamba-ssm, causal-conv1d) are GPU-only, so a stand-in ``fla`` package and
hub-shaped stand-in repos (tests/standins/fla_mamba) are what that path loads here, and
axolotl's ``_bind_kernels`` (what it runs at construction on a CUDA machine) binds them through
``kernels.get_kernel``. The non-CP reference is axolotl's own CPU path (FLA's ``slow_forward`` /
``torch_forward``; for packed rows, axolotl's per-document split). Stand-in verified on CPU; not yet run
on a GPU.

The same pool also runs axolotl's default ``mamba_backend: transformers`` mixers (an instance-level
forward, ``_native_forward``, around its sample-packing class patch), whose reference is plain
transformers (packed: each document alone).

The stand-in ``fla`` and axolotl's class patches are process-wide, so these jobs run in a 2-rank pool
of their own, never in the session pool.
"""

import importlib.util

import jobs_fla_mamba
import pytest

# fp64 under keep_fp64: loss, logits and every parameter's gradient (against its own norm); measured <= 2e-15
TOL = 1e-10


def _missing() -> str | None:
    for name in ("axolotl", "peft", "kernels"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def fla_pool():
    from standins import fla_mamba as fla_mamba_standin
    from ringmaster_tools.pool import LocalPool

    pool = LocalPool(2, timeout=240, grace=15, sys_path=(fla_mamba_standin.root(),))
    yield pool
    # the idle workers are killed: a clean interpreter exit of a process holding transformers and axolotl
    # costs seconds, and nothing in them is left to flush
    pool.close(force=True)


def _exact(results):
    for rank, r in enumerate(results):
        assert r["fla_mixers"] == 1 and not r["missing_grads"], (rank, r)
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= TOL, (rank, r["worst_param"], r)


# each kind runs dense and packed, with and without LoRA, bound to the hub-kernel stand-ins or (a CPU-only
# axolotl) not. LoRA: in_proj + x_proj on Mamba1 (out_proj plain: axolotl keeps FLA's fused kernel, which
# ringmaster rebuilds around the adapted x_proj), in_proj + out_proj on Mamba2 (axolotl's adapter guard
# takes the unfused path)
LORA1, LORA2 = ("in_proj", "x_proj"), ("in_proj", "out_proj")
# (strategy "auto" is sequential at P=2; two cases take the all-gathered scan)
CASES = [
    ("mamba", False, (), True, "auto"),
    ("mamba", True, LORA1, True, "scan"),
    ("mamba2", False, LORA2, True, "scan"),
    ("mamba2", True, (), False, "auto"),
]


@pytest.mark.parametrize("model_type,packed,peft,bind,strategy", CASES,
                         ids=["mamba-dense", "mamba-packed-lora-scan", "mamba2-dense-lora-scan", "mamba2-packed-unbound"])
def test_fla_mixer_parity(fla_pool, model_type, packed, peft, bind, strategy):
    results = fla_pool.run(jobs_fla_mamba.fla_parity, model_type, packed=packed, peft=peft, bind=bind,
                           strategy=strategy)
    _exact(results)
    if peft:   # only the adapters train: each targeted projection's LoRA matrices have their gradient checked
        names = set(results[0]["grad_errs"])
        assert all("lora_" in k for k in names), names
        assert {t for t in peft if any(f".{t}.lora_A" in k for k in names)} == set(peft), names


@pytest.mark.parametrize("model_type,mutation", [("mamba", "state"), ("mamba2", "halo")])
def test_fla_mixer_mutation_fails_parity(fla_pool, model_type, mutation):
    """The carried scan state or the conv halo dropped on this path: the model-level check fails."""
    r = fla_pool.run(jobs_fla_mamba.fla_parity, model_type, mutate=mutation)[0]
    assert r["logits_err"] > 1e-5 and r["grad_err"] > 1e-3, r   # exact reads <= 1e-14


def test_fla_mamba_mixers_and_refusals(fla_pool):
    r = fla_pool.run(jobs_fla_mamba.mixers_and_refusals)[0]
    assert r["found"] == {"mamba": 1, "mamba2": 1, "plain_mamba": 0, "nemotron_h": 0}, r
    # the stand-in hub kernels (axolotl's bound kernel path, fused and unfused) compute FLA's torch path
    assert max(r["standin_err"].values()) <= 1e-12, r["standin_err"]
    for case, message in r["refused"].items():
        assert "backbone.layers.0.mixer" in message, (case, message)
    assert "dt_proj" in r["refused"]["dt_proj_adapter"] and "in_proj" in r["refused"]["dt_proj_adapter"]
    assert "conv1d" in r["refused"]["conv1d_adapter_after_wire"]
    assert "FLA_CONV_BACKEND" in r["refused"]["triton_backend"]
    assert "CUDA" in r["refused"]["unbound_on_cuda"]
    assert "replaced after ringmaster wired it" in r["refused"]["rebound_after_wire"]
    assert "already wired" in r["refused"]["wired_twice"]


def test_axolotl_plugin_accepts_fla_backend(fla_pool):
    """axolotl's own ContextParallelPlugin no longer refuses ``mamba_backend: fla``: one Trainer step of a
    PeftModel (LoRA on in_proj / out_proj, as axolotl's adapter load leaves it)."""
    for rank, r in enumerate(fla_pool.run(jobs_fla_mamba.plugin_step, 2, "mamba", peft=True)):
        assert r["fla_mixers"] == 1 and r["wired"][0].endswith("backbone.layers.0.mixer"), r
        assert r["trained"] and all("lora_" in n for n in r["trained"]), r["trained"]
        assert r["attn"].startswith("ringmaster"), r
        assert not r["missing"] and r["loss_err"] <= TOL, (rank, r["loss_err"], r["missing"])
        assert r["grad_err"] <= TOL, (rank, r["worst_param"], r["grad_err"])
        assert r["unwired"] and r["runtime_dropped"] and r["unload_logits_err"] == 0.0, r


# axolotl's default ``mamba_backend: transformers``: its mixers carry an instance-level forward
# (``_native_forward``) that ringmaster re-binds through (intercept.COMPOSABLE_FORWARDS)
@pytest.mark.parametrize("model_type,packed,strategy", [("mamba", False, "auto"), ("mamba", True, "scan"),
                                                        ("mamba2", False, "scan"), ("mamba2", True, "auto"),
                                                        ("falcon_mamba", True, "auto")],
                         ids=["mamba-dense", "mamba-packed-scan", "mamba2-dense-scan", "mamba2-packed",
                              "falcon_mamba-packed"])
def test_native_backend_parity(fla_pool, model_type, packed, strategy):
    """falcon_mamba: axolotl maps no mixer class, but its sample-packing patch wraps FalconMambaMixer.forward
    (class-level) with the same segments splitter."""
    for rank, r in enumerate(fla_pool.run(jobs_fla_mamba.native_parity, model_type, packed=packed,
                                          strategy=strategy)):
        mapped = model_type != "falcon_mamba"
        assert r["rebound"] and r["restored"], r
        assert r["axolotl_mixer"] == r["instance_forward"] == mapped, r
        # axolotl's wrapper around its packed-row splitter (sample_packing's class patch) around the mixer forward
        chain = ["_native_forward.<locals>.forward"] * mapped + ["_patch_mixer.<locals>.patched_forward"]
        assert r["chain"][:len(chain)] == chain, r
        assert r["recurrent_layers"] == 1 and not r["missing_grads"] and r["n_grads"] > 5, r
        assert max(r["loss_err"], r["logits_err"], r["grad_err"]) <= TOL, (rank, r["worst_param"], r)


@pytest.mark.parametrize("mutation,model_type,message", [
    ("no_composed_rebind", "mamba", "instance-level forward"),   # the re-bind through axolotl's chain skipped
    ("local_segments", "mamba", "seq_idx reached"),              # axolotl's per-shard documents kept
])
def test_native_backend_mutation_refused(fla_pool, mutation, model_type, message):
    """A mechanism of the composed path broken: wire or the first CP forward refuses, naming the layer."""
    r = fla_pool.run(jobs_fla_mamba.native_parity, model_type, packed=True, mutate=mutation)[0]
    assert message in r.get("error", "") and "backbone.layers.0.mixer" in r["error"], r
