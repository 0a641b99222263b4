"""The offline teacher cache: a directory of checksummed shards holding, for rows of a dataset,
the teacher's entries at every position (its top-k, `kd_kernels.TopK`, or its samples,
`kd_kernels.TeacherSamples`), written once by the teacher side and read back, in order and
with prefetch, by students that need no teacher model.

Layout of the directory:

- ``header.json``: what the entries are and what a run must match (`CacheHeader`).
- ``manifest.json``: the complete shards in order (file name, sha256, bytes, the row-id ranges
  they hold) and whether the writer finished.
- ``shard_000000.bin``, ...: a 64-byte preamble (magic, format version, rows, bytes a
  position), the index (int64 row ids ``[n]``, int64 byte offsets of each row's records
  ``[n + 1]``), then the records: ``[positions, S]`` uint8 of `cache_codec.Codec`.

Crash safety: a shard is written to a temporary name, fsynced and renamed, the directory
fsynced, and only then recorded in the manifest (itself written to a temporary, fsynced and
renamed). A writer reopened on the directory deletes temporaries and unrecorded shards and
continues after the last recorded one; a reader opens recorded shards only and checks each
one's sha256 before use.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields as dataclass_fields
from typing import Iterable, Iterator, Optional

import torch

import kd_kernels as kd

from .cache_codec import COMPACT_SCALE, ENCODINGS, SAMPLES_COMPACT_SCALE, Codec

FORMAT_VERSION = 2
KINDS = {"topk": ("lse",), "samples": ("log_threshold", "lse")}  # kind -> the per-position fields it may store
_HEADER = "header.json"
_MANIFEST = "manifest.json"
_TEMPORARY = ".tmp"
_MAGIC = b"KDTCACHE"
_PREAMBLE = struct.Struct("<8s4q")  # magic, format version, rows, bytes a position, 0
_PREAMBLE_BYTES = 64


class CacheMismatch(ValueError):
    """The cache was made for something else than this run (a field of its header differs)."""


class CacheCorrupt(RuntimeError):
    """A recorded shard is not what was written (checksum, preamble or index)."""


@dataclass(frozen=True)
class CacheHeader:
    """What a cache holds and what it was made from.

    kind: "topk" (entries of `kd.TopK`) or "samples" (of `kd.TeacherSamples`).
    encoding: "lossless" or "compact" (`cache_codec`).
    vocab_size, k: the teacher's vocab and the entries a position (top-k k or samples n).
    temperature: the teacher temperature τ_t of the entries.
    tokenizer_hash, data_hash, teacher: identities (`cache_identity`) the reader compares.
    fields: per-position float32 fields stored, a subset of `KINDS[kind]` in that order
        ("log_threshold" is required for samples).
    rows_per_shard: rows a shard holds (the last may hold fewer).
    positions_per_row: positions of every row, or None when rows differ in length.
    """

    kind: str
    encoding: str
    vocab_size: int
    k: int
    temperature: float
    tokenizer_hash: str
    data_hash: str
    teacher: dict = field(default_factory=dict)
    fields: tuple[str, ...] = ()
    rows_per_shard: int = 64
    positions_per_row: Optional[int] = None
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        object.__setattr__(self, "fields", tuple(self.fields))
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {sorted(KINDS)}, got {self.kind!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding: expected one of {ENCODINGS}, got {self.encoding!r}")
        allowed = KINDS[self.kind]
        if list(self.fields) != [name for name in allowed if name in self.fields]:
            raise ValueError(f"fields: expected a subset of {allowed} in that order for kind {self.kind!r}, "
                             f"got {self.fields!r}")
        if self.kind == "samples" and "log_threshold" not in self.fields:
            raise ValueError("fields: samples need 'log_threshold' (their estimator's weights follow from it)")
        if not isinstance(self.rows_per_shard, int) or self.rows_per_shard < 1:
            raise ValueError(f"rows_per_shard: expected an int >= 1, got {self.rows_per_shard!r}")
        if self.positions_per_row is not None and (not isinstance(self.positions_per_row, int)
                                                   or self.positions_per_row < 1):
            raise ValueError(f"positions_per_row: expected an int >= 1 or None, got {self.positions_per_row!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"temperature: expected a number > 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))

    @property
    def codec(self) -> Codec:
        if self.encoding == "lossless":
            return Codec(self.encoding, self.vocab_size, self.k, self.fields)
        topk = self.kind == "topk"
        return Codec(self.encoding, self.vocab_size, self.k, self.fields, descending=topk,
                     scale=COMPACT_SCALE if topk else SAMPLES_COMPACT_SCALE)

    def to_json(self) -> dict:
        return dict(asdict(self), fields=list(self.fields), codec=self.codec.describe())

    @staticmethod
    def from_json(values: dict) -> "CacheHeader":
        known = {option.name for option in dataclass_fields(CacheHeader)}
        return CacheHeader(**{key: value for key, value in values.items() if key in known})


@dataclass(frozen=True)
class Expectation:
    """What a training run needs the cache to match; the reader refuses any difference.
    ``teacher`` is compared only when given (a run from a cache may not know its teacher)."""

    tokenizer_hash: str
    data_hash: str
    temperature: float
    k: int
    vocab_size: int
    kind: str = "topk"
    teacher: Optional[dict] = None


def check_expectation(header: CacheHeader, expectation: Expectation, directory: str) -> None:
    """Raises `CacheMismatch` naming the first field that differs, with both values."""
    pairs = [("format_version", header.format_version, FORMAT_VERSION)]
    pairs += [(option.name, getattr(header, option.name), getattr(expectation, option.name))
              for option in dataclass_fields(Expectation)]
    for name, cached, expected in pairs:
        if name == "teacher" and expected is None:
            continue
        if name == "temperature":
            cached, expected = float(cached), float(expected)
        if cached != expected:
            raise CacheMismatch(f"teacher cache {directory}: {name} is {cached!r} in the cache, this run expects "
                                f"{expected!r}")


def read_header(directory: str) -> CacheHeader:
    """The header of the cache in ``directory``; `CacheMismatch` when this code cannot read it
    (another format version, or encoding parameters other than this `cache_codec`'s)."""
    path = os.path.join(directory, _HEADER)
    if not os.path.exists(path):
        raise FileNotFoundError(f"teacher cache {directory}: no {_HEADER}; not a teacher cache directory")
    values = _read_json(path)
    if values.get("format_version") != FORMAT_VERSION:
        raise CacheMismatch(f"teacher cache {directory}: format_version is {values.get('format_version')!r} in the "
                            f"cache, this reader reads {FORMAT_VERSION!r}")
    header = CacheHeader.from_json(values)
    if values.get("codec") != header.codec.describe():
        raise CacheMismatch(f"teacher cache {directory}: codec is {values.get('codec')!r} in the cache, this "
                            f"reader's is {header.codec.describe()!r}")
    return header


def _entries_parts(entries, header: CacheHeader) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(logprobs, indices, fields) of a `kd.TopK` / `kd.TeacherSamples` for this header."""
    is_samples = hasattr(entries, "log_threshold")
    if is_samples != (header.kind == "samples"):
        raise ValueError(f"entries: a {type(entries).__name__}, the cache holds kind {header.kind!r}")
    if entries.temperature is not None and float(entries.temperature) != header.temperature:
        raise ValueError(f"entries: made at temperature {entries.temperature}, the cache's is {header.temperature}")
    parts = {}
    for name in header.fields:
        value = getattr(entries, name)
        if value is None:
            raise ValueError(f"entries.{name}: None, the cache stores {name} (header fields {header.fields})")
        parts[name] = value
    return entries.logprobs, entries.indices, parts


def _make_entries(header: CacheHeader, logprobs, indices, fields: dict):
    if header.kind == "topk":
        return kd.TopK(logprobs, indices, fields.get("lse"), header.temperature)
    return kd.TeacherSamples(logprobs, indices, fields["log_threshold"], fields.get("lse"), header.temperature)


# ---- files --------------------------------------------------------------------------------

def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """Writes ``path`` through a temporary file: fsync, rename, fsync of the directory."""
    temporary = path + _TEMPORARY
    with open(temporary, "wb") as handle:
        for chunk in chunks:
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def _write_json(path: str, value: dict, indent: Optional[int] = None) -> None:
    _write_atomically(path, [json.dumps(value, indent=indent, sort_keys=True).encode()])


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _ranges(rows: list[int]) -> list[list[int]]:
    """``[[start, stop), ...]``: the runs of consecutive ids in ``rows`` (in their order)."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    return runs


def _range_rows(ranges: list[list[int]]) -> torch.Tensor:
    if not ranges:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(start, stop, dtype=torch.int64) for start, stop in ranges])


