"""TMA descriptors of row-major 2-D tensors for the Triton matmul kernels."""
import torch


def tma_rows(tensor: torch.Tensor) -> bool:
    """Whether TMA can move ``tensor [R, C]``'s rows: contiguous, each starting at a 16-byte
    boundary."""
    return (tensor.stride(1) == 1 and (tensor.stride(0) * tensor.element_size()) % 16 == 0
            and tensor.data_ptr() % 16 == 0)


def row_tile_descriptor(tensor: torch.Tensor, name: str, block_shape: list, user: str):
    """A descriptor of ``tensor [R, C]`` read or written in ``block_shape`` tiles (zero past its
    ends on loads, clipped on stores). ``name`` and ``user`` (what asked for TMA) go into the
    error where `tma_rows` does not hold."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_rows(tensor):
        raise ValueError(f"{name}: {user} moves rows by TMA, which needs contiguous rows starting at 16-byte "
                         f"boundaries (a row length that is a multiple of 16 bytes: a hidden size that is a "
                         f"multiple of 8 in 16-bit dtypes); got strides {tuple(tensor.stride())} of {tensor.dtype} "
                         f"at address {tensor.data_ptr()}")
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block_shape)
