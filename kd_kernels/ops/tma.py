"""TMA descriptors of row-major 2-D tensors for the Triton matmul kernels."""
import torch


def row_tile_descriptor(tensor: torch.Tensor, name: str, block_shape: list, user: str):
    """A descriptor of ``tensor [R, C]`` read or written in ``block_shape`` tiles (zero past its
    ends). TMA needs contiguous rows starting at 16-byte boundaries; ``name`` and ``user`` (what
    asked for TMA) go into the error otherwise."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    row_bytes = tensor.stride(0) * tensor.element_size()
    if tensor.stride(1) != 1 or row_bytes % 16 or tensor.data_ptr() % 16:
        raise ValueError(f"{name}: {user} reads rows by TMA, which needs contiguous rows starting at 16-byte "
                         f"boundaries (a hidden size that is a multiple of 8 in 16-bit dtypes); got strides "
                         f"{tuple(tensor.stride())} of {tensor.dtype} at address {tensor.data_ptr()}")
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block_shape)
