"""Which training rows each step trains on: drawn with replacement (`StepSampler`) or read in
epochs (`EpochSampler`), a function of (seed, step) either way."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .packing import DataPosition


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


class EpochSampler(StepSampler):
    """The micro-batches of a step read in epochs over ``num_rows`` rows: step ``s`` takes
    rows ``s·R .. (s+1)·R - 1`` of the stream (R = micro_batches · rows_per_micro_batch) in
    which epoch ``e`` visits every row once, in ``permutation(seed, e)`` order. The interface
    of `StepSampler`; its state (what the order depends on) must match on resume, and the
    data position after a step is `position` of the next."""

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))

    def position(self, step: int) -> DataPosition:
        """Where step ``step`` starts reading."""
        start = step * self.micro_batches * self.rows_per_micro_batch
        return DataPosition(start // self.num_rows, start % self.num_rows)

    def picks(self, step: int) -> list[torch.Tensor]:
        position, count = self.position(step), self.micro_batches * self.rows_per_micro_batch
        rows, epoch, index = [], position.epoch, position.index
        while sum(len(part) for part in rows) < count:
            order = self._order(epoch)
            take = min(count - sum(len(part) for part in rows), self.num_rows - index)
            rows.append(order[index:index + take])
            epoch, index = (epoch + 1, 0) if index + take == self.num_rows else (epoch, index + take)
        return list(torch.cat(rows).to(torch.int64).reshape(self.micro_batches, self.rows_per_micro_batch))

    def steps_for(self, epochs: int) -> int:
        """The steps that read ``epochs`` passes over the rows: ceil(epochs · num_rows / R),
        the last step's rows completed from the next pass's order when R does not divide."""
        return -(-epochs * self.num_rows // (self.micro_batches * self.rows_per_micro_batch))

    def state_dict(self) -> dict:
        return dict(super().state_dict(), kind="epochs")


def sampler_class(config) -> type:
    """The order a run reads its rows in: epochs for pre-tokenized data or when ``epochs`` is
    set, else steps drawn with replacement."""
    from .token_data import is_pre_tokenized

    return EpochSampler if config.epochs or is_pre_tokenized(config.data_path) else StepSampler
