"""Teacher Gumbel-top-n sampling: the noise (torch and Triton, bit for bit), the reference's
distribution (chi-square against the teacher's softmax), the Triton schedules against the
float64 reference (kd_kernels/teacher_sampling.py: the sampling matmul's epilogue, the logits
passes, the ranking, the exact redo), reproducibility, `TeacherSamples` and the public API.
Interpreter tiles: 16 rows × 32 columns, groups of 8; the real tiles run on a GPU."""
import functools
import math

import pytest
import torch
import triton
import triton.language as tl

import kd_kernels as kd
from helpers import HAS_CUDA, INTERPRETER_ONLY, small_teacher_problem, tied_row_problem
from kd_kernels import reference, sampling
from kd_kernels import teacher_sampling as schedules
from kd_kernels.ops import sample_keys, sort_keys, topk_from_appended
from kd_kernels.ops.gumbel_noise import (coarse_floats, coarse_gumbel_lower_bound, gumbel_noise, pair_hash, row_key,
                                        row_operands, signed_key)
from kd_kernels.ops.lm_head_sample import SampleAppends, SampleMatmul
from kd_kernels.ops.topk_from_appended import tile_logsumexp
from kd_kernels.samples import TeacherSamples

DEVICE = "cuda" if HAS_CUDA else "cpu"


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """P(χ² ≥ the statistic) with len - 1 degrees of freedom (expected counts, same total)."""
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


@triton.jit
def _noise_table_kernel(noise_ptr, coarse_ptr, bound_ptr, rows_ptr, seed_key, COLUMNS: tl.constexpr,
                        ROW_BLOCK: tl.constexpr, COLUMN_BLOCK: tl.constexpr):
    """A row block × column block of G, of the coarse 16 bits and of the coarse lower bound of G."""
    rows = tl.program_id(0) * ROW_BLOCK + tl.arange(0, ROW_BLOCK)[:, None]
    columns = tl.program_id(1) * COLUMN_BLOCK + tl.arange(0, COLUMN_BLOCK)[None, :]
    key = row_key(seed_key, tl.load(rows_ptr + rows))
    tl.store(noise_ptr + rows * COLUMNS + columns, gumbel_noise(key, columns))
    even, odd = coarse_floats(pair_hash(key, columns))
    tl.store(coarse_ptr + rows * COLUMNS + columns, tl.where((columns & 1) == 1, odd, even) - 8388608.0)
    tl.store(bound_ptr + rows * COLUMNS + columns, coarse_gumbel_lower_bound(key, columns))


