"""A rollout worker's flat parameter buffer shared once with the trainer on its GPU or node, and
the cross-process lock that guards it.

`WeightLock`: a small file holding one 8-byte little-endian word, the published
``weight_version``. Both sides take ``fcntl.flock(LOCK_EX)`` on their own open file description
of it: the rollout worker for a whole generation (reading the version it generates with), the
trainer for a whole update (writing the new version before it lets go). ``flock`` belongs to
the open file description, so two `WeightLock` objects of one file exclude each other within
one process too.

`share_flat_buffer` hands out a flat buffer (``flat_parameters``' layout) as a `SharedWeights`:
the layout (names, dtypes, shapes), and a handle that `map_shared` turns into a tensor of the
same memory in another process: on CUDA a CUDA IPC handle (``reduce_tensor``); on CPU the path of
a file in ``/dev/shm`` that the buffer lives in (``torch.from_file(..., shared=True)``). Files are
unlinked as soon as they are open: their paths are ``/proc/PID/fd/N`` of the sharing process, so
they vanish with it and a killed worker leaves nothing behind; a process of the same user on the
same node opens them by that path.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

SHARED_DIRECTORY = "/dev/shm"
_VERSION_BYTES = 8


def _anonymous_file(nbytes: int, prefix: str) -> tuple[int, str]:
    """(descriptor, ``/proc/PID/fd/N`` path) of a new file of ``nbytes`` (allocated, zeros) in
    `SHARED_DIRECTORY`, already unlinked."""
    descriptor, path = tempfile.mkstemp(dir=SHARED_DIRECTORY, prefix=prefix)
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError as error:
        os.close(descriptor)
        raise OSError(f"{SHARED_DIRECTORY}: could not allocate {nbytes} bytes for shared weights ({error}); a "
                      "container's /dev/shm is often 64 MiB: give it room for the student (e.g. docker run "
                      "--shm-size)") from error
    finally:
        os.unlink(path)
    return descriptor, f"/proc/{os.getpid()}/fd/{descriptor}"


class WeightLock:
    """One side's handle on a weight lock file (module docstring). ``path`` None creates the
    file (version 0; ``path`` then names it for the other side), else opens ``path``."""

    def __init__(self, path: Optional[str] = None):
        if path is None:
            self._keep, self.path = _anonymous_file(_VERSION_BYTES, "kd-weight-lock-")
        else:
            self._keep, self.path = None, path
        try:
            self._descriptor = os.open(self.path, os.O_RDWR)
        except OSError as error:
            raise OSError(f"lock_path: cannot open {self.path!r} ({error.strerror}); the rollout worker that "
                          "shared it must run on this node and be alive") from error

    @contextmanager
    def held(self) -> Iterator[float]:
        """Holds the lock (waits for the other side's hold to end); yields the seconds waited."""
        start = time.perf_counter()
        self.acquire()
        try:
            yield time.perf_counter() - start
        finally:
            self.release()

    def acquire(self) -> None:
        """Takes the lock (waits for the other side's hold); `release` lets it go. Taking it again
        through this object while held is a no-op (one open file description)."""
        fcntl.flock(self._descriptor, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self._descriptor, fcntl.LOCK_UN)

    def version(self) -> int:
        """The published weight_version (read it under the lock for one that cannot change)."""
        return int.from_bytes(os.pread(self._descriptor, _VERSION_BYTES, 0), "little")

    def publish(self, weight_version: int) -> None:
        """Writes ``weight_version`` (call it under the lock)."""
        os.pwrite(self._descriptor, int(weight_version).to_bytes(_VERSION_BYTES, "little"), 0)

    def close(self) -> None:
        for descriptor in (self._descriptor, self._keep):
            if descriptor is not None:
                os.close(descriptor)
        self._descriptor = self._keep = None


@dataclass(frozen=True)
class SharedWeights:
    """A rollout worker's flat parameter buffer as `share_flat_buffer` hands it out: the
    parameters' names, dtypes (as names) and shapes in ``flat_parameters`` order, the buffer's
    ``numel``, the handle `map_shared` maps (``(rebuild, args)`` on CUDA, a file path on CPU) and
    the `WeightLock` file's path."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    handle: Any
    lock_path: str

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtypes[0])


def file_backed_buffer(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, str]:
    """(a 1-D CPU tensor of ``numel`` zeros in shared memory, the descriptor that keeps its file,
    the path `map_shared` maps it by)."""
    descriptor, path = _anonymous_file(numel * dtype.itemsize, "kd-weights-")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype), descriptor, path


def share_flat_buffer(flat: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]], lock_path: str,
                      path: Optional[str] = None) -> SharedWeights:
    """``flat`` (the 1-D buffer ``named``'s tensors are views of, `flat_parameters` layout) as a
    `SharedWeights`: a CUDA buffer by CUDA IPC; a CPU buffer by ``path``, the one
    `file_backed_buffer` returned for it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if flat.is_cuda:
        handle = reduce_tensor(flat)
    elif path is None:
        raise ValueError("path: a CPU buffer is shared by the path of its file (file_backed_buffer), got None")
    else:
        handle = path
    return SharedWeights(tuple(name for name, _ in named),
                         tuple(str(tensor.dtype).removeprefix("torch.") for _, tensor in named),
                         tuple(tuple(tensor.shape) for _, tensor in named), flat.numel(), handle, lock_path)


def map_shared(shared: SharedWeights) -> torch.Tensor:
    """The 1-D tensor of ``shared``'s buffer in this process (same memory)."""
    if isinstance(shared.handle, str):
        if not os.path.exists(shared.handle):
            raise OSError(f"handle: {shared.handle!r} does not exist; the rollout worker that shared it must run on "
                          "this node and be alive")
        return torch.from_file(shared.handle, shared=True, size=shared.numel, dtype=shared.dtype)
    rebuild, arguments = shared.handle
    return rebuild(*arguments)
