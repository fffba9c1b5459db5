"""One named device mesh for all parallelism: ``("dp", "cp")``.

``dp`` is sample (data) parallelism: each data-parallel group trains on its share of every
global batch and ``DistributedDataParallel`` averages the gradients over the groups.
``cp`` is context parallelism (paper Appendix B): the ranks of one context-parallel group
hold the same samples and split their tokens. ``R`` ranks form a ``dp x cp = R`` mesh;
e.g. four GPUs as two data-parallel groups of two context-parallel ranks (the paper's
DrivAerML setting, twice). The mesh is built once, at start-up, by :func:`launch` (or
:func:`plan_for_mesh` on a mesh built elsewhere) and handed down as a
:class:`ParallelPlan`; nothing else creates process groups. The backend follows the
device: NCCL for CUDA, gloo for the CPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "cp")


@dataclass(frozen=True)
class ParallelPlan:
    """The parallel layout of this process: its groups, ranks and sizes along each dim."""

    mesh: DeviceMesh | None = None
    dp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp_group is None else dist.get_rank(self.dp_group)

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else dist.get_world_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(self.cp_group)

    @property
    def is_writer(self) -> bool:
        """Rank 0 of the whole job writes files and prints."""
        return self.mesh is None or dist.get_rank() == 0

    def describe(self) -> str:
        if self.mesh is None:
            return "single process"
        return (f"mesh dp={self.dp_size} x cp={self.cp_size} "
                f"({dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()})")


SINGLE = ParallelPlan()


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def mesh_shape(world_size: int, *, data_parallel: bool, context_parallel: int | None
               ) -> tuple[int, int]:
    """``(dp, cp)`` for ``world_size`` ranks.

    ``context_parallel``: ranks per context-parallel group (``0`` means all ranks);
    ``None`` means none. Data parallelism takes the remaining factor; without
    ``data_parallel`` it must be 1.
    """
    cp = 1 if context_parallel is None else (world_size if context_parallel == 0
                                             else int(context_parallel))
    if cp <= 0 or world_size % cp:
        raise ValueError(f"--context-parallel {cp}: the {world_size} ranks of this job do not "
                         f"split into context-parallel groups of {cp}")
    dp = world_size // cp
    if dp > 1 and not data_parallel:
        raise ValueError(f"{world_size} ranks with context-parallel groups of {cp} leave "
                         f"{dp} groups: pass --data-parallel to train them as data-parallel "
                         "replicas, or set --context-parallel to the number of ranks")
    return dp, cp


def plan_for_mesh(mesh: DeviceMesh) -> ParallelPlan:
    """The :class:`ParallelPlan` of a ``("dp", "cp")`` mesh; a size-1 dim has no group."""
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(f"expected a device mesh with dims {MESH_DIMS}, got "
                         f"{mesh.mesh_dim_names}")
    groups = {name: (mesh.get_group(name) if mesh.size(i) > 1 else None)
              for i, name in enumerate(MESH_DIMS)}
    return ParallelPlan(mesh, groups["dp"], groups["cp"])


def build_mesh(device: torch.device, dp: int, cp: int) -> DeviceMesh:
    """The ``("dp", "cp")`` mesh over the initialised default process group."""
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"mesh dp={dp} x cp={cp} does not match the {world} ranks")
    return init_device_mesh(torch.device(device).type, (dp, cp), mesh_dim_names=MESH_DIMS)


@contextlib.contextmanager
def launch(device: torch.device, *, data_parallel: bool = False,
           context_parallel: int | None = None, timeout_s: float = 600.0):
    """Join the ``torchrun`` job and yield its :class:`ParallelPlan` (destroyed on exit).

    Outside torchrun (no ``WORLD_SIZE``) with neither kind of parallelism asked for, yields
    :data:`SINGLE`. ``timeout_s`` bounds every collective, so a dead rank ends the job with
    an error instead of a hang.
    """
    if not data_parallel and context_parallel is None:
        yield SINGLE
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ and not dist.is_initialized()]
    if missing:
        raise ValueError(f"data or context parallelism needs a torchrun launch: environment "
                         f"variable {missing[0]} is not set (run `torchrun --nproc-per-node R "
                         "-m flarepp train ...`)")
    created = not dist.is_initialized()
    if created:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
    try:
        dp, cp = mesh_shape(dist.get_world_size(), data_parallel=data_parallel,
                            context_parallel=context_parallel)
        yield plan_for_mesh(build_mesh(device, dp, cp))
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
