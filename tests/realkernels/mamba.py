"""mamba-ssm's Triton kernels on CPU, from the source archive PyPI serves, for tests only.

mamba-ssm (2.3.2.post1) and causal-conv1d (1.7.0) are published as sdists only, and both builds compile CUDA
(pip fails at "Preparing metadata" without nvcc). Much of them is plain Python, though: :func:`load_mamba_ssm`
downloads the sdist once into a cache folder (``PyPI``'s JSON API, the archive's sha256 checked), extracts its
``mamba_ssm/**.py`` and registers ``mamba_ssm`` as a *bare* package (a module whose ``__path__`` is the extracted
folder, its ``__init__`` never run: that ``__init__`` imports ``selective_scan_cuda`` through
``mamba_ssm.ops.selective_scan_interface``). Submodules then import as usual from the archive's own files.
Call it with :func:`realkernels.enable` (``TRITON_INTERPRET=1``, the bridges) before anything imports triton or
transformers' modeling modules; :func:`realkernels.enable_all_in_worker` does both in a pool worker.

What runs and what does not (transformers 5.24 resolves these names; measured on CPU, Triton 3.9's interpreter):

* ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (Mamba2's SSD scan; ``initial_states``,
  ``seq_idx``, ``return_final_states``; forward and backward): pure Triton, **runs** under the interpreter with
  realkernels' bridges (:data:`RUNS`).
* ``mamba_split_conv1d_scan_combined`` (Mamba2's fused training block): imports, but its forward and backward
  call ``causal_conv1d.cpp_functions.causal_conv1d_{fwd,bwd}_function``, causal-conv1d's compiled CUDA
  extension (``causal_conv1d_cuda``); without it they are ``None`` and the call fails with ``TypeError``.
  :func:`load_mamba_ssm` sets the name to ``None`` in the module (``fused=False``, the default), so transformers
  resolves its own fallback (which returns None) and the mixer takes its unfused path: the SSD scan above.
* ``selective_scan_fn`` / ``mamba_inner_fn`` (Mamba1): ``mamba_ssm.ops.selective_scan_interface`` imports
  ``selective_scan_cuda`` (csrc/selective_scan, CUDA C++) at module level; there is no Triton selective scan in
  the package, so Mamba1 keeps transformers' torch fallback (:data:`CANNOT_RUN`).
* causal-conv1d: ``causal_conv1d/__init__`` imports ``causal_conv1d_interface``, which imports
  ``cpp_functions``, which imports ``causal_conv1d_cuda``; ``causal_conv1d_fn`` and ``causal_conv1d_update`` are
  ``torch.autograd.Function`` / custom ops around that extension, no Triton. Its pure-torch ``causal_conv1d_ref``
  is real code, but transformers looks up ``causal_conv1d_fn`` / ``causal_conv1d_update`` (at the package root),
  never ``causal_conv1d_ref``: it would resolve it only under a name we gave it (a stand-in of our making, which
  tests/standins/kernels already is). :func:`load_causal_conv1d_ref` imports the archive's interface module
  (``cpp_functions`` replaced by an empty module, so the compiled names are ``None``) for tests that call
  ``causal_conv1d_ref`` directly; nothing registers it as ``causal_conv1d``. Its Triton
  ``causal_conv1d_varlen_states`` (decoding-cache helper) enters ``torch.cuda.device(x.device.index)``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import types
import urllib.request
from pathlib import Path

# distribution -> (version, sha256 of the sdist, its URL as PyPI served it: used where the JSON API is unreachable)
SDISTS = {
    "mamba-ssm": ("2.3.2.post1", "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028",
                  "https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb/"
                  "mamba_ssm-2.3.2.post1.tar.gz"),
    "causal-conv1d": ("1.7.0", "3202758494eaa7b597ce1c282dfa188889506bfcb92cad3c407d26736bfcd32b",
                      "https://files.pythonhosted.org/packages/f4/d1/eba27735f31bd5527d39a3c7f693e6ded7b844cab275db719a15ad37b6cd/"
                      "causal_conv1d-1.7.0.tar.gz"),
}

RUNS = {
    "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined":
        "Mamba2's SSD scan, forward and backward, initial_states / seq_idx / return_final_states: Triton only",
}
CANNOT_RUN = {
    "mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined":
        "forward and backward call causal_conv1d_fwd_function / causal_conv1d_bwd_function from causal-conv1d's "
        "compiled extension causal_conv1d_cuda (None without it: TypeError)",
    "mamba_ssm.ops.selective_scan_interface.selective_scan_fn":
        "the module imports selective_scan_cuda (CUDA C++, csrc/selective_scan) at import; no Triton selective scan",
    "mamba_ssm.ops.selective_scan_interface.mamba_inner_fn": "the same module (selective_scan_cuda), and "
        "causal_conv1d_cuda",
    "causal_conv1d.causal_conv1d_fn": "a torch.autograd.Function around causal_conv1d_cuda (CUDA C++); the package "
        "__init__ imports it through cpp_functions",
    "causal_conv1d.causal_conv1d_update": "a custom op around causal_conv1d_cuda",
}

ENV_CACHE = "RINGMASTER_SDIST_CACHE"


def default_cache_dir() -> Path:
    """``$RINGMASTER_SDIST_CACHE``, else ``~/.cache/ringmaster/sdists``."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "ringmaster" / "sdists")


