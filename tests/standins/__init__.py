"""Test doubles that never ship in the wheel: CPU stand-ins of GPU-only packages and fp64 references.

- ``flash_repos``: hub-shaped local repositories of the flash kernels (FA2, FA3, vllm's FA3 with sinks,
  FA4) that ``kernels`` loads through ``LOCAL_KERNELS`` (tests/conftest.py sets it); FA2's math is the
  bench's ``ringmaster_tools.flash_standin``.
- ``kernels``: stand-in ``mamba_ssm`` / ``causal_conv1d`` / ``fla`` packages (``site/``), first on the
  ``sys.path`` of a separate worker pool only.
- ``fla_mamba``: the stand-in ``fla`` layers and hub repos of axolotl's ``mamba_backend: fla`` path.
- ``naive``: token-by-token fp64 references of every recurrent kind.

Importable as ``standins`` with ``tests/`` on ``sys.path`` (tests/conftest.py puts it there; worker
processes inherit it; benchmarks and tools insert it).
"""
