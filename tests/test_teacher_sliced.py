"""The teacher's sliced schedule against the float64 reference: vocab slices of the epilogue
matmul, each row's running logsumexp and floor, candidate keys compacted to the k-th largest
when they would pass their capacity (ops/slice_candidates.py), one ranking at the end, rows of
massive ties redone exactly. Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import pytest
import torch

from helpers import HAS_CUDA, check_teacher_topk, small_teacher_problem
from kd_kernels import reference
from kd_kernels.ops.slice_candidates import slice_key_capacity
from kd_kernels.teacher_chunked import SLICED_BYTES, sliced_tile, teacher_topk_sliced

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _problem(seed, rows=21, **options):
    return small_teacher_problem(seed, rows, **options)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 1e-4)])
@pytest.mark.parametrize("k, tile", [(3, (16, 32)), (5, (8, 64)), (40, (16, 32)), (70, (21, 96))])
def test_sliced_schedule_matches_the_reference(k, tile, dtype, atol):
    """Slices of 32-96 columns against capacities of 64 and 256 keys: k = 3 and 5 compact in
    the first slices (more new elements than the capacity), 40 and 70 after several."""
    hidden, weight, bias = _problem(k, dtype=dtype)
    top = teacher_topk_sliced(hidden, weight, k, 2.0, 200, bias, tile=tile)
    expected = reference.teacher_topk(hidden, weight, k, 2.0, 200, bias)
    check_teacher_topk(top, expected, atol, reference.lm_head_logits(hidden, weight, bias), 2.0, 200)


@pytest.mark.parametrize("k, tile", [(3, (16, 64)), (40, (21, 96))])
def test_sliced_schedule_reads_a_slice_in_blocks(k, tile, monkeypatch):
    """Slices of several 16-column blocks: each block appends (or compacts) after the last one's
    keys, in one program."""
    from kd_kernels.ops import slice_candidates

    monkeypatch.setattr(slice_candidates, "BLOCK_COLUMNS", 16)
    hidden, weight, bias = _problem(k + 1)
    top = teacher_topk_sliced(hidden, weight, k, 2.0, 200, bias, tile=tile)
    expected = reference.teacher_topk(hidden, weight, k, 2.0, 200, bias)
    check_teacher_topk(top, expected, 1e-5, reference.lm_head_logits(hidden, weight, bias), 2.0, 200)


def test_the_torch_ranking_takes_pieces_of_rows(monkeypatch):
    """Without the extension the keys are ranked by a torch sort, a few rows at a time (its
    temporaries bounded): 4 rows a piece here, the last piece 1 row."""
    from kd_kernels import teacher_chunked

    monkeypatch.setattr(teacher_chunked, "RANK_PIECE_BYTES", 3 * 64 * 8 * 4)
    hidden, weight, bias = _problem(11)
    top = teacher_topk_sliced(hidden, weight, 5, 2.0, 200, bias, tile=(21, 64), select="triton")
    expected = reference.teacher_topk(hidden, weight, 5, 2.0, 200, bias)
    check_teacher_topk(top, expected, 1e-5, reference.lm_head_logits(hidden, weight, bias), 2.0, 200)


def test_sliced_schedule_fewer_columns_than_k_and_massive_ties():
    hidden, weight, bias = _problem(7, columns=96)
    hidden[[2, 9]] = 0  # logits = the bias rounded alike: every element of those rows ties
    bias[:] = 0.25
    bias[77] = 1.0
    top = teacher_topk_sliced(hidden, weight, 100, 1.0, 90, bias, tile=(16, 32))  # 90 columns < k
    expected = reference.teacher_topk(hidden, weight, 100, 1.0, 90, bias)
    assert torch.equal(top.indices[:, :90].cpu(), expected.indices[:, :90].to(torch.int32).cpu())
    assert torch.allclose(top.logprobs[:, :90].double().cpu(), expected.logprobs[:, :90].cpu(), atol=1e-5, rtol=0)
    assert torch.allclose(top.lse.double().cpu(), expected.lse.cpu(), atol=1e-5, rtol=0)
    assert top.indices[2, 0] == 77 and torch.equal(top.indices[2, 1:90].cpu(), torch.tensor(
        [c for c in range(90) if c != 77], dtype=torch.int32))  # ties: lower id first
    assert torch.isneginf(top.logprobs[:, 90:]).all() and (top.indices[:, 90:] == 0).all()


def test_sliced_schedule_redoes_rows_whose_ties_overflow_the_keys():
    """Rows where more than the capacity of elements tie at the k-th value overflow (the keys
    full of ties drop a later, larger element) and are redone by the full-row selection."""
    hidden, weight, bias = _problem(8, columns=300)
    hidden[[0, 20]] = 0
    bias[:] = 0.5
    bias[250] = 0.9  # in the fourth slice, after the 64 keys filled with ties
    top = teacher_topk_sliced(hidden, weight, 4, 1.0, 300, bias, tile=(16, 64))  # 299 ties > 64 keys
    expected = reference.teacher_topk(hidden, weight, 4, 1.0, 300, bias)
    check_teacher_topk(top, expected, 1e-5, reference.lm_head_logits(hidden, weight, bias), 1.0, 300)
    assert top.indices[0].tolist() == [250, 0, 1, 2] and top.indices[20].tolist() == [250, 0, 1, 2]


def test_sliced_tile_stays_within_its_bytes():
    for num_rows in (1, 8192, 100_000):
        for k in (1, 8, 64, 256):
            for multiprocessors, width in ((None, None), (132, None), (132, 151_936), (132, 1000)):
                rows, columns = sliced_tile(num_rows, k, multiprocessors, width)
                assert rows * (columns * 4 + slice_key_capacity(k) * 8) <= SLICED_BYTES
                assert columns % 256 == 0 and columns <= 4096 and rows <= num_rows


def test_sliced_tile_fills_whole_waves_of_the_matmul_tiles():
    """At k = 64 the bytes allow 3657 rows (28 row tiles × 12 column tiles = 336 tiles, 85 % of
    three waves of 132): 22 row tiles fill two waves; k = 8's 32 row tiles fill 97 % already."""
    assert sliced_tile(8192, 64, 132) == (2816, 3072)
    assert sliced_tile(8192, 8, 132) == (4096, 3072)
    assert sliced_tile(1000, 64, 132) == (1000, 3072)  # one chunk: nothing to fit