def triton_noise(seed: int, rows: torch.Tensor, columns: int):
    """(G float32, coarse bits int64, G's coarse lower bound float32) ``[R, columns]`` from the
    kernels' noise functions; R and columns powers of two. One program under the interpreter
    (cheap there); small blocks on a GPU, where a program of 4096 × 16 did not compile in six
    minutes."""
    noise, coarse, bound = (torch.empty(rows.numel(), columns, device=DEVICE) for _ in range(3))
    row_block, column_block = (rows.numel(), columns) if DEVICE == "cpu" else (min(rows.numel(), 4), min(columns, 256))
    grid = (rows.numel() // row_block, columns // column_block)
    _noise_table_kernel[grid](noise, coarse, bound, rows.to(DEVICE), signed_key(sampling.seed_key(seed)),
                              COLUMNS=columns, ROW_BLOCK=row_block, COLUMN_BLOCK=column_block)
    return noise.cpu(), coarse.cpu().long(), bound.cpu()


@pytest.mark.interpret
@pytest.mark.parametrize("seed", [0, 99, 2**63 + 12345])
def test_the_kernels_noise_equals_the_references_bit_for_bit(seed):
    rows = torch.tensor([0, 1, 7, 2**31 + 5, 2**33 + 1, 2**40 + 3, 12, 13])
    noise, coarse, bound = triton_noise(seed, rows, 1024)
    bits = sampling.noise_bits(seed, rows, torch.arange(1024))
    assert torch.equal(coarse, bits >> 16)
    expected = sampling.gumbel_noise(seed, rows, torch.arange(1024))
    assert (noise.double() - expected).abs().max() < 1e-6 * expected.abs().max()
    assert expected.max() > 8 and expected.min() < -2  # both tails reached
    # the floors' bound: below G (to float32 rounding), close to it where E is not tiny
    assert (bound.double() <= expected + 1e-5).all() and (bound >= -3.2).all()
    moderate = (expected > -1) & (expected < 4)  # the floors need the large keys: G well above its least
    assert (expected - bound.double())[moderate].max() < 0.02
    assert (expected - bound.double())[moderate].mean() < 1e-3


@pytest.mark.interpret
@pytest.mark.parametrize("rank", [1, 5, 12, 13, 30])
def test_the_sample_floors_are_lower_bounds_of_the_rank_th_key(rank):
    # ranks up to FLOOR_REMOVALS take maxima away (exact where keys differ), larger ones bisect
    generator = torch.Generator().manual_seed(rank)
    rows, stride, temperature, seed, first_row = 4, 3, 0.8, 9, 2**33 + 1
    sample = (3 * torch.randn(rows, 40, generator=generator)).to(torch.float16)
    sample[1] = sample[1, 0]  # every key of a row's sample column alike but for its noise
    sample[2, :] = 0
    sample[2, ::2] = 60.0  # tied logits, where the noise sets the order
    sample[3, rank - 1:] = -math.inf  # fewer than rank finite keys: the most negative float
    bound = triton_noise(seed, first_row + torch.arange(rows), 128)[2][:, :40 * stride:stride].double()
    keys = sample.double() / temperature + bound
    floors = sample_keys.sample_key_floors(sample.to(DEVICE), stride, rank, temperature, sampling.seed_key(seed),
                                           first_row, torch.empty(rows, device=DEVICE)).cpu().double()
    assert floors[3] == -torch.finfo(torch.float32).max
    keys, floors = keys[:3], floors[:3]
    kth = keys.sort(dim=1, descending=True).values[:, rank - 1]
    assert (floors <= kth + 1e-5 * (1 + kth.abs())).all()
    if rank <= sample_keys.FLOOR_REMOVALS:
        assert torch.allclose(floors, kth, atol=1e-5, rtol=1e-6)
    else:  # 12 bisection steps between the row's smallest and largest key
        assert (kth - floors <= (keys.amax(1) - keys.amin(1)) / 2**12 + 1e-5).all()


def test_the_noise_is_standard_gumbel_and_independent():
    rows, columns = torch.arange(256), torch.arange(1024)
    noise = sampling.gumbel_noise(5, rows, columns)
    values = noise.flatten().sort().values
    n = values.numel()
    cdf = torch.exp(-torch.exp(-values))
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max()
    assert math.sqrt(n) * ks < 1.95  # Kolmogorov: p ≈ 0.001
    # pair mates share a hash, neighbouring rows a seed: no correlation beyond sampling noise
    for a, b in ((noise[:, 0::2], noise[:, 1::2]), (noise[:-1], noise[1:]), (noise[:, :-2], noise[:, 2:])):
        correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(correlation) < 5 / math.sqrt(a.numel())
    assert not torch.equal(sampling.gumbel_noise(6, rows[:2], columns), noise[:2])


def test_the_first_samples_are_draws_from_the_teacher():
    # many rows of one teacher row are independent draws: the first sample follows p, the second
    # Σ_i p_i p_j / (1 - p_i) over i ≠ j (Plackett-Luce), at τ = 0.8
    generator = torch.Generator().manual_seed(3)
    row = 2.0 * torch.randn(12, generator=generator)
    draws = 40_000
    samples = reference.teacher_sample_from_logits(row.expand(draws, -1), 3, 0.8, seed=17)
    p = torch.softmax(row.double() / 0.8, -1)
    first = torch.bincount(samples.indices[:, 0].long(), minlength=12)
    assert chi_square_p_value(first, draws * p) > 1e-4
    second_p = (p[:, None] * p[None, :] / (1 - p[:, None])).fill_diagonal_(0).sum(0)
    second = torch.bincount(samples.indices[:, 1].long(), minlength=12)
    assert chi_square_p_value(second, draws * second_p) > 1e-4
    ids = samples.indices
    assert (ids[:, 0] != ids[:, 1]).all() and (ids[:, 1] != ids[:, 2]).all() and (ids[:, 0] != ids[:, 2]).all()
    # a biased draw is rejected: the test has power
    assert chi_square_p_value(first, draws * torch.softmax(row.double(), -1)) < 1e-6


@pytest.mark.interpret
def test_the_kernels_noise_draws_from_the_teacher():
    # Gumbel-max over the Triton noise of 4096 rows: argmax(log p + G) follows p
    generator = torch.Generator().manual_seed(4)
    log_p = torch.log_softmax(1.5 * torch.randn(16, generator=generator).double(), -1)
    noise, _, _ = triton_noise(23, torch.arange(4096), 16)
    counts = torch.bincount((log_p + noise.double()).argmax(-1), minlength=16)
    assert chi_square_p_value(counts, 4096 * log_p.exp()) > 1e-4


def test_reference_samples_are_the_largest_keys_with_their_log_probs():
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(6, 50, generator=generator)
    samples = reference.teacher_sample_from_logits(logits, 7, 0.5, vocab_size=45, seed=8, row_offset=100)
    log_p = torch.log_softmax(logits[:, :45].double() / 0.5, -1)
    keys = log_p + sampling.gumbel_noise(8, torch.arange(100, 106), torch.arange(45))
    order = keys.argsort(dim=-1, descending=True)
    assert torch.equal(samples.indices.long(), order[:, :7])
    assert torch.allclose(samples.logprobs, log_p.gather(1, order[:, :7]))
    assert torch.allclose(samples.log_threshold, keys.gather(1, order[:, 7:8]).squeeze(1))
    assert torch.allclose(samples.lse, torch.logsumexp(logits[:, :45].double() / 0.5, -1))
    # fewer columns than n + 1: every column, π = 1, the missing entries -inf / id 0
    few = reference.teacher_sample_from_logits(logits, 7, 1.0, vocab_size=5, seed=8)
    assert sorted(few.indices[0, :5].tolist()) == [0, 1, 2, 3, 4]
    assert torch.isneginf(few.logprobs[:, 5:]).all() and (few.indices[:, 5:] == 0).all()
    assert torch.isneginf(few.log_threshold).all() and (few.log_inclusion[:, :5] == 0).all()
    assert torch.isneginf(few.log_inclusion[:, 5:]).all() and (few.weights[:, 5:] == 0).all()


def test_the_same_seed_draws_the_same_samples_and_row_offsets_compose():
    hidden, weight, bias = small_teacher_problem(6, rows=30, dtype=torch.float32)
    hidden, weight, bias = hidden.cpu(), weight.cpu(), bias.cpu()
    whole = kd.teacher_sample(hidden, weight, 6, seed=11, bias=bias)
    again = kd.teacher_sample(hidden, weight, 6, seed=11, bias=bias)
    other = kd.teacher_sample(hidden, weight, 6, seed=12, bias=bias)
    assert torch.equal(whole.indices, again.indices) and torch.equal(whole.logprobs, again.logprobs)
    assert (whole.indices != other.indices).any(dim=1).float().mean() > 0.5
    tail = kd.teacher_sample(hidden[10:], weight, 6, seed=11, bias=bias, row_offset=10)
    assert torch.equal(tail.indices, whole.indices[10:]) and torch.equal(tail.log_threshold, whole.log_threshold[10:])


@pytest.fixture
def torch_ranking(monkeypatch):
    """The rows' ranking by one torch.sort (the interpreter runs the Triton one slowly; one test keeps it)."""
    monkeypatch.setattr(sample_keys, "top_of_counted_keys", torch_top_of_counted_keys)


def torch_top_of_counted_keys(keys, counts, k, order):
    """`sort_keys.top_of_counted_keys` of raw keys (a float's bits above its column) by one torch.sort."""
    values, columns = (keys >> 32).to(torch.int32).view(torch.float32), keys & 0xFFFFFFFF
    filled = torch.arange(keys.shape[1], device=keys.device) < counts.unsqueeze(1)
    empty = sort_keys.value_column_keys(torch.tensor([-math.inf]), torch.tensor([sort_keys.EMPTY_COLUMN])).item()
    top, ids = sort_keys.top_of_keys(torch.where(filled, sort_keys.value_column_keys(values, columns), empty), k)
    return top, ids.to(torch.int32)


def check_samples(got: TeacherSamples, expected: TeacherSamples, atol: float = 1e-5) -> None:
    assert got.logprobs.dtype == torch.float32 and got.indices.dtype == torch.int32
    assert torch.equal(got.indices.cpu(), expected.indices.cpu().to(torch.int32))
    for name in ("logprobs", "log_threshold", "lse"):
        actual, wanted = getattr(got, name).double().cpu(), getattr(expected, name).cpu()
        assert torch.equal(torch.isneginf(actual), torch.isneginf(wanted)), name
        finite = torch.isfinite(wanted)
        assert torch.allclose(actual[finite], wanted[finite], atol=atol, rtol=0), name


@pytest.mark.interpret
@pytest.mark.parametrize("dtype, num_samples, temperature, options", [
    pytest.param(torch.float32, 1, 1.0, dict(bias=False), marks=INTERPRETER_ONLY),
    (torch.float16, 5, 0.7, dict(chunk_rows=8, row_offset=2**33 + 1)),
    (torch.float16, 16, 2.0, dict(stride=3, rows=12, triton_ranking=True)),
])
def test_the_appended_schedule_matches_the_reference(dtype, num_samples, temperature, options, monkeypatch, redone):
    if not options.get("triton_ranking"):
        monkeypatch.setattr(sample_keys, "top_of_counted_keys", torch_top_of_counted_keys)
    hidden, weight, bias = small_teacher_problem(num_samples + 40, rows=options.get("rows", 20), dtype=dtype)
    bias = bias if options.get("bias", True) else None
    row_offset = options.get("row_offset", 0)
    got = schedules.teacher_sample_appended(hidden, weight, num_samples, temperature, 200, bias, 31, row_offset,
                                            options.get("chunk_rows"), stride=options.get("stride"))
    expected = reference.teacher_sample(hidden, weight, num_samples, temperature, 200, bias, seed=31,
                                        row_offset=row_offset)
    check_samples(got, expected)
    assert got.temperature == temperature and got.seed == 31 and (got.indices < 200).all()
    assert redone == []  # every row finished by its floor: none listed


def test_global_rows_are_a_first_index_or_listed_int64_rows():
    stand_in = torch.empty(1)
    assert row_operands(7, stand_in) == (stand_in, 7, False)
    listed = torch.tensor([3, 1])
    assert row_operands(listed, stand_in) == (listed, 0, True)
    with pytest.raises(ValueError, match=r"global_rows: expected \[R\] int64 row indices .* of shape \[\]"):
        row_operands(torch.tensor(4), stand_in)
    with pytest.raises(ValueError, match="got torch.int32 of shape"):
        row_operands(listed.int(), stand_in)
    with pytest.raises(TypeError, match="global_rows: expected an int .* got float"):
        row_operands(2.0, stand_in)


@pytest.mark.interpret
def test_no_rows_give_empty_samples():
    hidden, weight, bias = small_teacher_problem(8, rows=4, dtype=torch.float16)
    got = schedules.teacher_sample_appended(hidden[:0], weight, 5, 1.0, 200, bias, 3)
    assert got.logprobs.shape == (0, 5) and got.indices.shape == (0, 5) and got.lse.shape == (0,)


@pytest.mark.interpret
def test_the_logits_schedule_matches_the_reference(torch_ranking):
    generator = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(8, 203, generator=generator)).to(DEVICE, torch.float16)
    got = kd.teacher_sample_from_logits(logits, 9, seed=5, temperature=0.6, vocab_size=190, backend="triton")
    check_samples(got, reference.teacher_sample_from_logits(logits, 9, 0.6, 190, seed=5))
    # fewer columns than n: every column, π = 1
    few = kd.teacher_sample_from_logits(logits, 9, seed=5, vocab_size=9, backend="triton")
    check_samples(few, reference.teacher_sample_from_logits(logits, 9, 1.0, 9, seed=5))
    assert torch.isneginf(few.log_threshold).all()


