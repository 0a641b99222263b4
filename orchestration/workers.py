"""What every Ray worker of the driver has: the training rows (sent once), and the answers
the driver's supervision asks for (ping, process id, GPU)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .placement import gpu_identity


class Worker:
    """Base of the teacher and student workers. The training rows are sent to each worker
    once (`set_rows`): a step's calls then carry row indices, not tokens (a 128 KB tensor
    argument costs a Ray call several ms of serialization)."""

    rows: torch.Tensor  # [R, T] int64 tokens
    labels: torch.Tensor  # [R, T] int64 shifted labels

    positions: Optional[torch.Tensor] = None  # [R, T] int64 position ids of packed documents, or None
    documents: Optional[torch.Tensor] = None  # [R, T] int64 document ids within each row, or None
    layouts: Optional["SharedLayouts"] = None  # given by a fused worker to both of its workers

    def set_rows(self, rows: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor] = None,
                 documents: Optional[torch.Tensor] = None) -> None:
        self.rows, self.labels, self.positions, self.documents = rows, labels, positions, documents
        if self.layouts is not None:
            self.layouts.clear()

    def micro_batch(self, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) ``[B, T]`` of the training rows ``pick`` ``[B]``."""
        return self.rows[pick], self.labels[pick]

    def row_layout(self, pick: torch.Tensor, device: torch.device, implementation: str, share: bool = True
                   ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(position_ids ``[B, T]``, attention mask) of the training rows ``pick`` on ``device``:
        positions restarting per document and the block-diagonal causal mask
        (`packing.attention_mask` for ``implementation``) for packed pre-tokenized rows;
        (None, None) for rows without document ids (plain causal). In a fused process
        (`layouts` given) the teacher's and the student's ask for the same micro-batch share one
        build; ``share=False``: built for this call alone (e.g. the teacher's pretraining)."""
        if self.documents is None:
            return None, None
        if share and self.layouts is not None:
            return self.layouts.get(pick, device, implementation,
                                    lambda: layout_of(self.positions[pick], self.documents[pick], device,
                                                      implementation))
        return layout_of(self.positions[pick], self.documents[pick], device, implementation)

    def memory(self) -> dict:
        """This process's peak memory in MiB (`metrics.memory_mib`)."""
        from .metrics import memory_mib

        return memory_mib(getattr(self, "device", torch.device("cpu")))

    def ping(self) -> bool:
        """Answers once the worker is up and its earlier calls are done."""
        return True

    def pid(self) -> int:
        """This worker's process id (the driver writes them to workers.json)."""
        return os.getpid()

    def gpu(self) -> Optional[str]:
        """This worker's GPU UUID, or None without CUDA."""
        return gpu_identity()

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @torch.no_grad()
    def row_log_probs(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[R, vocab]`` float32 ``log_softmax`` of this worker's model (``self.model``, real vocab
        ``self.vocab``) at the flat rows ``rows`` ``[R]`` of ``tokens`` ``[B, T]``, on the CPU."""
        self.model.eval()
        self.model.to(self.device)  # an offloaded teacher comes back for it
        logits = self.model(input_ids=tokens.to(self.device), use_cache=False).logits
        picked = logits.reshape(-1, logits.shape[-1])[rows.to(self.device), :self.vocab]
        return torch.log_softmax(picked.float(), dim=-1).cpu()


class SharedLayouts:
    """The row layouts (`Worker.row_layout`) the two workers of one fused process share: the
    teacher builds a micro-batch's mask when it scores it, the student takes the same one
    when it trains on it, so a micro-batch's mask is built once. Both workers must hold the
    same training rows (the driver sends every worker the same). An entry is dropped at its
    second use; at most ``capacity`` are kept (the oldest go first: a dropped one is built
    again when asked)."""

    def __init__(self, capacity: int = 8):
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self._kept: dict[tuple, tuple] = {}

    def get(self, pick: torch.Tensor, device: torch.device, implementation: str, build) -> tuple:
        """The layout of ``pick`` on ``device`` for ``implementation``: ``build()``'s at the
        first ask, the kept one (then dropped) at the second."""
        key = (tuple(pick.tolist()), str(device), implementation)
        if key in self._kept:
            return self._kept.pop(key)
        layout = build()
        while len(self._kept) >= self.capacity:
            self._kept.pop(next(iter(self._kept)))
        self._kept[key] = layout
        return layout

    def clear(self) -> None:
        self._kept.clear()


def mask_dtype(device: torch.device) -> torch.dtype:
    """The dtype of eager attention masks: the compute dtype (bf16 on GPUs, float32 on CPU)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def layout_of(positions: Optional[torch.Tensor], documents: Optional[torch.Tensor], device: torch.device,
              implementation: str) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(position_ids, attention mask) on ``device`` of packed rows (see `Worker.row_layout`);
    eager masks in `mask_dtype`."""
    if documents is None:
        return None, None
    from .packing import attention_mask

    return positions.to(device), attention_mask(documents.to(device), implementation, mask_dtype(device))