def test_sliced_tile_takes_the_slices_with_the_fewest_waves_over_the_whole_call():
    """With the vocab width the whole call's waves decide between 3072- and 4096-column slices:
    at k = 256, 2560 × 3072 leaves a last chunk of 512 rows (347 waves of 132 tiles), 2048 ×
    4096 takes 300; k = 8 and 64 keep their 3072-column slices (298 / 297 against 299 / 300 for
    3072 / 2048 rows × 4096);
    equal waves go to fewer launches (one chunk of 1000 rows: 38 slices of 4096, not 50)."""
    from kd_kernels.teacher_chunked import _tile_waves

    assert sliced_tile(8192, 256, 132, 151_936) == (2048, 4096)
    assert (_tile_waves(8192, 151_936, 2560, 3072, 132), _tile_waves(8192, 151_936, 2048, 4096, 132)) == (347, 300)
    assert sliced_tile(8192, 64, 132, 151_936) == (2816, 3072)
    assert sliced_tile(8192, 8, 132, 151_936) == (4096, 3072)
    assert sliced_tile(1000, 64, 132, 151_936) == (1000, 4096)
    # 256-row chunks and 512-column slices of 300 × 1000 on 3 multiprocessors: 2 × 2 tiles (2 waves),
    # 2 × 2 (the last slice, 488 columns: 2), 1 × 2 (the last chunk: 1), 1 × 2 (1)
    assert _tile_waves(300, 1000, 256, 512, 3) == 2 + 2 + 1 + 1


def test_sliced_schedule_rejects_k_past_its_limit_and_a_chunk_size(monkeypatch):
    import kd_kernels as kd

    hidden, weight, bias = _problem(1)
    with pytest.raises(ValueError, match="k: the sliced schedule takes"):
        teacher_topk_sliced(hidden, weight, 257, 1.0, 200, bias)
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "sliced")
    with pytest.raises(ValueError, match="chunk_rows: the sliced schedule sizes its own tiles"):
        kd.teacher_topk(hidden.half(), weight.half(), k=4, backend="triton", chunk_rows=8)


def test_an_element_just_above_the_floor_in_a_later_slice_enters():
    """Row logits = the bias: the top-3 of the first slices (3, 2, 1) set the floor to 1 when
    their keys are compacted; a later slice's 1.005 must still replace the 1."""
    hidden, weight, _ = _problem(3, rows=2, columns=256)
    hidden[:] = 0
    bias = -torch.rand(256, generator=torch.Generator().manual_seed(0)).to(DEVICE)  # below 0, distinct
    bias[[0, 1, 2]] = torch.tensor([3.0, 2.0, 1.0], device=DEVICE)
    bias[200] = 1.005
    top = teacher_topk_sliced(hidden, weight, 3, 1.0, 256, bias, tile=(16, 32))  # compaction at the third slice
    assert top.indices.tolist() == [[0, 1, 200]] * 2
    check_teacher_topk(top, reference.teacher_topk(hidden, weight, 3, 1.0, 256, bias), 1e-5,
                       reference.lm_head_logits(hidden, weight, bias), 1.0, 256)


def test_a_compaction_sets_the_floor_to_the_kth_largest_of_the_keys_and_the_new_elements():
    """Three 32-column slices into 64 keys at k = 3: the third slice compacts, and each row's
    floor becomes the third largest of all 96 logits (not of the 64 held keys alone); the keys
    left are those reaching it."""
    from kd_kernels.ops.lm_head_group_maxima import lm_head_logits_with_summaries, padded_width
    from kd_kernels.ops.slice_candidates import SliceState, append_slice_candidates

    hidden, weight, bias = _problem(4, rows=5, columns=96)
    state = SliceState.empty(5, 64, hidden.device)
    buffer = torch.empty(5, padded_width(32), device=hidden.device)
    seen = []
    for start in (0, 32, 64):
        summaries = lm_head_logits_with_summaries(hidden, weight[start:start + 32], bias[start:start + 32], 32, 1.0,
                                                  buffer)
        append_slice_candidates(buffer, summaries, state, 32, start, 3)
        seen.append(buffer[:, :32].clone())
    third = torch.cat(seen, dim=1).topk(3, dim=-1).values[:, 2]
    assert torch.equal(state.floors, third)
    assert state.counts.tolist() == [3] * 5 and not state.overflow.any()