@pytest.mark.interpret
def test_float32_hidden_takes_the_logits_schedule(torch_ranking):
    hidden, weight, bias = small_teacher_problem(12, rows=10, dtype=torch.float32)
    got = schedules.teacher_sample_logits(hidden, weight, 4, 1.3, 200, bias, 2, 7, chunk_rows=4)
    check_samples(got, reference.teacher_sample(hidden, weight, 4, 1.3, 200, bias, seed=2, row_offset=7))


@pytest.fixture
def redone(monkeypatch) -> list:
    """The count of rows listed for each exact redo (`redo_listed_rows`) that had any, in call
    order (read on the host here; the schedule itself never reads it)."""
    counts, original = [], schedules.redo_listed_rows

    def counted(*args):
        original(*args)
        if args[9].item():
            counts.append(args[9].item())
    monkeypatch.setattr(schedules, "redo_listed_rows", counted)
    return counts


@pytest.mark.interpret
def test_candidates_are_made_noisy_and_the_rows_to_redo_flagged_and_listed():
    # rows of 40 columns, n = 3, 16 slots: row 0's floor between its 4th and 5th largest exact
    # keys (kept), row 1's between its 3rd and 4th (too few keys reach it), row 2 counted past the
    # slots, row 3 a −inf floor over 3 keys (all of them samples: kept), row 4's floor between
    # its 10th and 11th (kept), row 5 the floors' least floor (−FLT_MAX) over 3 keys (too few)
    rows, width, num_samples, temperature, seed, first_row, capacity = 6, 40, 3, 0.8, 7, 11, 16
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(3)) * 2
    exact = logits.double() / temperature + sampling.gumbel_noise(seed, first_row + torch.arange(rows),
                                                                   torch.arange(width))
    ordered, order = exact.sort(dim=1, descending=True)
    floors = torch.tensor([(ordered[0, 3] + ordered[0, 4]) / 2, (ordered[1, 2] + ordered[1, 3]) / 2, -1e4,
                           -math.inf, (ordered[4, 9] + ordered[4, 10]) / 2, -3.4028234663852886e38],
                          dtype=torch.float32)
    kept = [10, 10, capacity, 3, 14, 3]  # each row's candidates: its largest keys (row 2: the first slots)
    counts = torch.tensor([10, 10, width, 3, 14, 3], dtype=torch.int32)
    raw = torch.zeros(rows, capacity, dtype=torch.int64)
    for row, number in enumerate(kept):
        columns = order[row, :number]
        raw[row, :number] = (logits[row, columns].view(torch.int32).long() << 32) | columns
    keys, overflow = raw.to(DEVICE), torch.ones(rows, dtype=torch.bool, device=DEVICE)
    count, listed = torch.tensor([1], dtype=torch.int32, device=DEVICE), torch.full((8,), -1, dtype=torch.int32,
                                                                                    device=DEVICE)
    sample_keys.noise_candidates(keys, counts.to(DEVICE), floors.to(DEVICE), num_samples, temperature,
                                 sampling.seed_key(seed), first_row, overflow, (count, listed), row_base=20)
    assert overflow.tolist() == [False, True, True, False, False, True]
    # listed after the one already there, as rows of the call (row_base + the row)
    assert count.item() == 4 and sorted(listed[1:4].tolist()) == [21, 22, 25] and listed[4:].eq(-1).all()
    keys = keys.cpu()
    for row, number in enumerate(kept):  # the same columns, their keys κ = z / τ + G in the value bits
        assert torch.equal(keys[row, :number] & 0xFFFFFFFF, order[row, :number])
        kappa = (keys[row, :number] >> 32).to(torch.int32).view(torch.float32).double()
        assert torch.allclose(kappa, ordered[row, :number], atol=1e-5, rtol=1e-6)


