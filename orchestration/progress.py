"""What the run is doing, on stderr: a tqdm bar (counts, rate, ETA) for each phase that can
count its work (tokenizer, encoding, teacher pretraining, training, held-out evaluation), a
line at the start and end of the others, and one-line notes. ``enabled=False`` keeps the
notes and drops the rest."""
from __future__ import annotations

import contextlib
import sys
import time


class _Silent:
    """A bar that shows nothing."""

    def update(self, count: int = 1) -> None:
        pass

    def set_postfix(self, refresh: bool = True, **values) -> None:
        pass


class Progress:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._interactive = sys.stderr.isatty()

    def note(self, line: str) -> None:
        """One line on stderr, shown even when progress is off (a skipped checkpoint, a stop)."""
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)

    @contextlib.contextmanager
    def bar(self, description: str, total: int, unit: str = "it", initial: int = 0, scale: bool = False):
        """A tqdm bar on stderr for ``total`` units of work; ``scale``: SI units (bytes)."""
        if not self.enabled:
            yield _Silent()
            return
        from tqdm import tqdm

        # a log file gets a line every 10 s instead of a redraw every 0.1 s
        with tqdm(total=total, initial=initial, desc=description, unit=unit, unit_scale=scale, file=sys.stderr,
                  dynamic_ncols=True, mininterval=0.1 if self._interactive else 10.0) as shown:
            yield shown

    @contextlib.contextmanager
    def phase(self, description: str):
        """A phase whose work cannot be counted: a line when it starts and one with its time."""
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        self.note(f"{description} ...")
        yield
        self.note(f"{description}: done in {time.perf_counter() - started:.1f} s")
