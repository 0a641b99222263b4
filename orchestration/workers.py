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

    def set_rows(self, rows: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor] = None,
                 documents: Optional[torch.Tensor] = None) -> None:
        self.rows, self.labels, self.positions, self.documents = rows, labels, positions, documents

    def micro_batch(self, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) ``[B, T]`` of the training rows ``pick`` ``[B]``."""
        return self.rows[pick], self.labels[pick]

    def row_layout(self, pick: torch.Tensor, device: torch.device, implementation: str
                   ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(position_ids ``[B, T]``, attention mask) of the training rows ``pick`` on ``device``:
        positions restarting per document and the block-diagonal causal mask
        (`packing.attention_mask` for ``implementation``) for packed pre-tokenized rows;
        (None, None) for rows without document ids (plain causal)."""
        if self.documents is None:
            return None, None
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
        logits = self.model(input_ids=tokens.to(self.device)).logits
        picked = logits.reshape(-1, logits.shape[-1])[rows.to(self.device), :self.vocab]
        return torch.log_softmax(picked.float(), dim=-1).cpu()

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