@pytest.mark.interpret
def test_rows_whose_floor_keeps_too_few_keys_are_redone_exactly(monkeypatch, torch_ranking, redone):
    # r = 1: the floor is the sample's largest key, above the (n+1)-th largest in most rows
    monkeypatch.setattr(topk_from_appended, "sample_rank", lambda k, stride, width: 1)
    # a fresh plan cache: plans cached before the patch took the real rank
    monkeypatch.setattr(schedules, "sample_plan", functools.lru_cache(schedules.sample_plan.__wrapped__))
    hidden, weight, bias = small_teacher_problem(14, rows=12, dtype=torch.float16)
    got = schedules.teacher_sample_appended(hidden, weight, 6, 1.0, 200, bias, 3, stride=4)
    assert sum(redone) > 6
    check_samples(got, reference.teacher_sample(hidden, weight, 6, 1.0, 200, bias, seed=3))


@pytest.mark.interpret
def test_rows_far_above_their_floor_are_redone_exactly(torch_ranking, redone):
    # one column 120 nats above the rest: every row's maximum is over MAX_EXCESS2 above its floor
    hidden, weight, bias = small_teacher_problem(14, rows=12, dtype=torch.float16)
    bias = bias.clone()
    bias[17] += 120.0
    got = schedules.teacher_sample_appended(hidden, weight, 6, 1.0, 200, bias, 3)
    assert redone == [12]
    check_samples(got, reference.teacher_sample(hidden, weight, 6, 1.0, 200, bias, seed=3))
    assert (got.indices[:, 0] == 17).all()


