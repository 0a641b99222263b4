"""The offline teacher cache: encodings (round trips, bounds, loss error), shards (write, kill,
resume, read), corruption and mismatch refusal, and the identity hashes (CPU, small)."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import kd_kernels as kd
from helpers import python_path
from orchestration import teacher_cache as tc
from orchestration.cache_codec import COMPACT_RANGE, MASS_LEVELS, MASS_RANGE, Codec
from orchestration.cache_identity import data_hash, teacher_identity, tokenizer_hash
from orchestration.teacher_cache import (CacheCorrupt, CacheHeader, CacheMismatch, Expectation, TeacherCacheReader,
                                         TeacherCacheWriter)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 151_936  # Qwen's vocab: 18-bit ids, 3-byte compact entries with 110 levels


def sparse_rows(positions: int, k: int, vocab: int, generator: torch.Generator, scale: float = 3.0,
                missing: int = 0):
    """``[P, k]`` sorted top-k log-probs of random tempered rows (normalized over a 4096-wide
    stand-in for the vocab), their ids in ``[0, vocab)``, the last ``missing`` entries of
    row 0 absent (-inf, id 0)."""
    logits = torch.randn(positions, 4096, generator=generator, dtype=torch.float64) * scale
    logprobs = torch.log_softmax(logits, dim=-1).topk(k, dim=-1).values.float()
    indices = torch.randint(0, vocab, (positions, k), generator=generator, dtype=torch.int32)
    if missing:
        logprobs[0, k - missing:] = -math.inf
        indices[0, k - missing:] = 0
    return logprobs, indices


def row_entries(rows, positions_per_row: int = 6, k: int = 4, vocab: int = V, lse: bool = True) -> kd.TopK:
    """The entries of ``rows``, their positions one after the other: each row's a function of its id."""
    parts = [sparse_rows(positions_per_row, k, vocab, torch.Generator().manual_seed(1000 + int(row))) for row in rows]
    logprobs = torch.cat([p[0] for p in parts])
    indices = torch.cat([p[1] for p in parts])
    row_lse = [int(row) * 100.0 + torch.arange(positions_per_row, dtype=torch.float32) for row in rows]
    return kd.TopK(logprobs, indices, torch.cat(row_lse) if lse else None, 1.5)


def header(**changes) -> CacheHeader:
    values = dict(kind="topk", encoding="lossless", vocab_size=V, k=4, temperature=1.5, tokenizer_hash="tok",
                  data_hash="data", teacher=dict(path="/models/t", config_sha256="cfg"), fields=("lse",),
                  rows_per_shard=4, positions_per_row=6)
    return CacheHeader(**{**values, **changes})


def expectation(**changes) -> Expectation:
    values = dict(tokenizer_hash="tok", data_hash="data", temperature=1.5, k=4, vocab_size=V, kind="topk")
    return Expectation(**{**values, **changes})


def write_cache(directory, rows, batch=3, **changes):
    with TeacherCacheWriter(str(directory), header(**changes)) as writer:
        for start in range(0, len(rows), batch):
            part = rows[start:start + batch]
            writer.add(torch.tensor(part), row_entries(part))
    return writer


def assert_same_entries(actual: kd.TopK, expected: kd.TopK):
    assert torch.equal(actual.indices, expected.indices)
    assert torch.equal(actual.logprobs, expected.logprobs)
    assert (actual.lse is None) == (expected.lse is None)
    if actual.lse is not None:
        assert torch.equal(actual.lse, expected.lse)
    assert actual.temperature == expected.temperature


def lossless(topk: kd.TopK) -> kd.TopK:
    """What a lossless cache gives back: log-probs rounded to bfloat16."""
    return kd.TopK(topk.logprobs.bfloat16(), topk.indices, topk.lse, topk.temperature)


# ---- encodings ----------------------------------------------------------------------------

