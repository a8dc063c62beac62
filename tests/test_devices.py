"""ringmaster's own collectives run on the group's device (issue 14).

An NCCL group has no CPU backend: a CPU tensor collective on it raises ``No backend type associated
with device type cpu``. ``init_process_group("cuda:gloo")`` builds the same kind of CUDA-only group
on this CPU build; a 2-rank pool runs on one. Every collective ringmaster issues on its own small
tensors (input check, token counts, logged losses) and those on activations (recurrent scan maps,
sequential state, attention all-to-all / all-gather) is called with fake CUDA tensors under a
recorder of every ``c10d`` op; each must issue at least one op, and every op only CUDA tensors.
Backward collectives are not run here (autograd on fake CUDA tensors needs the CUDA runtime); they
run on the gradients' device by construction (``empty_like`` of the activations).
"""

import jobs_devices as jd
import pytest
import torch

from ringmaster.comm import collective_device
from ringmaster.compat import config_device_types

OWN_SITES = ("validation", "pre_hook_validate", "pre_hook_token_count", "accelerate_count", "reduce_mean")
ACTIVATION_SITES = ("recurrent_scan", "recurrent_sequential", "attention_activations")


@pytest.fixture(scope="module")
def cuda_pool():
    from ringmaster_tools.pool import LocalPool

    pool = LocalPool(2, timeout=90, grace=10, backend="cuda:gloo")
    yield pool
    pool.close(force=True)   # nothing to flush: killing the workers is quicker than their gloo teardown


def off_device(ops, device_type="cuda"):
    """The recorded ``(site, op, devices)`` with a tensor anywhere else than ``device_type``."""
    return [(site, op, devices) for site, op, devices in ops if any(d != device_type for d in devices)]


def test_cuda_gloo_is_a_faithful_nccl_proxy(cuda_pool):
    """torch itself refuses a CPU tensor collective on the pool's group, as it does on NCCL."""
    for rank in cuda_pool.run(jd.proxy_is_faithful):
        assert rank["config"] == "cuda:gloo" and rank["types"] == ("cuda",), rank
        assert rank["cpu_error"] is not None and "No backend type associated with device type cpu" in rank["cpu_error"]


@pytest.mark.parametrize("batch_device", ["cuda", "cpu"])
def test_every_collective_runs_on_the_group_device(cuda_pool, batch_device):
    """``cuda``: batch and model on CUDA. ``cpu``: the batch is still on CPU while the group (and model)
    are CUDA: ringmaster's own tensors must go to the group's device, and results come back to the
    batch's device (the token count the loss divides by)."""
    for rank, res in enumerate(cuda_pool.run(jd.collective_sites, batch_device=batch_device)):
        ops, finished = res["ops"], res["finished"]
        assert off_device(ops) == [], (rank, off_device(ops))
        for site in OWN_SITES + ACTIVATION_SITES:
            assert any(s == site for s, _, _ in ops), (rank, site, "issued no collective", ops)
        assert finished["validation"] == finished["pre_hook_validate"] == "stopped at a host read"
        assert finished["pre_hook_token_count"].startswith(f"num_items_in_batch on {batch_device}"), finished
        assert finished["accelerate_count"] == finished["reduce_mean"] == f"on {batch_device}", finished
        send_recv = [op for s, op, _ in ops if s == "recurrent_sequential"]
        assert send_recv == (["c10d.send.default"] if rank == 0 else ["c10d.recv_.default"]), send_recv


def test_the_recorder_flags_a_cpu_collective(cuda_pool):
    """Control: the input check forced onto CPU (what ringmaster did before) is reported, and nothing else."""
    for res in cuda_pool.run(jd.collective_sites, force_cpu=True):
        flagged = off_device(res["ops"])
        assert flagged and {site for site, _, _ in flagged} == {"validation"}, res["ops"]
        assert all("cpu" in devices for _, _, devices in flagged)


def test_collective_device_per_group_kind(cuda_pool):
    """gloo-only (``cpu:gloo``), CUDA-only (``cuda:gloo``, as NCCL) and mixed groups (``gloo`` and
    ``cpu:gloo,cuda:gloo``: a CPU and a CUDA backend, the shape of ``cpu:gloo,cuda:nccl``)."""
    error = "error: the CP group has backends for device types [cuda] only"
    for res in cuda_pool.run(jd.group_devices):
        gloo_only, cuda_only = res["cpu:gloo"], res["cuda:gloo"]
        assert gloo_only["types"] == ("cpu",)
        assert {v for k, v in gloo_only.items() if k != "types"} == {"cpu"}   # a CUDA tensor goes to CPU too
        assert cuda_only["types"] == ("cuda",)
        assert cuda_only["cuda"] == cuda_only["cpu+gpu"] == cuda_only["none+gpu"] == "cuda:0"
        assert cuda_only["none"].startswith(error) and cuda_only["cpu"].startswith(error)
        assert "init_process_group('cpu:gloo,cuda:nccl')" in cuda_only["cpu"]
        for mixed in ("gloo", "cpu:gloo,cuda:gloo"):
            row = res[mixed]
            assert set(row["types"]) == {"cpu", "cuda"}
            assert row["cuda"] == row["cuda+gpu"] == "cuda:0"   # the batch's device: no copy
            assert row["cpu"] == row["none"] == row["none+gpu"] == "cpu"


def test_config_device_types():
    assert config_device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert config_device_types("cuda:nccl") == ("cuda",)
    assert config_device_types("cpu:gloo,cuda:gloo") == ("cpu", "cuda")
    assert config_device_types("") == ()


def test_collective_device_without_a_process_group_raises_clearly():
    """No process group at all: torch's own error says so, before any tensor moves."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(ValueError, match="not been initialized"):
        collective_device(None, like=torch.zeros(1))
