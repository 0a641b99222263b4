"""metrics.jsonl: one JSON row per step, each step exactly once across resumes, and TensorBoard
event files beside it when the ``tensorboard`` package is installed (an optional extra)."""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional


def read_rows(path: str) -> list[dict]:
    """The well-formed rows of a metrics file (a line cut short by a kill is dropped)."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


class MetricsLog:
    """Appends one row a step to ``path``. A fresh run (``resumed_step`` None) starts an empty
    file, segment 0. A resumed run keeps the rows of steps up to ``resumed_step`` (the
    checkpoint's) and drops the later ones, which the resumed run computes again; its rows
    carry the next ``segment`` id, so each step appears once and every row says which run
    segment wrote it.

    With ``tensorboard``, every numeric value of a row is also written as a scalar to event
    files in ``tensorboard/`` beside ``path`` (``torch.utils.tensorboard.SummaryWriter``); when
    the package is not installed, it warns once and writes the JSONL alone."""

    def __init__(self, path: str, resumed_step: Optional[int] = None, *, tensorboard: bool = False):
        self.path = path
        kept = [row for row in read_rows(path) if row["step"] <= resumed_step] if resumed_step is not None else []
        self.segment = max((row.get("segment", 0) for row in kept), default=-1) + 1
        staging = path + ".tmp"
        with open(staging, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(staging, path)
        self._file = open(path, "a")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn("tensorboard is not installed: metrics go to metrics.jsonl only "
                              "(pip install tensorboard for event files)", stacklevel=2)
            else:
                self.writer = SummaryWriter(os.path.join(os.path.dirname(os.path.abspath(path)), "tensorboard"))

    def write(self, row: dict) -> None:
        """``row`` must hold an int ``step``; non-numeric values go to the JSONL only."""
        if not isinstance(row.get("step"), int):
            raise ValueError(f"row: expected an int 'step' key, got keys {sorted(row)}")
        self._file.write(json.dumps(dict(row, segment=self.segment)) + "\n")
        self._file.flush()
        if self.writer is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(name, value, row["step"])
            self.writer.flush()

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()
