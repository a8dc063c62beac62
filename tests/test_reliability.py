"""Bad inputs: every one gets its clear error on every rank, within seconds (no hang)."""

import time

import bad_inputs
import pytest


@pytest.mark.parametrize("scenario", bad_inputs.SCENARIOS, ids=[s.name for s in bad_inputs.SCENARIOS])
def test_bad_input_gets_a_clear_error(pool, scenario):
    start = time.monotonic()
    if scenario.rank:
        results = pool.run(bad_inputs.run_on_rank, scenario.name)
    else:
        results = [bad_inputs.run_locally(scenario.name)]
    assert time.monotonic() - start < 30, "took too long: a hang?"
    if scenario.name == "collective_timeout":
        assert results[0] == ("RuntimeError", "rank 0 failed before the collective (simulated)")
        results = results[1:]  # the peers are the ones that must explain the missing rank
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: {scenario.name} did not raise"
        name, message = result
        assert name == scenario.error, (rank, name, message)
        for fragment in scenario.fragments:
            assert fragment in message, (rank, fragment, message)


def test_there_are_at_least_twenty_kinds():
    assert len(bad_inputs.SCENARIOS) >= 20


def test_size_advice_fits_the_job():
    """The size error never suggests a 'cp' dim the job cannot hold (issue 39: 'a cp dim of 4' on 2 ranks)."""
    from ringmaster.attention.setup import size_mismatch_message

    two = size_mismatch_message(4, 2, 2, mesh=False)
    assert "set size=2" in two and "not possible here: this job has 2 ranks" in two, two
    assert "init_device_mesh" not in two, two
    four = size_mismatch_message(4, 2, 4)
    assert "set size=2" in four and "init_device_mesh(device, (1, 4), mesh_dim_names=('dp', 'cp'))" in four, four
    eight = size_mismatch_message(2, 4, 8, cp_dim="sp")
    assert "(4, 2), mesh_dim_names=('dp', 'sp'))" in eight and "device_mesh['sp'] has 4 ranks" in eight, eight
    assert "not possible" in size_mismatch_message(3, 2, 4)
