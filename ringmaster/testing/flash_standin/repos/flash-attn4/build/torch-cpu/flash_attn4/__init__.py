"""CPU stand-in for ``kernels-community/flash-attn4`` (see ringmaster.testing.flash_standin)."""
from ringmaster.testing.flash_standin.fa4 import *  # noqa: F401,F403
from ringmaster.testing.flash_standin.fa4 import __all__  # noqa: F401

STANDIN = "flash-attn4 (CPU stand-in)"