@pytest.mark.interpret
def test_a_row_of_massively_tied_keys_gets_nan_from_the_whole_schedule(torch_ranking, redone):
    # row 1: 600 keys tie, more than any slots: listed, redone, NaN; the others draw from a uniform row
    hidden, weight = tied_row_problem(6, rows=20)
    got = schedules.teacher_sample_appended(hidden, weight, 4, 1.0, 600, None, 3)
    assert redone and got.logprobs[1].isnan().all() and got.log_threshold[1].isnan()
    assert (got.indices[1] == 0).all()
    others = [row for row in range(20) if row != 1]
    expected = reference.teacher_sample(hidden, weight, 4, 1.0, 600, None, seed=3)
    check_samples(TeacherSamples(got.logprobs[others], got.indices[others], got.log_threshold[others],
                                 got.lse[others], 1.0, 3),
                  TeacherSamples(expected.logprobs[others], expected.indices[others],
                                 expected.log_threshold[others], expected.lse[others], 1.0, 3))


@pytest.mark.interpret
def test_the_sampling_matmul_keeps_every_element_at_or_above_its_floor():
    # floors between each row's 10th and 11th largest exact key (row 3: far below every key, so
    # counted past the capacity for the logits schedule to redo; row 4: above every key)
    hidden, weight, bias = small_teacher_problem(15, rows=20, dtype=torch.float16)
    rows, width, temperature, seed, first_row = 20, 200, 0.7, 4, 50
    tempered = reference.lm_head_logits(hidden, weight, bias)[:, :width].cpu() / temperature
    keys = tempered + sampling.gumbel_noise(seed, first_row + torch.arange(rows), torch.arange(width))
    ordered = keys.sort(dim=1, descending=True).values
    floors = ((ordered[:, 9] + ordered[:, 10]) / 2).float()
    floors[3], floors[4] = -1e4, ordered[4, 0].float() + 1
    appends = SampleAppends(floors.to(DEVICE), torch.zeros(rows, 512, dtype=torch.int64, device=DEVICE),
                            torch.zeros(rows, dtype=torch.int32, device=DEVICE))
    tile_max2, tile_sum2 = SampleMatmul(hidden, weight, bias, width, temperature, sampling.seed_key(seed))(
        appends, first_row=first_row)
    # the statistics give each row's logsumexp (row 3's tiles pass 2^MAX_EXCESS2: redone anyway)
    lse = tile_logsumexp(tile_max2, tile_sum2, torch.empty(rows, device=DEVICE)).cpu().double()
    others = [row for row in range(rows) if row != 3]
    assert torch.allclose(lse[others], torch.logsumexp(tempered, dim=1)[others], atol=1e-5, rtol=1e-6)
    counts = appends.counts.cpu()
    assert counts[3] > appends.keys.shape[1] and counts[4] <= 2  # row 3: past the capacity
    for row in (row for row in range(rows) if row != 3):
        raw = appends.keys[row, :counts[row]].cpu()
        columns = (raw & 0xFFFFFFFF).tolist()
        assert len(set(columns)) == len(columns) and max(columns, default=0) < width
        wanted = (keys[row] >= floors[row].double()).nonzero().flatten().tolist()
        assert set(wanted) <= set(columns), row
        values = (raw >> 32).to(torch.int32).view(torch.float32).double()
        assert torch.allclose(values, tempered[row, columns] * temperature, atol=1e-4, rtol=0)
        if row != 4:  # a superset, but not a loose one: ~P(coarse bits ≤ X · 2^16) ≤ X + 2^-16
            assert counts[row] < 10 + 6 * 10 ** 0.5 + 3


