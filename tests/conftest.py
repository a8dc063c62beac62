"""One pool of 4 CPU gloo ranks per test session (per pytest-xdist worker: the README's ``-n 2`` runs two, each
with its own pool, and ``--dist loadfile`` keeps a file's tests on one): spawning per test is too slow on 2 cores.

P=2 cases run on the first CP group of a ("dp", "cp") = (2, 2) mesh (the pool is solo: the other group leaves the job, so the group that runs it has both cores; modules that need every rank set ALL_GROUPS);
P=4 cases on (1, 4).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# flash-linear-attention (and mamba-ssm / causal-conv1d, where installed) are hidden from this process, the
# default pool and every subprocess: transformers then runs its torch kernels, which need no GPU. Their real
# kernels run only in the pools of tests/test_real_kernels.py, under Triton's interpreter (tests/realkernels).
import realkernels  # noqa: E402

realkernels.hide()

# The hub flash kernels resolve to ringmaster's CPU stand-in (``kernels``' LOCAL_KERNELS mechanism).
# Set before the pool starts, so every worker rank inherits it; entries the caller set win.
from standins.flash_repos import local_kernels  # noqa: E402

os.environ["LOCAL_KERNELS"] = local_kernels(os.environ.get("LOCAL_KERNELS"))

WORLD = 4


class PoolHolder:
    def __init__(self, world: int):
        self.world = world
        self._pool = None

    def run(self, fn, *args, **kwargs):
        from ringmaster_tools.pool import LocalPool

        if self._pool is None or self._pool.broken:
            # a failed job's peers: 8 s to report; a P=2 job runs on the first CP group only (solo)
            self._pool = LocalPool(self.world, timeout=240, grace=8, solo=True)
        return self._pool.run(fn, *args, **kwargs)

    def close(self):
        if self._pool is not None and not self._pool.broken:
            # nothing to flush (every job's result is back): killing the workers takes 0.1 s, their gloo teardown 2 s
            self._pool.close(force=True)


@pytest.fixture(scope="session")
def pool():
    holder = PoolHolder(WORLD)
    yield holder
    holder.close()


@pytest.fixture(scope="session")
def real_pool():
    """One solo pool of 4 ranks for the real optional kernels (tests/test_real_kernels.py, tests/test_real_mamba.py):
    each worker runs Triton's interpreter with the bridges, flash-linear-attention importable, and mamba-ssm's Triton
    kernels from its sdist (fetched here first; ``real_pool.mamba_unavailable`` says why not, where not)."""
    import realkernels.mamba as rkm
    from ringmaster_tools.pool import LocalPool

    assert realkernels.installed("fla"), ("flash-linear-attention is not installed: the dev extra installs it "
                                          "(pip install -e '.[dev]')")
    unavailable = None
    try:
        rkm.extract("mamba-ssm", "mamba_ssm")   # the workers load it from the cache, no download there
    except rkm.Unavailable as exc:
        unavailable = str(exc)
    pool = LocalPool(4, timeout=300, grace=15, solo=True, init=realkernels.enable_all_in_worker)
    pool.mamba_unavailable = unavailable
    yield pool
    pool.close(force=True)


# The longest files first (seconds, the suite run serially on 2 cores: 173, 74, 66, 41, 39, 39, 31, 30, 27, 27, 25,
# 23).
# Under the README's `-n 2 --dist loadfile` a worker takes the next file when it is free, in this order: the long
# files start first and the short ones fill the end, so no worker is left running a long file alone while the other
# idles (measured before: the last 12% of the tests took a fifth of the run). The order within a file is kept.
LONGEST_FIRST = ("test_compile_recurrent.py", "test_compile.py", "test_real_kernels.py", "test_heads.py",
                 "test_liger.py", "test_memory.py", "test_linear_recurrent.py", "test_real_mamba.py", "test_bench.py",
                 "test_recurrent_variants.py", "test_zoo.py", "test_mamba1.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order
