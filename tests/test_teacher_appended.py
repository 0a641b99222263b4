"""The teacher's appended schedule against the float64 reference: no float32 logits stored; the
epilogue matmul appends each element reaching its row's floor to the row's keys (an atomic
slot each), a per-row step merges the logsumexp and compacts the keys, raising the floor
(ops/settle_appended_keys.py); rows whose appends passed the capacity are redone exactly.
Interpreter tiles: 16 rows × 32 columns, groups of 8."""
import pytest
import torch

from helpers import HAS_CUDA, check_teacher_topk, small_teacher_problem
from kd_kernels import reference
from kd_kernels.ops.slice_candidates import slice_key_capacity
from kd_kernels.teacher_chunked import APPENDED_BYTES, appended_tile, teacher_topk_appended

pytestmark = pytest.mark.interpret
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _problem(seed, rows=21, **options):
    return small_teacher_problem(seed, rows, **options)


def _count_redone_rows(monkeypatch):
    from kd_kernels import teacher_chunked

    redone = []
    redo = teacher_chunked._redo_rows
    monkeypatch.setattr(teacher_chunked, "_redo_rows", lambda overflow, *args: (
        redone.append(int(overflow.sum())), redo(overflow, *args))[1])
    return redone


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 1e-4)])
@pytest.mark.parametrize("k, tile, rows_redone", [(3, (16, 32), 0), (5, (8, 64), 0), (20, (21, 192), 0),
                                                  (70, (21, 96), 0), (20, (21, 152), 21)])
def test_appended_schedule_matches_the_reference(k, tile, rows_redone, dtype, atol, monkeypatch):
    """k = 3, 5 and 20 take their first floor from ≥ k groups of the first slice and append
    after it; k = 70 has 12 groups there, so no floor: its 512 keys take whole slices until the
    settle step compacts them (no row redone: the keys give the answer). k = 20 over 152-column
    slices: 19 groups, no floor, 152 appends > 128 keys: every row is redone."""
    redone = _count_redone_rows(monkeypatch)
    hidden, weight, bias = _problem(k, dtype=dtype)
    top = teacher_topk_appended(hidden, weight, k, 2.0, 200, bias, tile=tile)
    expected = reference.teacher_topk(hidden, weight, k, 2.0, 200, bias)
    check_teacher_topk(top, expected, atol, reference.lm_head_logits(hidden, weight, bias), 2.0, 200)
    assert redone == [rows_redone]


def test_a_later_slice_with_many_larger_elements_overflows_and_is_redone(monkeypatch):
    """Row logits = the bias: the first slice's 8-th largest group maximum is small, and the
    third slice holds 96 larger elements: more than the 64 keys, so the row is redone."""
    hidden, weight, _ = _problem(2, rows=3, columns=256)
    hidden[:] = 0
    bias = -torch.rand(256, generator=torch.Generator().manual_seed(1)).to(DEVICE) - 1  # in (-2, -1)
    bias[128:224] = torch.linspace(1.0, 2.0, 96, device=DEVICE)
    redone = _count_redone_rows(monkeypatch)
    top = teacher_topk_appended(hidden, weight, 8, 1.0, 256, bias, tile=(16, 64))
    expected = reference.teacher_topk(hidden, weight, 8, 1.0, 256, bias)
    assert redone == [3] and top.indices.tolist() == [list(range(223, 215, -1))] * 3
    check_teacher_topk(top, expected, 1e-5, reference.lm_head_logits(hidden, weight, bias), 1.0, 256)


def test_settling_compacts_to_the_kth_largest_and_raises_the_floor():
    """One appending slice, then the settle step: rows past half their 64 keys keep those
    reaching their k-th largest logit of the slice, which becomes their floor."""
    from kd_kernels.ops.lm_head_group_maxima import EpilogueMatmul
    from kd_kernels.ops.settle_appended_keys import settle_appended_keys
    from kd_kernels.ops.slice_candidates import SliceState

    hidden, weight, bias = _problem(4, rows=5, columns=64)
    state = SliceState.empty(5, 64, hidden.device)  # floors -inf: the whole slice is appended
    summaries = EpilogueMatmul(hidden, weight, bias, 64, 1.0, None)(0, 64, append=(state.floors, state.keys,
                                                                                   state.counts))
    assert state.counts.tolist() == [64] * 5
    settle_appended_keys(summaries, state, 3, 32)
    logits = reference.lm_head_logits(hidden, weight, bias).float()
    assert torch.allclose(state.floors, logits.topk(3, dim=-1).values[:, 2], atol=1e-5, rtol=0)
    assert state.counts.tolist() == [3] * 5 and not state.overflow.any()
    kept = state.keys[:, :3]
    kept_columns = (0xFFFFFFFF - (kept & 0xFFFFFFFF)).sort(dim=-1).values
    assert torch.equal(kept_columns.cpu(), logits.topk(3, dim=-1).indices.sort(dim=-1).values.cpu())
    lse = (state.max2 + torch.log2(state.sum2)) * torch.log(torch.tensor(2.0))
    assert torch.allclose(lse.double().cpu(), torch.logsumexp(logits.double(), -1).cpu(), atol=1e-5, rtol=0)


def test_appended_tile_stays_within_its_bytes_and_takes_k_groups_first():
    from kd_kernels.ops.lm_head_group_maxima import default_config

    config = default_config()
    for num_rows in (1, 8192, 100_000):
        for k in (1, 8, 64, 256):
            rows, columns = appended_tile(num_rows, k)
            summaries = 8 * (columns // config.block_n) + 4 * (columns // config.group_columns)
            assert rows * (8 * slice_key_capacity(k) + summaries) <= APPENDED_BYTES and rows <= num_rows
            assert columns // config.group_columns >= k and columns % config.block_n == 0


def test_the_appended_schedule_sizes_its_own_tiles_and_takes_k_up_to_256(monkeypatch):
    import kd_kernels as kd

    hidden, weight, bias = _problem(5, dtype=torch.float16)
    monkeypatch.setenv("KD_KERNELS_TEACHER_SCHEDULE", "appended")
    with pytest.raises(ValueError, match="chunk_rows: the appended schedule sizes its own tiles"):
        kd.teacher_topk(hidden, weight, k=4, backend="triton", chunk_rows=8)
    with pytest.raises(ValueError, match="k: the appended schedule takes"):
        teacher_topk_appended(hidden, weight, 257, 1.0, 200, bias)
