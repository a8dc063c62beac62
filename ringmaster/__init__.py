"""ringmaster: composable long-context attention (Ulysses / Ring / USP context parallelism)
that wraps the kernels a Hugging Face model already uses, with architecture-aware wiring."""

from . import compat, mesh, shard
from .architectures import ArchitectureSpec, get_architecture, register_architecture
from .config import AUTO, Backend, LoadBalance, RingImpl, RingmasterConfig, RingmasterPlan, RotateMethod
from .errors import UnsupportedLayerError
from .recurrent.wiring import wire_recurrent_layers
from .attention.setup import setup
from .runtime import Runtime, runtime_of, teardown
from .sharding.batch import ContextParallelContextManager, gather_sequence
from .sharding.logprobs import token_logprobs
from .tiling import TiledHandle, tiled_mlp
from .wiring import WireReport, unwire, wire

__version__ = "0.1.0"


def __getattr__(name: str):
    """``rm.profile_comms`` / ``rm.profile_memory``: measurement tooling, loaded on first use so that
    ``import ringmaster`` (the training path) does not import it."""
    if name in ("profile_comms", "profile_memory"):
        from ringmaster_tools import profiling

        return getattr(profiling, name)
    raise AttributeError(f"module 'ringmaster' has no attribute {name!r}")

__all__ = [
    "AUTO",
    "ArchitectureSpec",
    "Backend",
    "ContextParallelContextManager",
    "LoadBalance",
    "RingImpl",
    "RingmasterConfig",
    "RingmasterPlan",
    "RotateMethod",
    "Runtime",
    "UnsupportedLayerError",
    "WireReport",
    "compat",
    "gather_sequence",
    "get_architecture",
    "mesh",
    "profile_comms",
    "profile_memory",
    "register_architecture",
    "runtime_of",
    "setup",
    "shard",
    "teardown",
    "TiledHandle",
    "tiled_mlp",
    "token_logprobs",
    "unwire",
    "wire",
    "wire_recurrent_layers",
]
