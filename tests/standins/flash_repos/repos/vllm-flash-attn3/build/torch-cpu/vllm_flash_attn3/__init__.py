"""CPU stand-in for ``kernels-community/vllm-flash-attn3`` (see standins.flash_repos)."""
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_TESTS = str(Path(__file__).resolve().parents[7])   # tests/, where the stand-in package lives
if _TESTS not in sys.path:   # a process that loads the repo through LOCAL_KERNELS only
    sys.path.append(_TESTS)

from standins.flash_repos.fa3 import VLLM as _VLLM

flash_attn_func = _VLLM.flash_attn_func
flash_attn_varlen_func = _VLLM.flash_attn_varlen_func
_flash_attn_forward = _VLLM._flash_attn_forward
_flash_attn_backward = _VLLM._flash_attn_backward
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "_flash_attn_forward", "_flash_attn_backward"]
STANDIN = "vllm-flash-attn3 (CPU stand-in)"
