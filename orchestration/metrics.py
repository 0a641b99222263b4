"""metrics.jsonl: one JSON row per step, each step exactly once across resumes."""
from __future__ import annotations

import json
import os
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
    segment wrote it."""

    def __init__(self, path: str, resumed_step: Optional[int] = None):
        self.path = path
        kept = [row for row in read_rows(path) if row["step"] <= resumed_step] if resumed_step is not None else []
        self.segment = max((row.get("segment", 0) for row in kept), default=-1) + 1
        staging = path + ".tmp"
        with open(staging, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(staging, path)
        self._file = open(path, "a")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(dict(row, segment=self.segment)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
