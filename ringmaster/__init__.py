"""ringmaster: composable long-context attention (Ulysses / Ring / USP context parallelism)
that wraps the kernels a Hugging Face model already uses, with architecture-aware wiring."""

from . import compat, mesh, shard
from .architectures import ArchitectureSpec, get_architecture, register_architecture
from .config import AUTO, Backend, LoadBalance, RingImpl, RingmasterConfig, RotateMethod
from .errors import UnsupportedLayerError
from .profiling import profile_comms, profile_memory
from .recurrent.wiring import wire_recurrent_layers
from .runtime import Runtime, runtime_of, setup, teardown
from .sharding.batch import ContextParallelContextManager, gather_sequence
from .wiring import WireReport, unwire, wire

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
    "runtime_of",
    "setup",
    "shard",
    "teardown",
    "unwire",
    "wire",
    "wire_recurrent_layers",
]
