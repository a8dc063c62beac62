"""CPU stand-in for ``kernels-community/flash-attn3`` (see standins.flash_repos)."""
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_TESTS = str(Path(__file__).resolve().parents[7])   # tests/, where the stand-in package lives
if _TESTS not in sys.path:   # a process that loads the repo through LOCAL_KERNELS only
    sys.path.append(_TESTS)

from standins.flash_repos.fa3 import *  # noqa: F401,F403
from standins.flash_repos.fa3 import __all__  # noqa: F401

STANDIN = "flash-attn3 (CPU stand-in)"
