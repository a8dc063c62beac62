"""The FA2 stand-in (:mod:`.fa2`) importable as the ``flash_attn`` package, for one block of code.

Why: ring-flash-attn and yunchang import ``flash_attn`` (``flash_attn.flash_attn_interface``'s
``_flash_attn_forward`` / ``_flash_attn_backward``, ``flash_attn_func``) at import time and have
no CPU path of their own. ``ringmaster bench`` measures them on CPU by importing them inside
:func:`as_flash_attn`, which puts module objects named ``flash_attn`` and
``flash_attn.flash_attn_interface`` (backed by the stand-in) in ``sys.modules`` and removes them on
exit. Libraries imported inside keep their references to the stand-in's functions; nothing else
in the process sees a ``flash_attn`` afterwards (transformers' availability checks stay false).

Only for benchmarks and tests: the stand-in is a test double (see :mod:`.core`), and a real
``flash_attn`` already importable wins (nothing is installed over it).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types

from . import fa2

# what flash_attn 2.x's version gates in the peers compare against (yunchang: >= 2.6.3 signature)
VERSION = "2.7.4"
NAMES = ("flash_attn", "flash_attn.flash_attn_interface")


def _module(name: str, is_package: bool) -> types.ModuleType:
    mod = types.ModuleType(name, f"{fa2.STANDIN}, standing in for {name}")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=is_package)
    if is_package:
        mod.__path__ = []
    for attr in fa2.__all__:
        setattr(mod, attr, getattr(fa2, attr))
    mod.__version__ = VERSION
    mod.STANDIN = fa2.STANDIN
    return mod


def real_flash_attn_installed() -> bool:
    return "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is not None


@contextlib.contextmanager
def as_flash_attn():
    """``import flash_attn`` gives the CPU stand-in inside the block (unless a real one is installed:
    then the block sees the real one and this does nothing). Yields the package module."""
    if "flash_attn" in sys.modules or real_flash_attn_installed():
        import flash_attn

        yield flash_attn
        return
    pkg, iface = _module("flash_attn", True), _module("flash_attn.flash_attn_interface", False)
    pkg.flash_attn_interface = iface
    sys.modules.update({"flash_attn": pkg, "flash_attn.flash_attn_interface": iface})
    try:
        yield pkg
    finally:
        for name in NAMES:
            if sys.modules.get(name) in (pkg, iface):
                del sys.modules[name]
