"""CPU stand-in for ``kernels-community/flash-attn2`` (see standins.flash_repos)."""
from ringmaster_tools.flash_standin.fa2 import *  # noqa: F401,F403  (__all__ names the private ones too)
from ringmaster_tools.flash_standin.fa2 import __all__, STANDIN  # noqa: F401