def test_the_floors_sample_fits_one_block_where_the_key_slots_allow():
    from kd_kernels.ops.topk_from_appended import appended_plan

    for width, num_samples in ((151_936, 16), (128_256, 16), (151_936, 64)):  # sparser: the sample fits 2048
        plan = appended_plan(width, num_samples + 1, schedules.sample_stride(width, num_samples))
        default = appended_plan(width, num_samples + 1)
        assert plan.stride > default.stride and plan.sample_width <= schedules.FLOOR_COLUMNS < default.sample_width
        assert plan.capacity <= default.capacity
    # the top-k plan's where the sparser sample needs more key slots, or they are at the sort's limit
    for width, num_samples in ((151_936, 12), (151_936, 1023), (32_000, 16), (200, 6)):
        assert schedules.sample_stride(width, num_samples) == appended_plan(width, num_samples + 1).stride


def test_teacher_samples_pack_and_unpack():
    generator = torch.Generator().manual_seed(6)
    samples = kd.teacher_sample_from_logits(torch.randn(5, 40, generator=generator), 4, seed=2**64 - 3,
                                            temperature=0.9)
    for dtype in (torch.float32, torch.bfloat16):
        back = TeacherSamples.unpack(samples.pack(dtype))
        assert torch.equal(back.indices, samples.indices) and torch.equal(back.log_threshold, samples.log_threshold)
        assert torch.equal(back.logprobs, samples.logprobs.to(dtype)) and torch.equal(back.lse, samples.lse)
        assert back.temperature == 0.9 and back.seed == 2**64 - 3
    moved = samples.to(torch.bfloat16)
    assert moved.logprobs.dtype == torch.bfloat16 and moved.log_threshold.dtype == torch.float32 and moved.seed
    unseeded = TeacherSamples(samples.logprobs, samples.indices, samples.log_threshold)
    back = TeacherSamples.unpack(unseeded.pack())
    assert back.seed is None and back.lse is None and back.temperature is None
    assert samples.pack(torch.bfloat16).numel() == 64 + 4 * 6 + 64 + 5 * 4 * (4 + 2) + 5 * 4
    with pytest.raises(ValueError, match="not made by TeacherSamples.pack"):
        TeacherSamples.unpack(samples.pack()[64 + 24:])
    with pytest.raises(ValueError, match="not made by TeacherSamples.pack"):
        TeacherSamples.unpack(kd.TopK(samples.logprobs, samples.indices).pack())


