"""DeepSpeed ZeRO under CP (issue 43): exact at every stage, for llama and the hybrids, however the model is wired.

On DeepSpeed's CPU accelerator over gloo, two ranks that are one CP group (DeepSpeed sees two data-parallel ranks
and averages their gradients: the single-device gradient under ringmaster's loss convention). Parameters are
partitioned as at real sizes (``stage3_param_persistence_threshold=0``). Each case: one step's loss against the
model without CP, and every parameter's gradient (``safe_get_full_grad``) against the same CP step without
DeepSpeed (same chunks, same rounding), each against its own norm.
"""

import jobs_deepspeed
import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is in the dev extra")


@pytest.fixture(scope="module")
def ds_pool():
    """Two ranks of their own: DeepSpeed's collectives (zero.Init's partitioning, its gradient reduction) run on the
    whole world, which the session pool's solo P=2 jobs do not occupy."""
    from ringmaster_tools.pool import LocalPool, torch_kernels_only

    pool = LocalPool(2, timeout=240, grace=8, init=torch_kernels_only)
    yield pool
    pool.close(force=True)

TOL = 1e-4   # fp32: DeepSpeed's gradient reduction order against plain CP's (measured <= 4e-6)
# gated DeltaNet's decay gate (g = -exp(A_log) * softplus(a + dt_bias)): the fp32 gradients of A_log and dt_bias are
# sums over every token that nearly cancel (against the model without CP A_log's error is 2.3e-3 on Ring, 1.2e-4 in
# heads mode), so DeepSpeed's rounding moves them more: measured against plain CP in heads mode under ZeRO-3, 1.7e-4
# (A_log) and 1.3e-4 (dt_bias) on one machine, under 1e-4 on another
TOL_CANCELLING = 1e-3
CANCELLING = ("A_log", "dt_bias")

CASES = [
    # the crash of issue 43: a hybrid HF built partitioned under zero.Init (Trainer(deepspeed=...), axolotl), wired
    # before deepspeed.initialize: the recurrent layers' wire-time probe gathers each layer's parameters
    ("gdn-hybrid", "ulysses", 3, "zero_init"),
    ("mamba2-hybrid", "ring-alltoall", 3, "zero_init"),
    # wired after deepspeed.initialize: DeepSpeed's hooks own the parameters, the probe stands down
    ("gdn-hybrid", "ring-alltoall", 3, "after"),
    ("llama", "ulysses", 3, "zero_init"),
    ("llama", "ring-alltoall", 1, "before"),
    ("mamba2-hybrid", "ulysses", 2, "after"),
    # recurrent="heads" under ZeRO-3 (per-head constants sliced from parameters DeepSpeed gathers): built under
    # zero.Init (the wire probe checks the heads on the gathered layer), and wired after initialize
    ("mamba2-hybrid", "ulysses-heads", 3, "zero_init"),
    ("gdn-hybrid", "ring-heads", 3, "after"),
]


@pytest.mark.parametrize("model, backend, stage, when", CASES)
def test_zero_stages_are_exact_under_cp(ds_pool, model, backend, stage, when):
    for r in ds_pool.run(jobs_deepspeed.zero_parity, model, backend, stage, when):
        assert not r["missing"] and r["params"] > 30, r            # every parameter has its gradient
        assert r["partitioned"] == (stage == 3), r                   # ZeRO-3 really partitioned them
        assert r["loss"] <= TOL, r
        worse = {n: e for n, e in r["grads"].items() if e > (TOL_CANCELLING if n.endswith(CANCELLING) else TOL)}
        assert not worse, (worse, r["truth"])


def test_mutation_probe_on_partitioned_parameters_crashes(ds_pool):
    """Mutation: the wire-time probe runs a zero.Init-partitioned hybrid's recurrent layer without gathering its
    parameters (what issue 43 found): rm.wire crashes on the placeholders."""
    with pytest.raises(Exception, match="size mismatch"):
        ds_pool.run(jobs_deepspeed.zero_parity, "gdn-hybrid", "ulysses", 3, "zero_init", probe_gathers=False)


def test_a_batch_per_rank_under_deepspeed_is_refused_naming_the_sampler(ds_pool):
    """DeepSpeed's loader and the HF Trainer with ``deepspeed=`` give every rank its own batch (they count the CP
    ranks as data-parallel): refused on every rank by the batch check (one all-gather of a fingerprint) before the
    step's CP collectives, the error saying how to sample per CP group."""
    for err in ds_pool.run(jobs_deepspeed.mismatched_batches):
        assert "the CP group disagrees on" in err and "tokens" in err, err
        assert "DeepSpeed's data loader" in err and "world_size // cp_size" in err, err


@pytest.mark.parametrize("stage", [2, 3])
def test_cpsfttrainer_with_deepspeed_is_exact(ds_pool, stage):
    """CPSFTTrainer with the HF Trainer's ``deepspeed=`` (accelerate's DeepSpeed path, ZeRO-2 and ZeRO-3; DeepSpeed
    averages the gradients over the CP group, its data-parallel world): three SGD steps match CPSFTTrainer without
    DeepSpeed, loss and weights. On this CPU host accelerate's DeepSpeed state counts one process and shards no data
    (``shards`` None); the sharding per CP group a GPU host needs is tested at the data loader
    (tests/test_adapters_trl.py)."""
    for r in ds_pool.run(jobs_deepspeed.sft_deepspeed, stage):
        assert r["shards"] is None, r
        assert len(r["losses"]) == 3 and r["weights_moved"] > 1e-3, r
        assert r["loss_err"] <= TOL and r["weight_err"] <= TOL, r


def test_deepspeed_jobs_compile_no_shared_memory_op(ds_pool):
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (minutes of C++ on a fresh machine, under
    a lock file that a rank killed by the pool's timeout leaves behind, after which every DeepSpeed rank on the machine
    hangs: CI at stop 59) and maps a 50 MB buffer per rank in /dev/shm that it never unlinks. Every DeepSpeed job here
    starts it without that op (``ringmaster_tools.pool.without_deepspeed_shm_comm``): nothing built, nothing mapped."""
    for r in ds_pool.run(jobs_deepspeed.shm_comm):
        assert not r["op_built"] and r["buffers"] == [], r
