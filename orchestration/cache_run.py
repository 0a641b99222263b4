"""The offline teacher cache in the driver.

``mode=cache`` scores every training row with the teacher (built and pretrained as a training
run would, or loaded from ``teacher_path``; text rows, or packed pre-tokenized documents with
their position ids and block-diagonal mask, whose document ids join the data hash) and writes
them to ``teacher_cache`` with `teacher_cache.TeacherCacheWriter`, rows in order: a killed run,
started again with the same options, continues after the last complete shard and ends with the
shards an uninterrupted run writes. A training run with ``teacher_cache`` set starts
`CacheTeacherWorker`s in the teacher workers' place: they build no model and answer each
micro-batch from the cache (`teacher_cache.TeacherCacheReader`, shards verified and decoded
ahead of the steps that need them), after `check_cache` has refused a cache made for another
tokenizer, temperature, data, k or kind of entries.
"""
from __future__ import annotations

import math
import time
import torch

from .cache_identity import data_hash, teacher_identity
from .errors import UsageError
from .sampler import sampler_class
from .teacher_cache import (CacheCorrupt, CacheHeader, CacheMismatch, Expectation, TeacherCacheReader,
                            TeacherCacheWriter)
from .transfer import transfer_for
from .workers import Worker


def cache_kind(config) -> tuple[str, int]:
    """(kind, entries a position) the options ask of a cache: ("samples", cache_samples) when
    cache_samples > 0, else ("topk", k)."""
    return ("samples", config.cache_samples) if config.cache_samples else ("topk", config.k)


def _expectation(config, data) -> Expectation:
    kind, entries = cache_kind(config)
    rows = data.train_tokens if data.train_documents is None else torch.stack([data.train_tokens,
                                                                                 data.train_documents])
    return Expectation(tokenizer_hash=data.tokenizer_hash, data_hash=data_hash(rows),
                       temperature=config.temperature, k=entries, vocab_size=data.vocab, kind=kind)


def check_cache(config, data) -> None:
    """UsageError (one line) unless ``config.teacher_cache`` holds a complete cache made for
    this run's tokenizer, training rows, temperature, vocab and entries (k top-k entries, or
    cache_samples samples), and the loss's support reads its kind of entries."""
    directory = config.teacher_cache
    kind, _ = cache_kind(config)
    if (kind == "samples") != (config.support == "sampled"):
        raise UsageError(f"support: {config.support!r} with cache_samples={config.cache_samples}; a cache of samples "
                         "(cache_samples > 0) trains with support='sampled', a top-k cache (cache_samples=0) with "
                         "'renormalized' or 'tail'")
    try:
        TeacherCacheReader(directory, _expectation(config, data)).close()
    except (FileNotFoundError, CacheMismatch, CacheCorrupt) as error:
        raise UsageError(f"teacher_cache: {error}") from error


