"""`HostValue`: a device value as it is at a point of the stream, read later without waiting on
work queued after that point."""
import pytest
import torch

from helpers import HAS_CUDA
from kd_kernels.ops.host_value import HostValue


def test_the_value_is_the_tensors_at_the_point_it_was_made():
    counter = torch.tensor([7], dtype=torch.int32)
    value = HostValue(counter)
    counter += 5
    assert value.value() == 7 and HostValue(counter).value() == 12


@pytest.mark.parametrize("tensor", [torch.zeros(2, dtype=torch.int32), torch.zeros(1)])
def test_other_tensors_are_refused(tensor):
    with pytest.raises(ValueError, match="tensor: expected one integer element"):
        HostValue(tensor)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_on_a_gpu_work_queued_after_the_point_does_not_change_the_value():
    counter = torch.tensor([3], dtype=torch.int32, device="cuda")
    big = torch.randn(4096, 4096, device="cuda")
    value = HostValue(counter)
    for _ in range(20):  # queued after the point: the value does not wait for it, nor see it
        big = big @ big.T / 4096
    counter += 1
    assert value.value() == 3
    torch.cuda.synchronize()
    assert counter.item() == 4
