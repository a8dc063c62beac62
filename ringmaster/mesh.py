"""Where the CP group comes from: a DeviceMesh's ``cp`` dim or the default process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def intra_node_size() -> int:
    """Ranks per node, from the launcher (torchrun's LOCAL_WORLD_SIZE) or the visible GPUs.

    Falls back to the world size (one node) when nothing says otherwise.
    """
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def cp_group_from(device_mesh=None, cp_dim: str = "cp"):
    """The process group of the CP dimension, checked before anything collective happens."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ringmaster needs torch.distributed initialised before setup: call "
            "torch.distributed.init_process_group(...) (torchrun does it for you)"
        )
    if device_mesh is None:
        return dist.group.WORLD
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if cp_dim not in names:
        raise ValueError(
            f"device_mesh has no {cp_dim!r} dim (dims: {names or 'unnamed'}); build it with "
            f"init_device_mesh(..., mesh_dim_names=(..., {cp_dim!r})) or pass cp_dim=<your dim name>"
        )
    return device_mesh[cp_dim].get_group()


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)
