"""CPU stand-ins for what axolotl 0.21's ``mamba_backend: fla`` loads, so its real code path runs on CPU.

axolotl's FLA Mamba backend (``axolotl.model_support.mamba``) keeps the transformers mixer and its
parameters, hangs a view of flash-linear-attention's layer on it (``mixer.fla_mixer``, a subclass of
``fla.layers.mamba.Mamba`` / ``fla.layers.mamba2.Mamba2``) and, on a CUDA machine, re-binds that
view's kernel names to the hub kernels ``kernels-community/mamba-ssm`` and
``kernels-community/causal-conv1d`` (``kernels.get_kernel``). Both are GPU-only; here they are:

* ``root/fla``: a stand-in ``fla`` package with only ``fla.layers.mamba.Mamba`` and
  ``fla.layers.mamba2.Mamba2`` (the interface those layers have: module-level kernel names, the conv
  kernels as instance attributes, ``cuda_kernels_forward`` and the pure-torch ``slow_forward`` /
  ``torch_forward``). Put :func:`root` on ``sys.path`` (or ``PYTHONPATH``) of a process of its own:
  another stand-in ``fla`` (``tests/standins/kernels``) must not share a process with it.
* ``repos/mamba-ssm``, ``repos/causal-conv1d``: hub-shaped local repositories that
  ``kernels.get_kernel`` loads when ``LOCAL_KERNELS`` maps the repo ids to them (:func:`local_kernels`),
  as ``tests/standins/flash_repos`` does for the flash kernels. The math is :mod:`.reference`.

A test double for tiny models: token loops, no Triton, no ``seq_idx``.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

REPOS = {
    "kernels-community/mamba-ssm": "mamba-ssm",
    "kernels-community/causal-conv1d": "causal-conv1d",
}


def root() -> str:
    """The folder holding the stand-in ``fla`` package (for ``sys.path`` / ``PYTHONPATH``)."""
    return str(_HERE / "root")


def repo_path(repo_id: str) -> Path:
    try:
        return _HERE / "repos" / REPOS[repo_id]
    except KeyError:
        raise KeyError(f"no CPU stand-in for {repo_id!r}; stand-ins exist for {sorted(REPOS)}") from None


def local_kernels(existing: str | None = None) -> str:
    """A ``LOCAL_KERNELS`` value mapping the mamba-ssm and causal-conv1d repo ids to their stand-ins,
    after ``existing`` entries (which win for ids they name)."""
    entries = [e for e in (existing or "").split(":") if e]
    named = {e.split("=", 1)[0] for e in entries}
    entries += [f"{rid}={repo_path(rid)}" for rid in REPOS if rid not in named]
    return ":".join(entries)
