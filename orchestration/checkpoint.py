"""Checkpoints that a kill never leaves half written, and the newest one that verifies.

A checkpoint is a directory ``<output_dir>/checkpoints/step_<7 digits>/`` holding its files
and ``manifest.json`` (the step, each file's sha256 and size, and the caller's metadata).
`write` builds it under ``step_<N>.tmp``, fsyncs every file, writes the manifest last, and
renames the directory into place (``os.replace``): a checkpoint directory either has a
manifest whose hashes match or it is not a good checkpoint. `newest_good` walks them newest
first and names each one that does not verify. Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Callable, Optional

MANIFEST = "manifest.json"
_NAME = re.compile(r"^step_(\d{7,})$")


def directory_of(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def path_of(output_dir: str, step: int) -> str:
    """The checkpoint directory of the state after ``step``."""
    return os.path.join(directory_of(output_dir), f"step_{step:07d}")


def candidates(output_dir: str) -> list[str]:
    """Checkpoint directories (renamed into place, verified or not), newest step first."""
    root = directory_of(output_dir)
    if not os.path.isdir(root):
        return []
    named = [(int(match.group(1)), name) for name in os.listdir(root) if (match := _NAME.match(name))]
    return [os.path.join(root, name) for _, name in sorted(named, reverse=True)]


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write(directory: str, step: int, files: dict[str, Callable[[str], None]], metadata: dict) -> str:
    """Writes a checkpoint atomically: each ``files[name](path)`` writes one file; then the
    manifest (step, sha256 and size of each file, ``metadata``); then the rename. An older
    checkpoint of the same step is replaced. Returns ``directory``."""
    staging = begin(directory)
    for name, writer in files.items():
        writer(os.path.join(staging, name))
    return commit(directory, step, metadata)


def staging_of(directory: str) -> str:
    """Where the checkpoint ``directory`` is built before its rename."""
    return directory + ".tmp"


def begin(directory: str) -> str:
    """An empty staging directory for ``directory`` (an earlier one is deleted); its path.
    Writers (several processes may share it) fill it, then `commit` publishes it."""
    staging = staging_of(directory)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def commit(directory: str, step: int, metadata: dict) -> str:
    """Publishes the staging directory of ``directory`` once every file in it (subdirectories
    included) is written: fsyncs them, writes the manifest (relative path, sha256 and size of
    each, ``metadata``) and renames it into place. Returns ``directory``."""
    staging = staging_of(directory)
    entries = {}
    for root, _, names in sorted(os.walk(staging)):
        for name in sorted(names):
            path = os.path.join(root, name)
            _fsync(path)
            entries[os.path.relpath(path, staging)] = dict(sha256=sha256_of(path), bytes=os.path.getsize(path))
    manifest_path = os.path.join(staging, MANIFEST)
    with open(manifest_path, "w") as handle:
        json.dump(dict(step=step, files=entries, metadata=metadata), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for root, _, _ in os.walk(staging):
        _fsync(root)
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.replace(staging, directory)
    _fsync(os.path.dirname(directory))
    return directory


def verify(directory: str) -> Optional[str]:
    """None if the checkpoint's manifest is there and every file matches it; else what is wrong."""
    try:
        with open(os.path.join(directory, MANIFEST)) as handle:
            manifest = json.load(handle)
        files = manifest["files"]
        if not isinstance(manifest["step"], int) or not files:
            return "a manifest without a step or files"
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest ({error.__class__.__name__})"
    for name, entry in files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != entry["bytes"]:
            return f"{name} has {os.path.getsize(path)} bytes, the manifest says {entry['bytes']}"
        if sha256_of(path) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def read_manifest(directory: str) -> dict:
    with open(os.path.join(directory, MANIFEST)) as handle:
        return json.load(handle)


def newest_good(output_dir: str, skipped: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest checkpoint directory that verifies, or None; ``skipped`` gets one line for
    each newer one that does not."""
    for directory in candidates(output_dir):
        problem = verify(directory)
        if problem is None:
            return directory
        if skipped is not None:
            skipped(f"skipped checkpoint {directory}: {problem}")
    return None
