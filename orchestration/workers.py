"""What every Ray worker of the driver has: the training rows (sent once), and the answers
the driver's supervision asks for (ping, process id, GPU)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .placement import gpu_identity


class Worker:
    """Base of the teacher and student workers. The training rows are sent to each worker
    once (`set_rows`): a step's calls then carry row indices, not tokens (a 128 KB tensor
    argument costs a Ray call several ms of serialization)."""

    rows: torch.Tensor  # [R, T] int64 tokens
    labels: torch.Tensor  # [R, T] int64 shifted labels

    def set_rows(self, rows: torch.Tensor, labels: torch.Tensor) -> None:
        self.rows, self.labels = rows, labels

    def micro_batch(self, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) ``[B, T]`` of the training rows ``pick`` ``[B]``."""
        return self.rows[pick], self.labels[pick]

    def ping(self) -> bool:
        """Answers once the worker is up and its earlier calls are done."""
        return True

    def pid(self) -> int:
        """This worker's process id (the driver writes them to workers.json)."""
        return os.getpid()

    def gpu(self) -> Optional[str]:
        """This worker's GPU UUID, or None without CUDA."""
        return gpu_identity()
