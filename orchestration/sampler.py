"""Which training rows each step trains on."""
from __future__ import annotations

from typing import Optional

import torch


class StepSampler:
    """The micro-batches of a step, ``micro_batches`` tensors of ``rows_per_micro_batch`` row
    indices drawn with replacement from ``num_rows``: a function of (seed, step) only, so a
    run resumed at a step sees exactly the data an uninterrupted run would. Its state (what
    the order depends on) goes into each checkpoint and must match on resume."""

    def __init__(self, seed: int, num_rows: int, micro_batches: int, rows_per_micro_batch: int):
        self.seed, self.num_rows = seed, num_rows
        self.micro_batches, self.rows_per_micro_batch = micro_batches, rows_per_micro_batch

    def picks(self, step: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(0, self.num_rows, (self.micro_batches, self.rows_per_micro_batch), generator=generator)
        return list(picks)

    def state_dict(self) -> dict:
        return dict(kind="seed_and_step", seed=self.seed, num_rows=self.num_rows, micro_batches=self.micro_batches,
                    rows_per_micro_batch=self.rows_per_micro_batch)

    def mismatch(self, state: dict) -> Optional[str]:
        """None if a checkpoint's sampler ``state`` gives this sampler's order; else how they differ."""
        ours = self.state_dict()
        differ = [f"{key} {state.get(key)!r} there, {value!r} here" for key, value in ours.items()
                  if state.get(key) != value]
        return "; ".join(differ) or None
