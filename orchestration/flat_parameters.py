"""A model's parameters as views of one flat buffer, so that a whole-model weight update between
two such models is one device copy.

`flatten_parameters` moves every parameter of a module (``named_parameters`` order, tied
parameters once) into one 1-D buffer of their common dtype, each at an element offset rounded up
to `ELEMENT_ALIGNMENT` elements (`flat_offsets`), and points the parameter at its view
(``parameter.data = view``; the Parameter objects, hence an optimizer's references and state,
are unchanged). Two models of the same architecture flattened this way have the same element
layout whatever their dtypes, so ``target_flat.copy_(source_flat)`` updates every parameter at
once, casting if the dtypes differ (a float32 trainer into a bfloat16 rollout copy).

`flat_region` recognizes such a layout in a list of tensors (e.g. the CUDA IPC views of another
process's flattened parameters) and returns the one 1-D tensor that spans it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

ELEMENT_ALIGNMENT = 64  # elements: each parameter starts at a multiple of this (128 B in bf16)


def flat_offsets(numels: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(element offset of each tensor, total elements) of tensors of these sizes laid back to
    back, each offset rounded up to `ELEMENT_ALIGNMENT`; the total is the end of the last."""
    offsets, end = [], 0
    for numel in numels:
        start = -(-end // ELEMENT_ALIGNMENT) * ELEMENT_ALIGNMENT
        offsets.append(start)
        end = start + int(numel)
    return tuple(offsets), end


def flatten_parameters(module: torch.nn.Module, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Moves ``module``'s parameters into one flat buffer (module docstring) and returns it:
    a new one, or ``into`` (1-D, of the parameters' dtype and device and `flat_offsets`' total
    size; e.g. memory shared with another process), whose padding is left as it is. Raises if
    the parameters do not share one dtype and device, if one is not a plain tensor (e.g. an
    FSDP2 ``DTensor`` shard), or if ``into`` does not fit them."""
    parameters = [parameter for _, parameter in module.named_parameters()]
    if not parameters:
        raise ValueError("module: has no parameters to flatten")
    kinds = {(parameter.dtype, parameter.device) for parameter in parameters}
    if len(kinds) != 1:
        raise ValueError(f"module: expected parameters of one dtype and device, got {sorted(map(str, kinds))}")
    if any(type(parameter.data) is not torch.Tensor for parameter in parameters):
        raise ValueError("module: expected plain tensor parameters, got "
                         f"{sorted({type(parameter.data).__name__ for parameter in parameters})}")
    offsets, total = flat_offsets([parameter.numel() for parameter in parameters])
    if into is None:
        buffer = torch.zeros(total, dtype=parameters[0].dtype, device=parameters[0].device)
    elif (into.dim() != 1 or into.numel() != total or into.dtype != parameters[0].dtype
          or into.device != parameters[0].device):
        raise ValueError(f"into: expected a 1-D {parameters[0].dtype} tensor of {total} elements on "
                         f"{parameters[0].device}, got {into.dtype} {tuple(into.shape)} on {into.device}")
    else:
        buffer = into
    with torch.no_grad():
        for parameter, offset in zip(parameters, offsets):
            view = buffer[offset:offset + parameter.numel()].view(parameter.shape)
            view.copy_(parameter.data)
            parameter.data = view
    return buffer


def flat_region(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The 1-D tensor spanning ``tensors`` when they are contiguous views of one storage at the
    `flat_offsets` of their sizes (relative to the first), in this order; else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offsets, total = flat_offsets([tensor.numel() for tensor in tensors])
    base = first.storage_offset()
    for tensor, offset in zip(tensors, offsets):
        if (tensor.dtype != first.dtype or tensor.device != first.device or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage or tensor.storage_offset() != base + offset):
            return None
    if (base + total) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.new_empty(0).set_(first.untyped_storage(), base, (total,), (1,))
