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

    @torch.no_grad()
    def row_log_probs(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 ``log_softmax`` of this worker's model (``self.model``, real vocab
        ``self.vocab``) at the flat rows ``rows`` ``[R]`` of ``tokens`` ``[B, T]``, on the CPU."""
        self.model.eval()
        self.model.to(self.device)  # an offloaded teacher comes back for it
        logits = self.model(input_ids=tokens.to(self.device)).logits
        picked = logits.reshape(-1, logits.shape[-1])[rows.to(self.device), :self.vocab]
        return torch.log_softmax(picked.float(), dim=-1).cpu()