def _packed_ids_reference(indices: torch.Tensor, bits: int, group_ids: int) -> bytes:
    """Little-endian bit string of each position's ids, ``bits`` each, padded to whole groups."""
    out = b""
    for row in indices.tolist():
        row = row + [0] * (-len(row) % group_ids)
        value = sum(v << (i * bits) for i, v in enumerate(row))
        out += value.to_bytes(len(row) * bits // 8, "little")
    return out


@pytest.mark.parametrize("vocab", [2, 3, 1000, 128_256, V, 1 << 24, (1 << 24) + 1, 1 << 31])
@pytest.mark.parametrize("k", [1, 5, 8])
def test_lossless_round_trip_is_exact_and_packs_ceil_log2_v_bits(vocab, k):
    generator = torch.Generator().manual_seed(vocab % 1000 + k)
    logprobs, indices = sparse_rows(7, k, vocab, generator, missing=min(k, 2) if k > 1 else 0)
    indices[1, 0] = vocab - 1  # the largest id
    fields = {"lse": torch.randn(7, generator=generator), "log_threshold": torch.randn(7, generator=generator)}
    codec = Codec("lossless", vocab, k, ("lse", "log_threshold"))
    records = codec.encode(logprobs, indices, fields)
    decoded, ids, decoded_fields = codec.decode(records)
    assert torch.equal(ids, indices) and ids.dtype == torch.int32
    assert decoded.dtype == torch.bfloat16 and torch.equal(decoded.view(torch.int16),
                                                           logprobs.bfloat16().view(torch.int16))
    assert all(torch.equal(decoded_fields[name], fields[name]) for name in fields)
    bits = math.ceil(math.log2(vocab))
    assert codec.id_bits == bits
    group_ids = 8 // math.gcd(bits, 8)
    id_bytes = records[:, 8 + 2 * k:]
    assert id_bytes.numpy().tobytes() == _packed_ids_reference(indices, bits, group_ids)
    assert codec.bytes_per_position == 8 + 2 * k + math.ceil(k / group_ids) * group_ids * bits // 8


def _logit(log_mass: torch.Tensor) -> torch.Tensor:
    return log_mass - torch.log(-torch.expm1(log_mass))


@pytest.mark.parametrize("k", [1, 8, 12, 64])
@pytest.mark.parametrize("descending", [True, False])
def test_compact_round_trip_within_its_bounds(k, descending):
    generator = torch.Generator().manual_seed(k)
    logprobs, indices = sparse_rows(300, k, V, generator, missing=min(k - 1, 3))
    logprobs[1] = logprobs[1, 0]  # ties: every gap 0
    logprobs[3, 0], logprobs[3, 1:], indices[3, 1:] = 0.0, -math.inf, 0  # all the mass: logit beyond the range
    if k > 1:
        logprobs[2, -1] = logprobs[2, 0] - COMPACT_RANGE - 5  # beyond the range: clamps
    if not descending:  # any order: each position's entries shuffled
        order = torch.rand(300, k, generator=generator).argsort(dim=1)
        logprobs, indices = logprobs.gather(1, order), indices.gather(1, order)
    lse = torch.randn(300, generator=generator)
    codec = Codec("compact", V, k, ("lse",), descending=descending)
    # nothing a position stores but its fields and E bytes an entry: 3 from k = 8 on at this vocab
    assert codec.bytes_per_position == 4 + codec.entry_bytes * k
    assert codec.entry_bytes == {1: 5, 8: 3, 12: 3, 64: 3}[k]
    digits = 256 ** codec.entry_bytes // V
    assert math.prod(codec.mass_radices) >= MASS_LEVELS
    assert codec.entry_levels == tuple(digits // radix for radix in codec.mass_radices)
    assert min(codec.entry_levels[1:] if descending else codec.entry_levels, default=16) >= 16
    records = codec.encode(logprobs, indices, {"lse": lse})
    assert records.shape == (300, codec.bytes_per_position)
    decoded, ids, fields = codec.decode(records)
    assert torch.equal(ids, indices) and torch.equal(fields["lse"], lse) and decoded.dtype == torch.float32
    valid = torch.isfinite(logprobs)
    assert torch.equal(torch.isfinite(decoded), valid)
    gaps = logprobs.amax(1, keepdim=True) - logprobs
    decoded_gaps = decoded.amax(1, keepdim=True) - decoded
    error = (decoded_gaps - gaps).abs()[valid].double()
    bound = codec.gap_error_bound(torch.where(valid, gaps, 0.0))[valid]
    assert bool((error <= bound + 1e-5).all())
    if k > 1:  # the bound is not loose
        assert error.max() > 0.3 * bound[gaps[valid] <= COMPACT_RANGE].max()
    # the covered mass's logit within half a code (and float32 rounding); beyond the range it clamps
    log_mass, decoded_log_mass = torch.logsumexp(logprobs.double(), 1), torch.logsumexp(decoded.double(), 1)
    inside = _logit(log_mass).abs() <= MASS_RANGE  # not row 3, nor row 1 where ties may sum past 1
    mass_error = (_logit(decoded_log_mass) - _logit(log_mass))[inside].abs()
    assert float(mass_error.max()) <= codec.mass_step / 2 + 1e-4
    assert float(mass_error.max()) > 0.3 * codec.mass_step / 2
    assert float(decoded_log_mass[3]) == pytest.approx(-math.exp(-MASS_RANGE), abs=1e-7)  # logit clamped to the range


@pytest.mark.parametrize("vocab, entry_bytes, levels", [(1000, 2, {16, 21}), (1024, 2, {16, 21}),
                                                       (32_000, 3, {131, 174}), (128_256, 3, {32, 43}),
                                                       (262_144, 3, {16, 21}), (262_145, 4, {4095, 5461})])
def test_compact_entry_size_and_levels_follow_the_vocab(vocab, entry_bytes, levels):
    """k = 8 in any order: the covered mass's 2**14 codes take a digit of radix 3 or 4 from
    every entry, leaving D // 3 or D // 4 codes (D = 256**E // V, E the fewest with >= 16)."""
    codec = Codec("compact", vocab, 8)
    assert (codec.entry_bytes, set(codec.entry_levels)) == (entry_bytes, levels)
    logprobs, indices = sparse_rows(50, 8, vocab, torch.Generator().manual_seed(vocab))
    indices[0, 0] = vocab - 1
    decoded, ids, _ = codec.decode(codec.encode(logprobs, indices))
    assert torch.equal(ids, indices)
    gaps = logprobs[:, :1] - logprobs
    assert bool(((decoded[:, :1] - decoded - gaps).abs().double() <= codec.gap_error_bound(gaps) + 1e-5).all())


def test_encode_refuses_bad_entries():
    codec = Codec("compact", 100, 2, ("lse",))
    good = torch.tensor([[-0.1, -2.0]]), torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match=r"indices: expected ids in \[0, 100\), got \[3, 100\]"):
        codec.encode(good[0], torch.tensor([[3, 100]]), {"lse": torch.zeros(1)})
    with pytest.raises(ValueError, match="logprobs: NaN or \\+inf"):
        codec.encode(torch.tensor([[math.nan, -1.0]]), good[1], {"lse": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"fields: expected \['lse'\], got \[\]"):
        codec.encode(*good)
    with pytest.raises(ValueError, match=r"logprobs: expected \[P, 2\]"):
        codec.encode(good[0][:, :1], good[1][:, :1], {"lse": torch.zeros(1)})
    with pytest.raises(ValueError, match="encoding: expected one of"):
        Codec("lossy", 100, 2)
    descending = Codec("compact", 100, 2, descending=True)
    descending.encode(torch.tensor([[-0.1, -2.0], [-1.0, -math.inf]]), torch.tensor([[3, 4], [5, 0]]))
    with pytest.raises(ValueError, match=r"logprobs: row 1 is not in descending order"):
        descending.encode(torch.tensor([[-0.1, -2.0], [-2.0, -0.1]]), torch.tensor([[3, 4], [5, 6]]))


def _forward_kl(student_logits, teacher, support):
    return kd.topk_divergence_from_logits(student_logits, teacher, support=support, reduction="none",
                                          backend="torch", check_values=False)


@pytest.mark.parametrize("support", ["renormalized", "tail"])
def test_encodings_keep_the_forward_kl_close_to_the_float32_top_k(support):
    """LLM-like rows (V = 151,936, Gaussian logits at 2.4-4.9 nats of entropy, a student off by
    unit noise): the loss of each encoding against the float32 top-k, relative to the batch's
    mean loss, for the batch mean and for the worst row."""
    generator = torch.Generator().manual_seed(3)
    teacher_logits = torch.randn(16, V, generator=generator, dtype=torch.float64) * 5.1
    student_logits = 0.9 * teacher_logits + torch.randn(16, V, generator=generator, dtype=torch.float64)
    logprobs, indices = torch.log_softmax(teacher_logits, -1).topk(64, -1)
    for k in (8, 64):
        reference = kd.TopK(logprobs[:, :k].float(), indices[:, :k].int())
        exact = _forward_kl(student_logits, reference, support)
        # compact at k = 8 has 36-55 codes an entry, at k = 64 55-110: 3 bytes an entry either way
        compact_bounds = (4e-3, 3e-2) if k == 64 else (8e-3, 6e-2)
        for encoding, mean_bound, row_bound in (("lossless", 1.5e-3, 2e-2), ("compact", *compact_bounds)):
            codec = Codec(encoding, V, k, descending=encoding == "compact")
            decoded, ids, _ = codec.decode(codec.encode(reference.logprobs, reference.indices), torch.float32)
            loss = _forward_kl(student_logits, kd.TopK(decoded, ids), support)
            assert abs(loss.mean() - exact.mean()) / exact.mean() < mean_bound, (encoding, k)
            assert (loss - exact).abs().max() / exact.mean() < row_bound, (encoding, k)


def test_compact_samples_keep_the_sampled_forward_kl_close_to_float32():
    """12 samples a row of the same LLM-like rows, the unbiased sampled forward KL: the compact
    encoding a samples cache uses (any order, the flatter compander) against the float32
    samples, relative to the batch's mean loss, for the batch mean and for the worst row."""
    generator = torch.Generator().manual_seed(3)
    teacher_logits = torch.randn(16, V, generator=generator, dtype=torch.float64) * 5.1
    student_logits = 0.9 * teacher_logits + torch.randn(16, V, generator=generator, dtype=torch.float64)
    samples = kd.teacher_sample_from_logits(teacher_logits, 12, seed=1, temperature=1.0, backend="torch")
    codec = header(kind="samples", encoding="compact", k=12, fields=("log_threshold",)).codec
    assert not codec.descending and codec.bytes_per_position == 4 + 3 * 12

    def loss(logprobs):
        teacher = kd.TeacherSamples(logprobs, samples.indices, samples.log_threshold.float(), None, 1.0)
        return kd.topk_divergence_from_logits(student_logits, teacher, support="sampled", reduction="none",
                                              backend="torch", check_values=False)

    exact = loss(samples.logprobs.float())
    decoded, ids, _ = codec.decode(codec.encode(samples.logprobs.float(), samples.indices,
                                                {"log_threshold": samples.log_threshold.float()}))
    assert torch.equal(ids, samples.indices)
    got = loss(decoded)
    assert abs(got.mean() - exact.mean()) / exact.mean() < 4e-3
    assert (got - exact).abs().max() / exact.mean() < 8e-2


# ---- shards -------------------------------------------------------------------------------

def test_write_then_read_gives_the_entries_back(tmp_path):
    rows = list(range(10))
    writer = write_cache(tmp_path, rows)
    assert writer.complete and writer.completed_rows.tolist() == rows
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [shard["rows"] for shard in manifest["shards"]] == [[[0, 4]], [[4, 8]], [[8, 10]]]
    with TeacherCacheReader(str(tmp_path), expectation()) as reader:
        assert reader.num_rows == 10
        picks = [torch.tensor([9, 0, 5]), torch.tensor([3]), torch.tensor([4, 8, 1, 2])]
        assert_same_entries(reader.read(picks[0]), lossless(row_entries([9, 0, 5])))
        with reader.micro_batches(picks, prefetch=1) as batches:
            for pick, entries in zip(picks, batches):
                assert_same_entries(entries, lossless(row_entries(pick.tolist())))
        assert [shard_rows.tolist() for shard_rows, _ in reader.shards()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        as_float = reader.read([7], logprobs_dtype=torch.float32)
        assert as_float.logprobs.dtype == torch.float32
        assert torch.equal(as_float.logprobs, row_entries([7]).logprobs.bfloat16().float())
        with pytest.raises(KeyError, match="row 10 is not in teacher cache"):
            reader.read([1, 10])


def test_a_lossless_cache_gives_what_the_live_transfer_gives(tmp_path):
    """The student sees the same TopK, and the same loss and gradient, from a lossless cache
    as from the driver's live bf16 transfer (`TopK.pack(torch.bfloat16)`)."""
    generator = torch.Generator().manual_seed(11)
    teacher_logits = torch.randn(2 * 6, 300, generator=generator) * 3
    topk = kd.teacher_topk_from_logits(teacher_logits, k=4, temperature=1.5, backend="torch")
    live = kd.TopK.unpack(topk.pack(torch.bfloat16))
    with TeacherCacheWriter(str(tmp_path), header(vocab_size=300)) as writer:
        writer.add([0, 1], topk)
    with TeacherCacheReader(str(tmp_path), expectation(vocab_size=300)) as reader:
        cached = reader.read([0, 1])
    assert_same_entries(cached, live)
    student = torch.randn(12, 300, generator=generator, dtype=torch.float64)
    results = []
    for teacher in (live, cached):
        logits = student.clone().requires_grad_(True)
        loss = kd.topk_divergence_from_logits(logits, teacher, temperature=1.5, backend="torch")
        loss.backward()
        results.append((loss.detach(), logits.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_compact_cache_of_variable_length_rows_without_lse(tmp_path):
    with TeacherCacheWriter(str(tmp_path), header(encoding="compact", positions_per_row=None, fields=())) as writer:
        entries = row_entries([0, 1], positions_per_row=5, lse=False)
        writer.add([20, 21], entries, lengths=[2, 8])
        writer.add([22], row_entries([2], positions_per_row=3, lse=False))
    codec = Codec("compact", V, 4, descending=True)
    with TeacherCacheReader(str(tmp_path), expectation()) as reader:
        got = reader.read([22, 20, 21])
        assert got.lse is None and got.logprobs.shape == (13, 4)
        expected = torch.cat([row_entries([2], 3, lse=False).logprobs, entries.logprobs])
        expected_ids = torch.cat([row_entries([2], 3, lse=False).indices, entries.indices])
        decoded, ids, _ = codec.decode(codec.encode(expected, expected_ids))
        assert torch.equal(got.logprobs, decoded) and torch.equal(got.indices, ids)


def test_records_encoded_elsewhere_make_the_same_cache(tmp_path):
    write_cache(tmp_path / "entries", list(range(6)), encoding="compact")
    codec = header(encoding="compact").codec
    with TeacherCacheWriter(str(tmp_path / "records"), header(encoding="compact")) as writer:
        for part in ([0, 1, 2], [3, 4, 5]):
            entries = row_entries(part)
            writer.add_records(part, codec.encode(entries.logprobs, entries.indices, {"lse": entries.lse}))
        with pytest.raises(ValueError, match=r"records: expected \[P, 20\] uint8"):
            writer.add_records([6], torch.zeros(6, 19, dtype=torch.uint8))
    assert _manifest(tmp_path / "records") == _manifest(tmp_path / "entries")


def test_writer_refuses_repeated_rows_and_wrong_entries(tmp_path):
    writer = TeacherCacheWriter(str(tmp_path), header())
    writer.add([0, 1, 2, 3], row_entries([0, 1, 2, 3]))  # one full shard
    writer.add([4], row_entries([4]))
    with pytest.raises(ValueError, match="row 2 is already in the cache"):
        writer.add([2], row_entries([2]))
    with pytest.raises(ValueError, match="row 4 is already in the cache"):
        writer.add([4], row_entries([4]))
    with pytest.raises(ValueError, match="a row id appears twice"):
        writer.add([6, 6], row_entries([6, 7]))
    with pytest.raises(ValueError, match="made at temperature 2.0, the cache's is 1.5"):
        bad = row_entries([5])
        writer.add([5], kd.TopK(bad.logprobs, bad.indices, bad.lse, 2.0))
    with pytest.raises(ValueError, match="entries.lse: None, the cache stores lse"):
        writer.add([5], row_entries([5], lse=False))
    with pytest.raises(ValueError, match="rows of \\[3\\] positions, the cache's rows have 6"):
        writer.add([5], row_entries([5], positions_per_row=3))


def _resume(writer, rows, batch=3):
    done = set(writer.completed_rows.tolist())
    rest = [row for row in rows if row not in done]
    with writer:
        for start in range(0, len(rest), batch):
            writer.add(torch.tensor(rest[start:start + batch]), row_entries(rest[start:start + batch]))


def _manifest(directory):
    return json.loads((directory / "manifest.json").read_text())


@pytest.mark.parametrize("when", ["before the rename", "before the manifest"])
def test_writer_failing_mid_shard_resumes_to_the_uninterrupted_cache(tmp_path, monkeypatch, when):
    rows = list(range(14))
    write_cache(tmp_path / "whole", rows)
    real_write = tc._write_atomically
    shards_written = []

    def failing_write(path, chunks):
        if os.path.basename(path).startswith("shard_"):
            shards_written.append(path)
            if len(shards_written) == 3:
                if when == "before the rename":  # a temporary written, never renamed
                    with open(path + ".tmp", "wb") as handle:
                        handle.write(b"".join(chunks)[:100])
                else:  # renamed, never recorded in the manifest
                    real_write(path, chunks)
                raise RuntimeError("injected")
        return real_write(path, chunks)

    monkeypatch.setattr(tc, "_write_atomically", failing_write)
    directory = tmp_path / "cut"
    leftover = "shard_000002.bin.tmp" if when == "before the rename" else "shard_000002.bin"
    with pytest.raises(RuntimeError, match="injected"):
        write_cache(directory, rows)
    assert leftover in os.listdir(directory) and len(_manifest(directory)["shards"]) == 2
    monkeypatch.setattr(tc, "_write_atomically", real_write)
    with pytest.raises(CacheMismatch, match="incomplete"):
        TeacherCacheReader(str(directory))
    with TeacherCacheReader(str(directory), require_complete=False) as reader:  # only recorded shards count
        assert reader.rows.tolist() == list(range(8))
    writer = TeacherCacheWriter(str(directory), header())
    assert leftover not in os.listdir(directory) and writer.completed_rows.tolist() == list(range(8))
    _resume(writer, rows)
    assert _manifest(directory) == _manifest(tmp_path / "whole")


_CHILD = """
import sys, time, torch
from orchestration.teacher_cache import TeacherCacheWriter
from test_teacher_cache import header, row_entries
writer = TeacherCacheWriter(sys.argv[1], header(rows_per_shard=2))
for start in range(0, 60, 3):
    rows = list(range(start, min(start + 3, 60)))
    writer.add(torch.tensor(rows), row_entries(rows))
    print(writer.completed_rows.numel(), flush=True)
    time.sleep(0.02)
writer.close()
print("finished", flush=True)
"""


def test_writer_killed_with_sigkill_resumes_to_the_uninterrupted_cache(tmp_path):
    rows = list(range(60))
    directory = tmp_path / "killed"
    environment = dict(os.environ, PYTHONPATH=python_path(ROOT, os.path.join(ROOT, "tests")))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory)], stdout=subprocess.PIPE, text=True,
                             env=environment)
    try:
        for line in child.stdout:  # killed at whatever it is doing once a few shards are on disk
            if line.strip() == "finished" or int(line) >= 8:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    writer = TeacherCacheWriter(str(directory), header(rows_per_shard=2))
    done = writer.completed_rows.numel()
    assert 8 <= done < 60 and not writer.complete
    _resume(writer, rows)
    write_cache(tmp_path / "whole", rows, rows_per_shard=2)
    assert _manifest(directory) == _manifest(tmp_path / "whole")
    with TeacherCacheReader(str(directory), expectation()) as reader:
        pick = torch.tensor([0, done - 1, done, 59])
        assert_same_entries(reader.read(pick), lossless(row_entries(pick.tolist())))


def test_leftover_temporaries_are_ignored_by_readers_and_removed_by_writers(tmp_path):
    write_cache(tmp_path, list(range(6)))
    (tmp_path / "shard_000002.bin.tmp").write_bytes(b"partial shard")
    (tmp_path / "shard_000007.bin").write_bytes(b"never recorded")
    (tmp_path / "manifest.json.tmp").write_bytes(b"{half")
    with TeacherCacheReader(str(tmp_path), expectation()) as reader:
        assert reader.rows.tolist() == list(range(6))
        assert_same_entries(reader.read([5]), lossless(row_entries([5])))
    TeacherCacheWriter(str(tmp_path), header())
    assert sorted(os.listdir(tmp_path)) == ["header.json", "manifest.json", "shard_000000.bin", "shard_000001.bin"]


@pytest.mark.parametrize("where", ["index", "records"])
def test_a_flipped_byte_in_a_shard_is_detected(tmp_path, where):
    write_cache(tmp_path, list(range(8)))
    path = tmp_path / "shard_000001.bin"
    data = bytearray(path.read_bytes())
    data[70 if where == "index" else len(data) - 5] ^= 0x10
    path.write_bytes(bytes(data))
    with TeacherCacheReader(str(tmp_path), expectation()) as reader:
        assert_same_entries(reader.read([1]), lossless(row_entries([1])))  # the other shard is fine
        with pytest.raises(CacheCorrupt, match="shard shard_000001.bin fails its check"):
            reader.read([5])
        with pytest.raises(CacheCorrupt, match="shard_000001.bin"):
            list(reader.micro_batches([[0], [6]]))


@pytest.mark.parametrize("name, value", [("tokenizer_hash", "other-tok"), ("data_hash", "other-data"),
                                         ("temperature", 1.0), ("k", 8), ("vocab_size", 128_256),
                                         ("kind", "samples"), ("teacher", dict(path="/models/u", config_sha256="x"))])
def test_a_cache_made_for_another_run_is_refused(tmp_path, name, value):
    write_cache(tmp_path, [0])
    cached = getattr(header(), name)
    if name == "teacher":  # as the header file keeps it: keys sorted
        cached = dict(sorted(cached.items()))
    with pytest.raises(CacheMismatch, match=re.escape(f"{name} is {cached!r} in the cache, this run expects {value!r}")):
        TeacherCacheReader(str(tmp_path), expectation(**{name: value}))
    TeacherCacheReader(str(tmp_path), expectation(teacher=header().teacher)).close()  # the same: accepted


def test_a_cache_of_another_format_or_codec_is_refused(tmp_path):
    write_cache(tmp_path, [0])
    values = json.loads((tmp_path / "header.json").read_text())
    for version in (1, 99):  # 1: the compact records held a float32 top a position
        (tmp_path / "header.json").write_text(json.dumps(dict(values, format_version=version)))
        with pytest.raises(CacheMismatch, match=f"format_version is {version} in the cache, this reader reads 2"):
            TeacherCacheReader(str(tmp_path), expectation())
        with pytest.raises(CacheMismatch, match=f"format_version is {version} in the cache"):
            TeacherCacheWriter(str(tmp_path), header())
    (tmp_path / "header.json").write_text(json.dumps(dict(values, codec=dict(values["codec"], id_bits=17))))
    with pytest.raises(CacheMismatch, match="codec is .*'id_bits': 17.* in the cache, this reader's is .*'id_bits': 18"):
        TeacherCacheReader(str(tmp_path), expectation())


def test_resuming_with_another_header_is_refused(tmp_path):
    write_cache(tmp_path, [0, 1])
    with pytest.raises(CacheMismatch, match="encoding is 'lossless' in the cache, this writer has 'compact'"):
        TeacherCacheWriter(str(tmp_path), header(encoding="compact"))
    with pytest.raises(CacheMismatch, match="rows_per_shard is 4 in the cache, this writer has 8"):
        TeacherCacheWriter(str(tmp_path), header(rows_per_shard=8))


def test_micro_batches_stop_cleanly_and_report_missing_rows(tmp_path):
    write_cache(tmp_path, list(range(12)))
    with TeacherCacheReader(str(tmp_path), expectation(), cached_shards=1) as reader:
        batches = reader.micro_batches([[11, 0], [1], [5], [2]], prefetch=1)
        assert_same_entries(next(batches), lossless(row_entries([11, 0])))
        batches.close()  # left early: the background thread ends
        assert not batches._worker.is_alive()
        with pytest.raises(KeyError, match="row 40 is not in teacher cache"):
            list(reader.micro_batches([[1], [40]]))
        reversed_rows = [[row] for row in reversed(range(12))]  # against the shard order, one shard cached
        for pick, entries in zip(reversed_rows, reader.micro_batches(reversed_rows, prefetch=3)):
            assert_same_entries(entries, lossless(row_entries(pick)))


def test_shuffled_rows_read_each_shard_once(tmp_path, monkeypatch):
    write_cache(tmp_path, list(range(22)))  # shards of 4 rows, the last of 2
    with TeacherCacheReader(str(tmp_path), expectation(), cached_shards=2) as reader:
        order = reader.shuffled_rows(seed=5)
        assert sorted(order.tolist()) == list(range(22)) and order.tolist() != list(range(22))
        assert torch.equal(order, reader.shuffled_rows(seed=5))
        assert not torch.equal(order, reader.shuffled_rows(seed=6))
        loads = []
        real_load = reader._load
        monkeypatch.setattr(reader, "_load", lambda index: loads.append(index) or real_load(index))
        picks = list(order.split(3))
        for pick, entries in zip(picks, reader.micro_batches(picks)):
            assert_same_entries(entries, lossless(row_entries(pick.tolist())))
        assert sorted(loads) == list(range(6))
        with pytest.raises(ValueError, match=r"window: expected an int in \[1, cached_shards=2\], got 3"):
            reader.shuffled_rows(0, window=3)


def test_samples_round_trip(tmp_path):
    samples_type = getattr(kd, "TeacherSamples", None)
    if samples_type is None:
        pytest.skip("kd.TeacherSamples is not in this kd_kernels")
    topk = row_entries([0, 1])
    threshold = torch.linspace(-9, -3, topk.num_rows)
    samples = samples_type(topk.logprobs, topk.indices, threshold, topk.lse, 1.5, seed=4)
    with TeacherCacheWriter(str(tmp_path), header(kind="samples", fields=("log_threshold", "lse"))) as writer:
        writer.add([0, 1], samples)
        with pytest.raises(ValueError, match="a TopK, the cache holds kind 'samples'"):
            writer.add([2], row_entries([2]))
    with TeacherCacheReader(str(tmp_path), expectation(kind="samples")) as reader:
        got = reader.read([1, 0])
    assert isinstance(got, samples_type) and got.temperature == 1.5
    order = torch.cat([torch.arange(6, 12), torch.arange(0, 6)])
    assert torch.equal(got.indices, topk.indices[order]) and torch.equal(got.log_threshold, threshold[order])
    assert torch.equal(got.logprobs, topk.logprobs[order].bfloat16()) and torch.equal(got.lse, topk.lse[order])


# ---- identities ---------------------------------------------------------------------------

def test_identity_hashes_follow_what_changes_the_entries(tmp_path):
    from transformers import LlamaConfig

    from orchestration.data import train_tokenizer

    tokens = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    assert data_hash(tokens) == data_hash(tokens.to(torch.int32))
    changed = tokens.clone()
    changed[3, 15] += 1
    assert data_hash(changed) != data_hash(tokens) and data_hash(tokens.view(2, 32)) != data_hash(tokens)

    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=100)
    identity = teacher_identity("t", config)
    runtime = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=100, use_cache=False)
    assert teacher_identity("t", runtime) == identity and identity["path"] == os.path.abspath("t")
    other = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=100)
    assert teacher_identity("t", other)["config_sha256"] != identity["config_sha256"]
    weights = {"w": torch.ones(2, 2)}
    assert teacher_identity(None, config, weights)["weights_sha256"] != \
        teacher_identity(None, config, {"w": torch.ones(2, 2) * 2})["weights_sha256"]

    with open(os.path.join(ROOT, "orchestration", "cache_codec.py"), encoding="utf-8") as handle:
        records = [{"text": block} for block in handle.read().split("\n\n")]
    tokenizer = train_tokenizer(records, 300, str(tmp_path / "tok"))
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    tokenizer(["a b"], truncation=True, max_length=4)  # call options do not change the hash
    assert tokenizer_hash(reloaded) == tokenizer_hash(tokenizer)
    reloaded.chat_template = "{{ messages }}"
    assert tokenizer_hash(reloaded) != tokenizer_hash(tokenizer)
    before = tokenizer_hash(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    assert tokenizer_hash(tokenizer) != before


@pytest.mark.gpu
def test_reader_decodes_on_cuda_as_on_cpu(tmp_path):
    rows = list(range(8))
    for encoding in ("lossless", "compact"):
        directory = tmp_path / encoding
        write_cache(directory, rows, encoding=encoding)
        with TeacherCacheReader(str(directory), expectation()) as reader:
            on_cpu = reader.read(rows)
            with reader.micro_batches([rows], device="cuda") as batches:
                on_gpu = next(batches)
        assert on_gpu.logprobs.is_cuda and on_gpu.indices.is_cuda
        if encoding == "lossless":
            assert_same_entries(on_gpu.to("cpu"), on_cpu)
        else:  # the compact level's sum over k runs in each device's order: equal to float32 rounding
            on_gpu = on_gpu.to("cpu")
            assert torch.equal(on_gpu.indices, on_cpu.indices)
            torch.testing.assert_close(on_gpu.logprobs, on_cpu.logprobs, rtol=4e-7, atol=4e-7)