def write_cache(config, data, report) -> dict:
    """Scores the training rows of ``data`` into ``config.teacher_cache`` (resumable); the
    summary. In-process, no Ray: the same `TeacherWorker` a training run starts."""
    from .teacher import TeacherWorker

    if not config.teacher_cache:
        raise UsageError("teacher_cache: mode=cache writes the cache there; set teacher_cache=DIR")
    if config.support == "sampled" and not config.cache_samples:
        raise UsageError("cache_samples: 0 (a top-k cache) with support='sampled'; set cache_samples > 0")
    teacher = TeacherWorker(config, data.vocab)
    teacher.set_rows(data.train_tokens, data.train_labels, data.train_positions, data.train_documents)
    if not config.teacher_path and config.teacher_pretrain_steps:
        with report.phase(f"teacher pretraining ({config.teacher_pretrain_steps} steps)"):
            teacher.pretrain(config.teacher_pretrain_steps)
    teacher.finish_pretraining()
    kind, entries = cache_kind(config)
    expectation = _expectation(config, data)
    identity = teacher_identity(config.teacher_path, teacher.model.config,
                                None if config.teacher_path else teacher.state_dict())
    header = CacheHeader(kind=kind, encoding=config.cache_encoding, vocab_size=data.vocab, k=entries,
                         temperature=config.temperature, tokenizer_hash=expectation.tokenizer_hash,
                         data_hash=expectation.data_hash, teacher=identity,
                         fields=("log_threshold",) if kind == "samples" else (),
                         rows_per_shard=config.cache_rows_per_shard, positions_per_row=config.row_tokens)
    rows = data.train_tokens.shape[0]
    batch = config.rows_per_micro_batch * config.micro_batches  # a step's rows a scoring call
    started = time.perf_counter()
    try:
        writer = TeacherCacheWriter(config.teacher_cache, header)
    except CacheMismatch as error:
        raise UsageError(f"teacher_cache: {error}") from error
    complete = True
    try:
        with writer:
            first = writer.completed_rows.numel()  # complete shards hold rows 0 .. first - 1
            if first:
                report.note(f"teacher cache: {first} of {rows} rows already written; continuing")
            with report.bar("teacher cache", rows, "row", initial=first) as bar:
                for number, start in enumerate(range(first, rows, batch)):
                    if config.stop_after is not None and number > config.stop_after:
                        raise _Stopped  # tests of resume: leaves the cache as a killed writer would
                    stop = min(start + batch, rows)
                    rows_now = torch.arange(start, stop)
                    scored = teacher.entries(data.train_tokens[start:stop], start, config.cache_samples,
                                             *teacher.row_layout(rows_now, teacher.device, config.attention))
                    writer.add(rows_now, scored.to("cpu"))
                    bar.update(stop - start)
    except _Stopped:
        complete = False
    return dict(cache=config.teacher_cache, complete=complete, kind=kind, entries=entries,
                encoding=config.cache_encoding, train_rows=rows, bytes_per_position=header.codec.bytes_per_position,
                seconds=time.perf_counter() - started)


class _Stopped(Exception):
    """``stop_after`` ended a cache write early (the cache stays incomplete, as after a kill)."""


class CacheTeacherWorker(Worker):
    """A teacher worker without a model: a micro-batch's entries are read from the cache and
    sent by the run's `Transfer` like a scored top-k. Reads are decoded ahead in the order the
    run's `StepSampler` gives the micro-batches (every micro-batch of each step from the
    first one asked for); a micro-batch asked for out of that order is read at once."""

    def __init__(self, config, vocab: int, transfer: str = "object_store", world=None):
        self.config, self.vocab = config, vocab
        self.transfer = transfer_for(transfer)
        self.reader = TeacherCacheReader(config.teacher_cache)
        self._ahead = None

    def _planned(self, step: int):
        sampler = sampler_class(self.config)(self.config.seed, self.rows.shape[0], self.config.micro_batches,
                                             self.config.rows_per_micro_batch)
        return (pick for later in range(step, self.config.steps) for pick in sampler.picks(later))

    def _entries(self, pick: torch.Tensor, step: int):
        if self._ahead is None:
            self._ahead = self.reader.micro_batches(self._planned(step)), self._planned(step)
        batches, planned = self._ahead
        for expected in planned:  # the decoded batches follow the plan one for one
            entries = next(batches)
            if torch.equal(expected, pick):
                return entries
        return self.reader.read(pick)

    def score_rows(self, pick: torch.Tensor, step: int = 0, student_rank: int = 0):
        """(the transfer message of the cached entries of the training rows ``pick``, seconds)."""
        start = time.perf_counter()
        message = self.transfer.send(self._entries(pick, step), step, student_rank)
        return message, time.perf_counter() - start

    def pretrain(self, steps: int) -> float:
        return math.nan

    def finish_pretraining(self) -> None:
        pass

    def connect(self, student_ranks: list) -> None:
        self.transfer.setup(student_ranks, None, sending=True)

    def release(self, step: int) -> dict:
        """As `TeacherWorker.release`: frees ``step``'s buffers, returns this process's peak memory."""
        self.transfer.release(step)
        return self.memory()

    def held_out_sums(self, chunk: tuple) -> tuple[float, int]:
        """No teacher model: (NaN, 0), so the teacher's held-out CE reads NaN."""
        return math.nan, 0