class Unavailable(RuntimeError):
    """The sdist could not be downloaded (no network, PyPI unreachable) and is not in the cache."""


def _sdist_url(dist: str, version: str) -> str:
    with urllib.request.urlopen(f"https://pypi.org/pypi/{dist}/json", timeout=30) as r:
        files = json.load(r)["releases"][version]
    return next(f["url"] for f in files if f["packagetype"] == "sdist")


def download(dist: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The sdist of ``dist`` (a key of :data:`SDISTS`) in ``cache_dir``, downloaded once, sha256 checked."""
    version, sha256, pinned_url = SDISTS[dist]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / pinned_url.rsplit("/", 1)[1]
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
        return path
    errors = []
    urls = []
    try:
        urls.append(_sdist_url(dist, version))
    except Exception as exc:  # noqa: BLE001 - fall back on the pinned URL
        errors.append(f"https://pypi.org/pypi/{dist}/json: {type(exc).__name__}: {exc}")
    urls += [pinned_url] if pinned_url not in urls else []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                data = r.read()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            errors.append(f"{url}: sha256 {got}, expected {sha256}")
            continue
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".part{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path
    raise Unavailable(f"{dist} {version}: the sdist could not be downloaded: " + "; ".join(errors))


def extract(dist: str, package: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding ``package`` (its ``.py`` files) from the sdist of ``dist``, extracted once."""
    archive = download(dist, cache_dir)
    root = archive.parent / archive.name.removesuffix(".tar.gz")
    if (root / package).is_dir():
        return root
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=archive.parent))
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and len(parts) > 2 and parts[1] == package and member.name.endswith(".py"):
                    target = tmp.joinpath(*parts[1:])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
        try:
            os.replace(tmp, root)
        except OSError:   # another process extracted it first
            if not (root / package).is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _bare_package(name: str, folder: Path, version: str) -> types.ModuleType:
    """``name`` as a package whose submodules come from ``folder``, its ``__init__.py`` not run."""
    existing = sys.modules.get(name)
    if existing is not None:
        if list(getattr(existing, "__path__", [])) == [str(folder)]:
            return existing
        raise RuntimeError(f"{name} is already imported from {getattr(existing, '__file__', existing)}: load it "
                           "before anything imports it (and before transformers imports a modeling module)")
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    module.__version__ = version
    module.__ringmaster_bare_sdist__ = str(folder)   # for the tests: the archive's package, __init__ not run
    sys.modules[name] = module
    return module


def load_mamba_ssm(cache_dir: str | os.PathLike | None = None, fused: bool = False) -> types.ModuleType:
    """``mamba_ssm`` importable from its sdist, its Triton SSD scan importable and run (under the interpreter
    where :func:`realkernels.enable` ran first). Returns ``mamba_ssm.ops.triton.ssd_combined``.

    ``fused=False``: ``mamba_split_conv1d_scan_combined`` is set to None there (it needs causal-conv1d's CUDA
    extension), so transformers resolves its fallback for it and Mamba2 mixers take their unfused path."""
    version = SDISTS["mamba-ssm"][0]
    root = extract("mamba-ssm", "mamba_ssm", cache_dir)
    _bare_package("mamba_ssm", root / "mamba_ssm", version)
    bridge_cpu_device()
    bridge_autotuner()
    ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    if not fused:
        ssd.mamba_split_conv1d_scan_combined = None
    return ssd


_CPU_BRIDGED = False
_AUTOTUNE_BRIDGED = False
PROGRAM_COST = 1024   # a program instance's fixed cost under the interpreter, in block elements


