"""CPU stand-in for ``kernels-community/vllm-flash-attn3`` (see ringmaster.testing.flash_standin)."""
from ringmaster.testing.flash_standin.fa3 import VLLM as _VLLM

flash_attn_func = _VLLM.flash_attn_func
flash_attn_varlen_func = _VLLM.flash_attn_varlen_func
_flash_attn_forward = _VLLM._flash_attn_forward
_flash_attn_backward = _VLLM._flash_attn_backward
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "_flash_attn_forward", "_flash_attn_backward"]
STANDIN = "vllm-flash-attn3 (CPU stand-in)"
