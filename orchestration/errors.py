"""What stops a run, each one line for the user: `orchestrate.py` maps them to exit codes
(usage 2, a worker 1, Ctrl-C 130) and prints no traceback unless ``--debug``."""
from __future__ import annotations


class UsageError(ValueError):
    """Bad options or a run that cannot start as asked; ``lines``: one per problem, each
    naming the option, the value and what is expected."""

    def __init__(self, lines):
        self.lines = [lines] if isinstance(lines, str) else list(lines)
        super().__init__("\n".join(self.lines))


class WorkerDied(RuntimeError):
    """A Ray worker's process died; the message names it (teacher-0, student-1, ...), the
    step and the last good checkpoint."""


class WorkerFailed(RuntimeError):
    """A worker raised an exception; the message names the worker, the step and the error."""


class Interrupted(Exception):
    """Ctrl-C: the run stopped after ``step`` and saved ``checkpoint`` (None: nothing saved)."""

    def __init__(self, step: int, checkpoint):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"interrupted after step {step}")
