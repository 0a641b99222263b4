"""The fused worker (``placement=fused``): a teacher worker and a student worker in one Ray
actor, so one process and one CUDA context per GPU; the teacher's top-k reaches the
student through this process's table (`transfer.InProcess`), with no copy.

The driver still addresses ``teacher-R`` and ``student-R`` (`actors.Actors.start_fused`
routes each call to its role here). The actor runs its calls one at a time, in the order
the driver submits them: a step's scoring is submitted before the student step that waits
on it, so the student's ``ray.get`` of the teacher's replies finds them done; the
overlapped scoring of step i + 1 runs before the student's step i, so at most one extra
step of top-k is held.
"""
from __future__ import annotations

from typing import Any

from .workers import SharedLayouts


class FusedWorker:
    """The workers of one process by role (``"teacher"``, ``"student"``), built in the order
    given: the student last, so that it seeds this process's RNG last, as in its own process.
    They share one `workers.SharedLayouts`: a micro-batch's attention mask is built once, by
    whichever of them asks first."""

    def __init__(self, roles: list[tuple[str, type, tuple]]):
        self.roles = {}
        layouts = SharedLayouts()
        for role, cls, arguments in roles:
            self.roles[role] = cls(*arguments)
            self.roles[role].layouts = layouts

    def call(self, role: str, method: str, *args) -> Any:
        """``method(*args)`` of the worker of ``role``."""
        return getattr(self.roles[role], method)(*args)

    def ping(self) -> bool:
        """Answers once the actor is up and its earlier calls are done."""
        return True