def bridge_autotuner() -> None:
    """Speed only, mamba-ssm's kernels only (realkernels' pick stays for every other kernel; idempotent).

    realkernels' autotuner bridge runs the config with the largest blocks (FLA's kernels tile the sequence, so
    large blocks mean few program instances). mamba-ssm's grids are ``batch * nchunks`` by ``nheads`` whatever the
    blocks, which tile only ``headdim`` / ``dstate`` / the chunk: there the largest config (128 x 256 x 64) is
    mostly masked-off work in every instance. Here a config costs its number of program instances (its grid,
    evaluated on the call's arguments) times ``max(product of its block sizes, PROGRAM_COST)``; the cheapest
    runs (ties keep the first). Every config computes the same thing."""
    global _AUTOTUNE_BRIDGED
    if _AUTOTUNE_BRIDGED:
        return
    import math

    from triton.runtime import autotuner

    import realkernels

    realkernels.bridge()
    largest = autotuner.Autotuner._bench

    def _bench(self, *args, config, **meta):
        fn = getattr(self, "base_fn", None)
        grid = meta.get("grid")
        if not (getattr(fn, "__module__", "") or "").startswith("mamba_ssm.") or grid is None:
            return largest(self, *args, config=config, **meta)
        size = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0)
        if callable(grid):
            grid = grid({**self.nargs, **meta, **config.all_kwargs()})
        programs = math.prod(grid)
        return [float(programs * max(size, PROGRAM_COST))] * 3

    autotuner.Autotuner._bench = _bench
    _AUTOTUNE_BRIDGED = True



def bridge_cpu_device() -> None:
    """mamba-ssm's launchers assume CUDA tensors in two places the interpreter does not need (idempotent):

    * every launch runs in ``with torch.cuda.device(x.device.index)``: a CPU tensor's index is None, which
      ``torch.cuda.device`` documents as a no-op but ``_exchange_device`` rejects (``TypeError``): a guard whose
      index is None (or negative) does nothing here;
    * three backward launchers (``_chunk_scan_bwd_dC``, ``_chunk_scan_bwd_dcb``, ``_chunk_state_bwd_db``) read
      ``torch.cuda.get_device_properties(device).multi_processor_count`` to split the heads over the GPU's SMs:
      a CPU device answers 1 SM (no split, the fewest program instances; the split partial sums are added
      after the kernel either way)."""
    global _CPU_BRIDGED
    if _CPU_BRIDGED:
        return
    import torch

    original_device, original_properties = torch.cuda.device, torch.cuda.get_device_properties

    class device(original_device):
        def __enter__(self):
            if self.idx is None or self.idx < 0:
                return None
            return super().__enter__()

        def __exit__(self, *exc):
            if self.idx is None or self.idx < 0:
                return False
            return super().__exit__(*exc)

    def get_device_properties(dev=None):
        if isinstance(dev, torch.device) and dev.type == "cpu":
            return types.SimpleNamespace(multi_processor_count=1, name="cpu (ringmaster test bridge)")
        return original_properties(dev)

    torch.cuda.device = device
    torch.cuda.get_device_properties = get_device_properties
    _CPU_BRIDGED = True


def load_causal_conv1d_ref(cache_dir: str | os.PathLike | None = None) -> types.ModuleType:
    """causal-conv1d's ``causal_conv1d_interface`` from its sdist, as a private module (never ``causal_conv1d``:
    transformers must not see it), its ``cpp_functions`` an empty module (the compiled functions ``None``).
    Its ``causal_conv1d_ref`` / ``causal_conv1d_update_ref`` run; ``causal_conv1d_fn`` does not."""
    name = "_ringmaster_causal_conv1d_sdist"
    if name + ".causal_conv1d_interface" in sys.modules:
        return sys.modules[name + ".causal_conv1d_interface"]
    version = SDISTS["causal-conv1d"][0]
    root = extract("causal-conv1d", "causal_conv1d", cache_dir)
    folder = root / "causal_conv1d"
    source = (folder / "causal_conv1d_interface.py").read_text()
    source = source.replace("from causal_conv1d.cpp_functions import", f"from {name}.cpp_functions import")
    _bare_package(name, folder, version)
    cpp = types.ModuleType(name + ".cpp_functions")
    cpp.causal_conv1d_fwd_function = cpp.causal_conv1d_bwd_function = cpp.causal_conv1d_update_function = None
    sys.modules[cpp.__name__] = cpp
    module = types.ModuleType(name + ".causal_conv1d_interface")
    module.__file__ = str(folder / "causal_conv1d_interface.py")
    exec(compile(io.StringIO(source).read(), module.__file__, "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    return module
