"""One allocation carved into several work tensors (kd_kernels/ops/buffers.py)."""
import torch

from kd_kernels.ops.buffers import ALIGNMENT, empty_parts


def test_parts_have_their_shapes_and_dtypes_start_aligned_and_do_not_overlap():
    parts = [((3, 5), torch.float32), ((3, 7), torch.int8), ((2, 3), torch.float32), ((4,), torch.int64)]
    tensors = empty_parts("cpu", *parts)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(shape, dtype) for shape, dtype in parts]
    assert all(t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one allocation
    for number, tensor in enumerate(tensors):
        tensor.fill_(number + 1)
    assert [t.unique().tolist() for t in tensors] == [[1], [2], [3], [4]]  # no part wrote into another
