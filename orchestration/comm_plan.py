"""Which teacher data-parallel rank feeds which student data-parallel rank.

The global batch of a step is split into ``num_micro_batches`` equal parts. The teacher
has ``teacher_ranks`` workers and the student ``student_ranks``; one must divide the other
(integer ratios both ways). Each teacher rank scores a contiguous range of micro-batches
and sends each one to the student rank that trains on it. Any other layout is refused,
since an uneven split would give some student ranks more tokens than others silently.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    micro_batch: int
    teacher_rank: int
    student_rank: int


@dataclass(frozen=True)
class CommPlan:
    teacher_ranks: int
    student_ranks: int
    num_micro_batches: int

    def __post_init__(self):
        for name in ("teacher_ranks", "student_ranks", "num_micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        larger, smaller = max(self.teacher_ranks, self.student_ranks), min(self.teacher_ranks, self.student_ranks)
        if larger % smaller:
            raise ValueError(f"teacher_workers, student_workers: expected one to divide the other (integer ratios "
                             f"only), got {self.teacher_ranks} and {self.student_ranks}")
        if self.num_micro_batches % larger:
            raise ValueError(f"micro_batches: expected a multiple of {larger} (the larger of teacher_workers and "
                             f"student_workers), got {self.num_micro_batches}")

    def teacher_of(self, micro_batch: int) -> int:
        return micro_batch * self.teacher_ranks // self.num_micro_batches

    def student_of(self, micro_batch: int) -> int:
        return micro_batch * self.student_ranks // self.num_micro_batches

    def routes(self) -> list[Route]:
        return [Route(m, self.teacher_of(m), self.student_of(m)) for m in range(self.num_micro_batches)]

    def micro_batches_of_teacher(self, rank: int) -> list[int]:
        return [route.micro_batch for route in self.routes() if route.teacher_rank == rank]

    def micro_batches_of_student(self, rank: int) -> list[int]:
        return [route.micro_batch for route in self.routes() if route.student_rank == rank]
