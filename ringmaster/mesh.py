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


_SPLITS: dict = {}


def cp_groups_ranks(device_mesh, cp_dim: str, cp_group) -> list[list[int]]:
    """Global ranks of every CP group in the job (each in CP-rank order)."""
    if device_mesh is None:
        return [dist.get_process_group_ranks(cp_group)]
    mesh = device_mesh[cp_dim]
    full = getattr(device_mesh, "mesh", None)
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if full is None or cp_dim not in names or full.dim() != len(names):
        return [list(mesh.mesh.flatten().tolist())]
    idx = names.index(cp_dim)
    return full.movedim(idx, -1).reshape(-1, full.shape[idx]).tolist()


def split_usp_groups(device_mesh, cp_dim: str, cp_group, ulysses_size: int, ring_size: int):
    """(ulysses_group, ring_group) for this rank: Ulysses over contiguous CP ranks (inside a node),
    Ring over the ranks at the same Ulysses index. A mesh that already has ``cp_ulysses`` and
    ``cp_ring`` dims (axolotl's RingmasterMesh) is used as is; otherwise the groups of every CP
    group in the job are created once (all ranks call this together) and cached."""
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if "cp_ulysses" in names and "cp_ring" in names:
        return device_mesh["cp_ulysses"].get_group(), device_mesh["cp_ring"].get_group()
    groups = cp_groups_ranks(device_mesh, cp_dim, cp_group)
    uly = [g[j * ulysses_size:(j + 1) * ulysses_size] for g in groups for j in range(ring_size)]
    ring = [g[i::ulysses_size] for g in groups for i in range(ulysses_size)]
    key = (tuple(map(tuple, uly)), tuple(map(tuple, ring)))
    if key not in _SPLITS:
        _SPLITS[key] = (dist.new_subgroups_by_enumeration(uly)[0], dist.new_subgroups_by_enumeration(ring)[0])
    return _SPLITS[key]
