"""CPU stand-in for ``kernels-community/flash-attn3`` (see ringmaster.testing.flash_standin)."""
from ringmaster.testing.flash_standin.fa3 import *  # noqa: F401,F403
from ringmaster.testing.flash_standin.fa3 import __all__  # noqa: F401

STANDIN = "flash-attn3 (CPU stand-in)"