def test_inclusion_probabilities_and_weights():
    logprobs = torch.tensor([[-0.1, -2.0, -30.0, -math.inf]])
    samples = TeacherSamples(logprobs, torch.tensor([[1, 2, 3, 0]], dtype=torch.int32), torch.tensor([-1.5]))
    expected = -torch.expm1(-torch.exp(logprobs.double() + 1.5))
    assert torch.allclose(samples.log_inclusion[0, :3].double(), expected[0, :3].log(), atol=1e-6, rtol=1e-6)
    assert torch.isneginf(samples.log_inclusion[0, 3]) and samples.weights[0, 3] == 0
    assert torch.allclose(samples.weights[0, :3].double(), logprobs[0, :3].double().exp() / expected[0, :3], rtol=1e-6)
    assert abs(samples.weights[0, 2].item() - math.exp(-1.5)) < 1e-7  # a deep tail sample weighs e^{κ*}


def test_the_public_functions_validate_their_arguments():
    hidden, weight, _ = small_teacher_problem(1, rows=4, columns=20, dtype=torch.float32)
    hidden, weight = hidden.cpu(), weight.cpu()
    for kwargs, message in ((dict(num_samples=0), "num_samples: expected an int in \\[1, 20\\]"),
                            (dict(num_samples=21), "num_samples"),
                            (dict(seed=-1), "seed: expected an int in \\[0, 2\\*\\*64\\)"),
                            (dict(seed=1.5), "seed"),
                            (dict(row_offset=-2), "row_offset"),
                            (dict(temperature=0.0), "temperature")):
        arguments = dict(num_samples=3, seed=1) | kwargs
        with pytest.raises(ValueError, match=message):
            kd.teacher_sample(hidden, weight, **arguments)
    with pytest.raises(TypeError, match="logprobs_dtype"):
        kd.teacher_sample(hidden, weight, 3, seed=1, logprobs_dtype=torch.int32)
    with pytest.raises(TypeError, match="seed"):
        kd.teacher_sample(hidden, weight, 3)
    with pytest.raises(ValueError, match="backend"):
        kd.teacher_sample_from_logits(hidden @ weight.T, 3, seed=1, backend="nope")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="teacher_sample is not implemented by the cuda backend|not built"):
            kd.teacher_sample(hidden, weight, 3, seed=1, backend="cuda")
    samples = kd.teacher_sample(hidden, weight, 20, seed=1, logprobs_dtype=torch.bfloat16)
    assert samples.logprobs.dtype == torch.bfloat16 and torch.isneginf(samples.log_threshold).all()
    assert sorted(samples.indices[0].tolist()) == list(range(20))


