"""Autograd collectives and sequence gather against single-process references."""

import jobs
import pytest


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("P", [2, 4])
def test_collectives_forward_and_backward(pool, P, layout):
    for errs in pool.run(jobs.collectives, P, layout):
        assert max(errs.values()) <= 1e-6, errs