def _as_rows(rows) -> torch.Tensor:
    rows = torch.as_tensor(rows)
    if rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool:
        raise ValueError(f"rows: expected a 1-D tensor of integer row ids, got {rows.dtype} {tuple(rows.shape)}")
    return rows.to(torch.int64).cpu()


# ---- writer -------------------------------------------------------------------------------

class TeacherCacheWriter:
    """Writes a cache; reopened on the same directory, continues after the last complete shard.

    ``add(rows, entries)`` buffers the entries of a batch of rows and writes every full shard;
    ``close()`` writes the rest as a last, shorter shard and marks the cache complete. Rows
    buffered when the process dies are lost: after reopening, `completed_rows` says what is
    on disk, and rows fed in the same order as before give the same shards as an
    uninterrupted run. Leaving a ``with`` block on an exception drops the buffer and leaves
    the cache incomplete.
    """

    def __init__(self, directory: str, header: CacheHeader):
        self.directory, self.header, self.codec = directory, header, header.codec
        os.makedirs(directory, exist_ok=True)
        header_path = os.path.join(directory, _HEADER)
        if os.path.exists(header_path):
            existing = read_header(directory)
            for option in dataclass_fields(CacheHeader):
                ours, theirs = getattr(header, option.name), getattr(existing, option.name)
                if ours != theirs:
                    raise CacheMismatch(f"teacher cache {directory}: {option.name} is {theirs!r} in the cache, "
                                        f"this writer has {ours!r}; write to another directory or delete it")
        else:
            _write_json(header_path, header.to_json(), indent=1)
        manifest_path = os.path.join(directory, _MANIFEST)
        if os.path.exists(manifest_path):
            self.manifest = _read_json(manifest_path)
        else:  # a new cache, or one whose writer died between the header and the first manifest
            self.manifest = dict(shards=[], complete=False)
            _write_json(manifest_path, self.manifest)
        self._remove_unrecorded()
        self._completed = [_range_rows(shard["rows"]) for shard in self.manifest["shards"]]  # a tensor a shard
        self._seen = set(torch.cat(self._completed).tolist()) if self._completed else set()  # completed + buffered
        self._buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, lengths, records)
        self._buffered_rows = 0

    def _remove_unrecorded(self) -> None:
        recorded = {shard["name"] for shard in self.manifest["shards"]}
        for name in os.listdir(self.directory):
            if name.endswith(_TEMPORARY) or (name.startswith("shard_") and name not in recorded):
                os.remove(os.path.join(self.directory, name))

    @property
    def completed_rows(self) -> torch.Tensor:
        """``[n]`` int64 ids of the rows in complete shards, in the order they were written."""
        return torch.cat(self._completed) if self._completed else torch.zeros(0, dtype=torch.int64)

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def add(self, rows, entries, lengths=None) -> None:
        """Buffers the entries of ``rows`` ``[B]`` int64 ids and writes every full shard.

        entries: `kd.TopK` (kind "topk") or `kd.TeacherSamples` (kind "samples") with the
            positions of the rows one after the other, ``[Σ lengths, k]``, on any device
            (encoded there; the bytes come to the CPU).
        lengths: ``[B]`` positions of each row; None: equal, ``entries`` rows / B.
        """
        logprobs, indices, fields = _entries_parts(entries, self.header)
        self.add_records(rows, self.codec.encode(logprobs, indices, fields), lengths)

    def add_records(self, rows, records: torch.Tensor, lengths=None) -> None:
        """`add` of entries already encoded with ``header.codec`` (``[Σ lengths, S]`` uint8, any
        device): a teacher worker can encode on its GPU and send these bytes instead."""
        rows = _as_rows(rows)
        size = self.codec.bytes_per_position
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != size:
            raise ValueError(f"records: expected [P, {size}] uint8 from the header's codec, got {records.dtype} "
                             f"{tuple(records.shape)}")
        lengths = self._lengths(rows, records.shape[0], lengths)
        row_ids = rows.tolist()
        if len(set(row_ids)) != len(row_ids):
            raise ValueError(f"rows: a row id appears twice in {row_ids}")
        present = [row for row in row_ids if row in self._seen]
        if present:
            raise ValueError(f"rows: row {present[0]} is already in the cache (or buffered)")
        self._seen.update(row_ids)
        self._buffer.append((rows, lengths, records.cpu()))
        self._buffered_rows += rows.numel()
        if self.manifest["complete"]:  # more rows after a finished write: no longer complete until close()
            self.manifest["complete"] = False
            _write_json(os.path.join(self.directory, _MANIFEST), self.manifest)
        while self._buffered_rows >= self.header.rows_per_shard:
            self._write_shard(self.header.rows_per_shard)

    def _lengths(self, rows: torch.Tensor, positions: int, lengths) -> torch.Tensor:
        if lengths is None:
            if rows.numel() == 0 or positions % rows.numel():
                raise ValueError(f"entries: {positions} positions do not split evenly over {rows.numel()} rows; "
                                 "pass lengths")
            lengths = torch.full_like(rows, positions // rows.numel())
        lengths = _as_rows(lengths)
        if lengths.shape != rows.shape or int(lengths.sum()) != positions or bool((lengths < 1).any()):
            raise ValueError(f"lengths: expected {rows.numel()} positive lengths summing to {positions}, got "
                             f"{lengths.tolist()}")
        expected = self.header.positions_per_row
        if expected is not None and bool((lengths != expected).any()):
            raise ValueError(f"entries: rows of {sorted(set(lengths.tolist()))} positions, the cache's rows have "
                             f"{expected}")
        return lengths

    def _take(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``count`` buffered rows (rows, lengths, records), removed from the buffer."""
        taken = []
        while count:
            rows, lengths, records = self._buffer[0]
            if rows.numel() <= count:
                taken.append(self._buffer.pop(0))
                count -= rows.numel()
                continue
            split = int(lengths[:count].sum())
            taken.append((rows[:count], lengths[:count], records[:split]))
            self._buffer[0] = (rows[count:], lengths[count:], records[split:])
            count = 0
        return tuple(torch.cat(parts) for parts in zip(*taken))

    def _write_shard(self, count: int) -> None:
        rows, lengths, records = self._take(count)
        self._buffered_rows -= count
        size = self.codec.bytes_per_position
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0) * size])
        preamble = _PREAMBLE.pack(_MAGIC, FORMAT_VERSION, rows.numel(), size, 0).ljust(_PREAMBLE_BYTES, b"\0")
        chunks = [preamble, rows.numpy().tobytes(), offsets.numpy().tobytes(), records.numpy().tobytes()]
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        name = f"shard_{len(self.manifest['shards']):06d}.bin"
        _write_atomically(os.path.join(self.directory, name), chunks)
        self.manifest["shards"].append(dict(name=name, sha256=digest.hexdigest(), bytes=sum(map(len, chunks)),
                                            rows=_ranges(rows.tolist()), positions=records.shape[0]))
        _write_json(os.path.join(self.directory, _MANIFEST), self.manifest)
        self._completed.append(rows)

    def close(self) -> None:
        """Writes the buffered rows as a last shard and marks the cache complete."""
        if self._buffered_rows:
            self._write_shard(self._buffered_rows)
        self.manifest["complete"] = True
        _write_json(os.path.join(self.directory, _MANIFEST), self.manifest)

    def __enter__(self) -> "TeacherCacheWriter":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
        else:
            self._seen.difference_update(row for rows, _, _ in self._buffer for row in rows.tolist())
            self._buffer.clear()
            self._buffered_rows = 0


# ---- reader -------------------------------------------------------------------------------

@dataclass
class _Shard:
    rows: torch.Tensor  # [n] int64
    offsets: torch.Tensor  # [n + 1] int64 byte offsets into records
    records: torch.Tensor  # [bytes] uint8


class TeacherCacheReader:
    """Reads a cache made for this run (``expect``), verifying each shard's sha256 on load.

    `read` gives the entries of any rows at once; `micro_batches` gives those of a sequence of
    row batches in order, decoded ahead by a background thread while a second one loads and
    verifies the shards they need next; `shards` walks the cache in shard order. The reader
    holds the ``cached_shards`` most recently used shards, and more while the batches being
    decoded or looked ahead at need more. Rows read in shard order, or in `shuffled_rows`
    order, load each shard once; rows in any other order may reload shards.
    """

    def __init__(self, directory: str, expect: Optional[Expectation] = None, *, require_complete: bool = True,
                 cached_shards: int = 4):
        if not isinstance(cached_shards, int) or cached_shards < 1:
            raise ValueError(f"cached_shards: expected an int >= 1, got {cached_shards!r}")
        self.directory = directory
        self.header = read_header(directory)
        if expect is not None:
            check_expectation(self.header, expect, directory)
        self.codec = self.header.codec
        self.manifest = _read_json(os.path.join(directory, _MANIFEST))
        if require_complete and not self.manifest["complete"]:
            raise CacheMismatch(f"teacher cache {directory}: incomplete ({len(self.manifest['shards'])} shards, the "
                                "writer has not finished); finish writing it, or pass require_complete=False")
        shard_rows = [_range_rows(shard["rows"]) for shard in self.manifest["shards"]]
        self.rows = torch.cat(shard_rows) if shard_rows else torch.zeros(0, dtype=torch.int64)
        # row id -> (shard, slot): the ids sorted, with where each one is
        self._sorted_rows, order = torch.sort(self.rows)
        self._shard_index = torch.cat([torch.full_like(rows, index) for index, rows in enumerate(shard_rows)]
                                      + [torch.zeros(0, dtype=torch.int64)])[order]
        self._slot = torch.cat([torch.arange(rows.numel()) for rows in shard_rows]
                               + [torch.zeros(0, dtype=torch.int64)])[order]
        self._cached_shards = cached_shards
        self._loaded: OrderedDict = OrderedDict()  # shard index -> Future of its _Shard
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="teacher-cache-load")

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    def close(self) -> None:
        self._loader.shutdown(wait=True)

    def __enter__(self) -> "TeacherCacheReader":
        return self

    def __exit__(self, *error) -> None:
        self.close()

    def shuffled_rows(self, seed: int, window: Optional[int] = None) -> torch.Tensor:
        """``[num_rows]`` int64 row ids in an order that reads each shard once: the shards in
        a random order, the rows of each ``window`` consecutive shards of it shuffled together
        (default: ``cached_shards``, the most that stay loaded). A function of ``seed`` only."""
        window = self._cached_shards if window is None else window
        if not isinstance(window, int) or not 1 <= window <= self._cached_shards:
            raise ValueError(f"window: expected an int in [1, cached_shards={self._cached_shards}], got {window!r}")
        generator = torch.Generator().manual_seed(seed)
        shard_rows = [_range_rows(shard["rows"]) for shard in self.manifest["shards"]]
        shuffled = [shard_rows[index] for index in torch.randperm(len(shard_rows), generator=generator).tolist()]
        parts = []
        for start in range(0, len(shuffled), window):
            rows = torch.cat(shuffled[start:start + window])
            parts.append(rows[torch.randperm(rows.numel(), generator=generator)])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    # ---- shards ----

    def _load(self, index: int) -> _Shard:
        entry = self.manifest["shards"][index]
        path = os.path.join(self.directory, entry["name"])
        with open(path, "rb") as handle:
            data = bytearray(handle.read())
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"] or len(data) != entry["bytes"]:
            raise CacheCorrupt(f"teacher cache {self.directory}: shard {entry['name']} fails its check ({len(data)} "
                               f"bytes, sha256 {digest}; the manifest says {entry['bytes']} bytes, sha256 "
                               f"{entry['sha256']}); the file changed after it was written: re-create the cache")
        magic, version, count, size, _ = _PREAMBLE.unpack_from(data)
        expected_rows = _range_rows(entry["rows"])
        if magic != _MAGIC or version != FORMAT_VERSION or size != self.codec.bytes_per_position \
                or count != expected_rows.numel():
            raise CacheCorrupt(f"teacher cache {self.directory}: shard {entry['name']}: its preamble does not "
                               "match the header and manifest")
        buffer = torch.frombuffer(data, dtype=torch.uint8)
        index_end = _PREAMBLE_BYTES + 8 * (2 * count + 1)
        rows = buffer[_PREAMBLE_BYTES:_PREAMBLE_BYTES + 8 * count].view(torch.int64)
        offsets = buffer[_PREAMBLE_BYTES + 8 * count:index_end].view(torch.int64)
        records = buffer[index_end:]
        if not torch.equal(rows, expected_rows) or int(offsets[-1]) != records.numel():
            raise CacheCorrupt(f"teacher cache {self.directory}: shard {entry['name']}: its index does not match "
                               "the manifest")
        return _Shard(rows, offsets, records)

    def _prefetch(self, index: int, keep: frozenset = frozenset()) -> None:
        """Has the loader thread load shard ``index`` unless held; then drops the least recently
        used shards beyond ``cached_shards``, except ``index`` and those in ``keep``."""
        with self._lock:
            if index in self._loaded:
                self._loaded.move_to_end(index)
            else:
                self._loaded[index] = self._loader.submit(self._load, index)
            for old in list(self._loaded):
                if len(self._loaded) <= self._cached_shards:
                    break
                if old != index and old not in keep:
                    del self._loaded[old]

    def _shard(self, index: int, keep: frozenset) -> _Shard:
        self._prefetch(index, keep)
        with self._lock:
            future = self._loaded[index]
        return future.result()

    def _shards_of(self, rows: torch.Tensor) -> frozenset:
        return frozenset(index for index, _ in self._locate(rows))

    def _locate(self, rows: torch.Tensor) -> list[tuple[int, int]]:
        """(shard index, slot in the shard) of each row id; KeyError for a row not cached."""
        where = torch.searchsorted(self._sorted_rows, rows).clamp(max=max(self.num_rows - 1, 0))
        found = self._sorted_rows[where] == rows if self.num_rows else torch.zeros_like(rows, dtype=torch.bool)
        if not bool(found.all()):
            raise KeyError(f"rows: row {int(rows[~found][0])} is not in teacher cache {self.directory} "
                           f"({self.num_rows} rows)")
        return list(zip(self._shard_index[where].tolist(), self._slot[where].tolist()))

    # ---- entries ----

    def read(self, rows, *, device=None, logprobs_dtype: Optional[torch.dtype] = None):
        """The entries of ``rows`` ``[B]`` (their positions one after the other) as `kd.TopK`
        or `kd.TeacherSamples` on ``device`` (default CPU); decoded there. Logprobs are
        bfloat16 (lossless) or float32 (compact) unless ``logprobs_dtype`` says otherwise."""
        return self._read(_as_rows(rows), device, logprobs_dtype, frozenset())

    def _read(self, rows: torch.Tensor, device, logprobs_dtype, keep: frozenset):
        """`read`, holding the shards in ``keep`` (those of batches being looked ahead at)."""
        located = self._locate(rows)
        keep = keep | {index for index, _ in located}
        runs: list[list[int]] = []  # [shard, first slot, last slot + 1]: consecutive rows of a shard read as one
        for index, slot in located:
            if runs and runs[-1][0] == index and runs[-1][2] == slot:
                runs[-1][2] += 1
            else:
                runs.append([index, slot, slot + 1])
        parts = []
        for index, first, stop in runs:
            shard = self._shard(index, keep)
            parts.append(shard.records[int(shard.offsets[first]):int(shard.offsets[stop])])
        records = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        records = records.view(-1, self.codec.bytes_per_position)
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if on_cuda:
            records = records.pin_memory().to(device, non_blocking=True)
        entries = _make_entries(self.header, *self.codec.decode(records, logprobs_dtype))
        if on_cuda:  # ready for any stream of any thread
            torch.cuda.current_stream(device).synchronize()
        return entries

    def micro_batches(self, picks: Iterable, *, device=None, logprobs_dtype: Optional[torch.dtype] = None,
                      prefetch: int = 2) -> "MicroBatches":
        """`read` of each row batch of ``picks`` (an iterable of ``[B]`` row ids), in order,
        as an iterator that starts reading at once (`MicroBatches`): a background thread
        decodes up to ``prefetch`` batches ahead and has the loader thread fetch and verify
        the shards of the batches after those, so reading overlaps the caller's work."""
        return MicroBatches(self, picks, device, logprobs_dtype, prefetch)

    def shards(self, *, device=None, logprobs_dtype: Optional[torch.dtype] = None,
               prefetch: int = 2) -> Iterator[tuple[torch.Tensor, object]]:
        """(row ids ``[n]``, their entries) of each shard, in shard order, prefetched."""
        shard_rows = [_range_rows(shard["rows"]) for shard in self.manifest["shards"]]
        with self.micro_batches(shard_rows, device=device, logprobs_dtype=logprobs_dtype,
                                prefetch=prefetch) as batches:
            yield from zip(shard_rows, batches)


class MicroBatches:
    """Iterator of a reader's entries for a sequence of row batches, decoded ahead by a
    background thread; `close` (or the end of a ``with`` block) stops it. An error in the
    background (a missing row, a corrupt shard) is raised by ``next``."""

    def __init__(self, reader: TeacherCacheReader, picks: Iterable, device, logprobs_dtype, prefetch: int):
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch: expected an int >= 1, got {prefetch!r}")
        self._reader, self._picks, self._device, self._dtype = reader, iter(picks), device, logprobs_dtype
        self._prefetch = prefetch
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._end = object()
        self._worker = threading.Thread(target=self._produce, name="teacher-cache-decode", daemon=True)
        self._worker.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        reader = self._reader
        ahead: deque = deque()  # (rows, their shards) of the batches after the one being decoded
        try:
            def held(current: frozenset) -> frozenset:
                return current.union(*(shards for _, shards in ahead))

            def refill(current: frozenset) -> None:  # the next batches' shards go to the loader thread now
                while len(ahead) < self._prefetch + 1:
                    pick = next(self._picks, None)
                    if pick is None:
                        return
                    pick = _as_rows(pick)
                    ahead.append((pick, reader._shards_of(pick)))
                    for index in sorted(ahead[-1][1]):
                        reader._prefetch(index, held(current))

            refill(frozenset())
            while ahead and not self._stop.is_set():
                pick, current = ahead.popleft()
                refill(current)
                if not self._put(reader._read(pick, self._device, self._dtype, held(current))):
                    return
            self._put(self._end)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised by __next__
            self._put(error)

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        item = self._ready.get()
        if item is self._end:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._worker.join()

    def __enter__(self) -> "MicroBatches":
        return self

    def __exit__(self, *error) -> None:
        self.close()