@pytest.mark.gpu
def test_the_appended_schedule_matches_the_reference_at_the_real_tiles():
    # 128 × 256 tiles, the stores in PTX, rows past a tile, a partial last tile, n = 16 and 64
    generator = torch.Generator(device="cuda").manual_seed(8)
    hidden = (0.3 * torch.randn(300, 4096, device="cuda", generator=generator)).bfloat16()
    weight = (0.02 * torch.randn(20_096, 4096, device="cuda", generator=generator)).bfloat16()
    bias = torch.randn(20_096, device="cuda", generator=generator).bfloat16()
    for num_samples, temperature in ((16, 1.0), (64, 0.5)):
        got = kd.teacher_sample(hidden, weight, num_samples, seed=3, temperature=temperature, vocab_size=20_000,
                                bias=bias, row_offset=1000)
        expected = reference.teacher_sample(hidden, weight, num_samples, temperature, 20_000, bias, seed=3,
                                            row_offset=1000)
        # ids may differ only at keys within float32 rounding of each other: there, the exact keys agree
        noise = sampling.gumbel_noise(3, 1000 + torch.arange(300, device="cuda"), torch.arange(20_000, device="cuda"))
        keys = reference.lm_head_logits(hidden, weight, bias)[:, :20_000] / temperature + noise
        got_keys = keys.gather(1, got.indices.long())
        assert torch.allclose(got_keys, keys.gather(1, expected.indices.long()), atol=1e-4, rtol=0)
        same = got.indices == expected.indices.int()
        assert same.float().mean() > 0.999
        assert torch.allclose(got.logprobs.double()[same], expected.logprobs[same], atol=1e-4, rtol=0)
        assert torch.allclose(got.log_threshold.double(), expected.log_threshold, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_the_kernels_noise_equals_the_references_on_the_gpu():
    rows = torch.tensor([0, 1, 2**31 + 5, 2**40 + 3])
    noise, coarse, bound = triton_noise(77, rows, 4096)
    assert torch.equal(coarse, sampling.noise_bits(77, rows, torch.arange(4096)) >> 16)
    expected = sampling.gumbel_noise(77, rows, torch.arange(4096))
    assert (noise.double() - expected).abs().max() < 2e-6 * expected.abs().max()
    assert (bound.double() <= expected + 1e-5).all()  # the GPU's fast logs keep the floors' bound
