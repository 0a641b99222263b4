"""A device value read by the host at a point of the stream, not at its end."""
from __future__ import annotations

import torch


class HostValue:
    """A one-element integer ``tensor``'s value as it is once the work queued so far on the
    current stream is done: made here, read by `value` without waiting for work queued after.
    On a GPU, a copy into pinned memory and an event; elsewhere a copy of the value."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.numel() != 1 or tensor.is_floating_point():
            raise ValueError(f"tensor: expected one integer element, got {tensor.dtype} of shape {list(tensor.shape)}")
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tensor.clone(), None

    def value(self) -> int:
        """The value (waits for its point of the stream; one host sync)."""
        if self._ready is not None:
            self._ready.synchronize()
        return int(self._host.item())
