"""The torch.distributed process group the workers join: students for their gradient sum,
and with NCCL transfer the teachers too."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Optional

from .cluster import tcp_init_method


@dataclass(frozen=True)
class World:
    """This worker's place in the process group, if it joins one: students are ranks
    0..S-1; with NCCL transfer the teachers join as ranks S..S+T-1."""
    rank: int
    size: int
    port: int
    students: int
    backend: str
    host: str = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worlds(transfer: str, num_teachers: int, num_students: int, device_type: str, *, sharded: bool = False,
           host: str = "127.0.0.1", port: Optional[int] = None) -> tuple[list, list]:
    """Each teacher's and student's `World` (or None): with NCCL transfer, teachers and
    students share one process group; otherwise students form their own when there are several,
    or always when ``sharded`` (FSDP2 needs a group, of one rank too). ``host`` / ``port``: the
    rendezvous address, on student-0's node (None: a port free here)."""
    port = free_port() if port is None else port
    backend = "nccl" if device_type == "cuda" else "gloo"
    if transfer == "nccl":
        size = num_students + num_teachers
        return ([World(num_students + t, size, port, num_students, backend, host) for t in range(num_teachers)],
                [World(r, size, port, num_students, backend, host) for r in range(num_students)])
    students = [World(r, num_students, port, num_students, backend, host) if num_students > 1 or sharded else None
                for r in range(num_students)]
    return [None] * num_teachers, students


def join_world(world: Optional[World]):
    """Joins the process group; returns the students' group for gradient sums (or None)."""
    if world is None:
        return None
    import torch.distributed as dist

    dist.init_process_group(world.backend, init_method=tcp_init_method(world.host, world.port), rank=world.rank,
                            world_size=world.size)
    if world.size == world.students:
        return dist.group.WORLD
    return dist.new_group(list(range(world.students)))  # every rank calls it, teachers too
