"""The exact redo of listed rows, sized on the device (ops/sample_redo.py): listed rows equal the
float64 reference, others are untouched, in rounds or not, with no row listed, and a row of
massively tied keys gets NaN. Interpreter tiles: 16 rows × 16 columns, slices of 32."""
import pytest
import torch

from helpers import HAS_CUDA, small_teacher_problem, tied_row_problem
from kd_kernels import reference, sampling
from kd_kernels.ops.sample_redo import redo_listed_rows, redo_slot_bytes
from kd_kernels.samples import TeacherSamples

DEVICE = "cuda" if HAS_CUDA else "cpu"
SENTINEL = 7.0


def filled_outputs(rows: int, num_samples: int):
    """(log-probs, ids, thresholds, overflow) and lse, every value a sentinel."""
    return ((torch.full((rows, num_samples), SENTINEL, device=DEVICE),
             torch.full((rows, num_samples), 3, dtype=torch.int32, device=DEVICE),
             torch.full((rows,), SENTINEL, device=DEVICE), torch.zeros(rows, dtype=torch.bool, device=DEVICE)),
            torch.full((rows,), SENTINEL, device=DEVICE))


def redo(hidden, weight, bias, width, num_samples, temperature, seed, row_offset, listed, budget_bytes=1 << 30):
    outputs, lse = filled_outputs(hidden.shape[0], num_samples)
    rows = torch.full((hidden.shape[0],), -1, dtype=torch.int32)
    rows[:len(listed)] = torch.tensor(listed, dtype=torch.int32)
    count = torch.tensor([len(listed)], dtype=torch.int32)
    redo_listed_rows(hidden, weight, bias, width, num_samples, temperature, sampling.seed_key(seed), row_offset,
                     rows.to(DEVICE), count.to(DEVICE), outputs, lse, budget_bytes)
    logprobs, ids, thresholds, _ = outputs
    return TeacherSamples(logprobs.cpu(), ids.cpu(), thresholds.cpu(), lse.cpu(), temperature, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("slots", [None, 2])
def test_listed_rows_equal_the_reference_and_the_others_are_untouched(slots):
    hidden, weight, bias = small_teacher_problem(21, rows=12, columns=203, dtype=torch.float16)
    num_samples, temperature, seed, row_offset, width = 5, 0.9, 8, 2**33 + 5, 200
    listed = [9, 2, 11, 0, 5]
    budget = (1 << 30) if slots is None else slots * redo_slot_bytes(width, num_samples)
    got = redo(hidden, weight, bias, width, num_samples, temperature, seed, row_offset, listed, budget)
    expected = reference.teacher_sample(hidden, weight, num_samples, temperature, width, bias, seed=seed,
                                        row_offset=row_offset).to("cpu")
    assert torch.equal(got.indices[listed], expected.indices[listed].to(torch.int32))
    for name in ("logprobs", "log_threshold", "lse"):
        actual, wanted = getattr(got, name)[listed].double(), getattr(expected, name)[listed]
        assert torch.allclose(actual, wanted, atol=1e-5, rtol=0), name
    others = [row for row in range(12) if row not in listed]
    assert (got.logprobs[others] == SENTINEL).all() and (got.indices[others] == 3).all()
    assert (got.log_threshold[others] == SENTINEL).all() and (got.lse[others] == SENTINEL).all()


@pytest.mark.interpret
def test_nothing_is_written_where_no_row_is_listed():
    hidden, weight, bias = small_teacher_problem(22, rows=6, columns=100, dtype=torch.float16)
    got = redo(hidden, weight, None, 100, 3, 1.0, 1, 0, [])
    assert (got.logprobs == SENTINEL).all() and (got.lse == SENTINEL).all() and (got.indices == 3).all()
    assert (got.log_threshold == SENTINEL).all()


@pytest.mark.interpret
def test_a_row_of_massively_tied_keys_gets_nan_and_the_others_their_samples():
    # row 1: 600 keys tie, more than the 256 candidate slots; rows 0 and 2 draw from a uniform row
    hidden, weight = tied_row_problem(5, rows=3)
    got = redo(hidden, weight, None, 600, 4, 1.0, 3, 0, [1, 0])
    assert got.logprobs[1].isnan().all() and got.log_threshold[1].isnan() and (got.indices[1] == 0).all()
    expected = reference.teacher_sample(hidden, weight, 4, 1.0, 600, None, seed=3).to("cpu")
    assert torch.equal(got.indices[0], expected.indices[0].to(torch.int32))
    assert torch.allclose(got.logprobs[0].double(), expected.logprobs[0], atol=1e-5, rtol=0)
    assert (got.logprobs[2] == SENTINEL).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_samples, slots", [(16, None), (1023, 5)])
def test_at_real_tiles_listed_rows_equal_the_logits_schedule(num_samples, slots):
    # many slices a row, several hidden steps, the float atomic maxima across programs, and
    # (n = 1023) 4096 candidate slots a row in rounds of 5 listed rows; against cuBLAS float32
    # logits, whose sums differ by ~1e-6: at n = 1023 neighbouring keys that close may swap,
    # so the ids are compared as sets with one swap across the boundary allowed
    from kd_kernels import teacher_sampling as schedules

    generator = torch.Generator(device="cuda").manual_seed(4)
    hidden = torch.randn(64, 512, device="cuda", generator=generator).to(torch.bfloat16)
    weight = (torch.randn(20_000, 512, device="cuda", generator=generator) * 0.1).to(torch.bfloat16)
    bias = torch.randn(20_000, device="cuda", generator=generator).to(torch.bfloat16)
    width, temperature, seed, row_offset = 19_990, 1.5, 6, 1000
    listed = list(range(0, 64, 3))
    budget = (1 << 30) if slots is None else slots * redo_slot_bytes(width, num_samples)
    got = redo(hidden, weight, bias, width, num_samples, temperature, seed, row_offset, listed, budget)
    expected = schedules.teacher_sample_logits(hidden, weight, num_samples, temperature, width, bias, seed,
                                               row_offset).to("cpu")
    for name in ("log_threshold", "lse"):
        assert torch.allclose(getattr(got, name)[listed], getattr(expected, name)[listed], atol=1e-4, rtol=0), name
    for row in listed:
        mine = dict(zip(got.indices[row].tolist(), got.logprobs[row].tolist()))
        theirs = dict(zip(expected.indices[row].tolist(), expected.logprobs[row].tolist()))
        if num_samples == 16:
            assert got.indices[row].tolist() == expected.indices[row].tolist(), row
        assert len(mine.keys() - theirs.keys()) <= 1, row
        assert all(abs(mine[i] - theirs[i]) < 1e-4 for i in mine.keys() & theirs.keys()), row
    others = [row for row in range(64) if row not in listed]
    assert (got.logprobs[others] == SENTINEL).all()
