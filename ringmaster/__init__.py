"""ringmaster: composable long-context attention (Ulysses / Ring / USP context parallelism)
that wraps the kernels a Hugging Face model already uses, with architecture-aware wiring."""

from . import compat, mesh, shard
from .architectures import ArchitectureSpec, get_architecture, register_architecture
from .config import AUTO, Backend, LoadBalance, RingImpl, RingmasterConfig, RotateMethod
from .profiling import profile_comms, profile_memory
from .runtime import Runtime, setup, teardown
from .shard import ContextParallelContextManager, gather_sequence
from .strategies.state_passing import wire_recurrent_layers
from .wiring import UnsupportedLayerError, WireReport, unwire, wire

__version__ = "0.1.0"

__all__ = [
    "AUTO",
    "ArchitectureSpec",
    "Backend",
    "ContextParallelContextManager",
    "LoadBalance",
    "RingImpl",
    "RingmasterConfig",
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
    "setup",
    "shard",
    "teardown",
    "unwire",
    "wire",
    "wire_recurrent_layers",
]
