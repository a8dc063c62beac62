"""CPU stand-in for ``kernels-community/flash-attn2`` (see ringmaster.testing.flash_standin)."""
from ringmaster.testing.flash_standin.fa2 import *  # noqa: F401,F403  (__all__ names the private ones too)
from ringmaster.testing.flash_standin.fa2 import __all__, STANDIN  # noqa: F401
