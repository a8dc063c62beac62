"""A CPU stand-in for the Hugging Face hub flash kernels, loaded through ``kernels``' own
local-repository mechanism.

``repos/<name>/build/torch-cpu/`` is shaped like a hub kernel repository (a ``metadata.json``
and a Python package per build variant), so ``kernels.get_kernel("kernels-community/flash-attn2",
version=...)`` returns it when ``LOCAL_KERNELS`` maps the repo id to the folder. That is how CI
runs the flash paths (Ulysses with a hub kernel, Ring's hub block kernels) end to end on CPU:

    LOCAL_KERNELS="$(python -c 'import standins.flash_repos as s; print(s.local_kernels())')"

The functions keep each real interface's names, argument order and return values (FA2:
:mod:`.fa2`; FA3 and vllm's FA3 with sinks: :mod:`.fa3`; FA4: :mod:`.fa4`); the math is :mod:`.core` (tiled,
exact in fp32/fp64, flash backward from ``(out, lse)``). It is a test double: dropout, paged KV
and fp8 scales are refused, not emulated.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent / "repos"

# hub repository id -> folder under repos/
REPOS = {
    "kernels-community/flash-attn2": "flash-attn2",
    "kernels-community/flash-attn3": "flash-attn3",
    "kernels-community/vllm-flash-attn3": "vllm-flash-attn3",
    "kernels-community/flash-attn4": "flash-attn4",
}


def repo_path(repo_id: str) -> Path:
    """The local repository standing in for ``repo_id``."""
    try:
        return _HERE / REPOS[repo_id]
    except KeyError:
        raise KeyError(f"no CPU stand-in for {repo_id!r}; stand-ins exist for {sorted(REPOS)}") from None


def local_kernels(existing: str | None = None) -> str:
    """A ``LOCAL_KERNELS`` value mapping every stand-in repo id to its folder, after ``existing``
    entries (which win for ids they name)."""
    entries = [e for e in (existing or "").split(":") if e]
    named = {e.split("=", 1)[0] for e in entries}
    entries += [f"{rid}={repo_path(rid)}" for rid in REPOS if rid not in named]
    return ":".join(entries)
