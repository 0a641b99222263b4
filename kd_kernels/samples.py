"""`TeacherSamples`: token ids drawn from the teacher's tempered distribution without replacement
(Gumbel-top-n), their exact log-probs and what the unbiased estimator needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .sampling import log_inclusion
from .topk import TopK

_PACK_MAGIC = 0x4B444B53  # "KDKS"
_PACK_VERSION = 1
_HEADER_BYTES = 64  # 8 int64 slots: magic, version, N, n, has_seed, seed, 0, 0


@dataclass
class TeacherSamples:
    """n samples a row from ``p = softmax(z_t / τ_t)`` over the vocab, without replacement.

    The samples are the n largest keys ``κ_v = log p_v + G_v`` (G standard Gumbel noise, a
    function of (seed, row, column): `kd_kernels.sampling`), in descending key order, so the
    first is a draw from p and each next one a draw from the rest.

    Attributes:
        logprobs: ``[N, n]`` float32 (or bfloat16 / float16) ``log p`` of each sample, normalized
            over the whole vocab; ``-inf`` marks a missing entry (fewer than n columns exist).
        indices: ``[N, n]`` int32 global vocab ids (0 where missing).
        log_threshold: ``[N]`` float32, the (n+1)-th largest key ``κ*`` in log-prob units (−inf
            where fewer than n + 1 columns exist). A sample's inclusion probability given it is
            ``π_i = 1 − exp(−exp(logprobs_i − log_threshold))`` (`log_inclusion`), and
            ``Σ_i p_i f_i / π_i`` is an unbiased estimate of ``Σ_v p_v f_v`` for any f.
        lse: optional ``[N]`` float32, ``logsumexp(z_t / τ_t)`` over the vocab.
        temperature: τ_t, or None if unknown.
        seed: the noise's seed, or None if unknown.
    """

    logprobs: torch.Tensor
    indices: torch.Tensor
    log_threshold: torch.Tensor
    lse: Optional[torch.Tensor] = None
    temperature: Optional[float] = None
    seed: Optional[int] = None

    @property
    def num_rows(self) -> int:
        return self.logprobs.shape[0]

    @property
    def num_samples(self) -> int:
        return self.logprobs.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[N, n]`` bool: the entry exists (its log-prob is finite)."""
        return torch.isfinite(self.logprobs)

    @property
    def log_inclusion(self) -> torch.Tensor:
        """``[N, n]`` (float32 or wider) ``log π_i``; −inf where missing."""
        return log_inclusion(self.logprobs, self.log_threshold)

    @property
    def weights(self) -> torch.Tensor:
        """``[N, n]`` (float32 or wider) the estimator's ``p_i / π_i``; 0 where missing."""
        logprobs = self.logprobs.to(torch.promote_types(self.logprobs.dtype, torch.float32))
        return torch.where(self.valid, torch.exp(logprobs - self.log_inclusion), 0.0)

    def to(self, *args, **kwargs) -> "TeacherSamples":
        """Moves every tensor (``.to(device)``); a dtype argument applies to logprobs only."""
        topk = TopK(self.logprobs, self.indices, self.lse, self.temperature).to(*args, **kwargs)
        kwargs.pop("dtype", None)
        if args and isinstance(args[0], torch.dtype):
            args = args[1:]
        return TeacherSamples(topk.logprobs, topk.indices, self.log_threshold.to(*args, **kwargs), topk.lse,
                              self.temperature, self.seed)

    def pack(self, logprobs_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One contiguous uint8 buffer on the same device, for a single transfer or a file.

        Layout: a 64-byte header (magic, version, N, n, the seed), float32 ``log_threshold [N]``
        (padded to 8 bytes), then `TopK.pack` of (logprobs, indices, lse, temperature). With
        bfloat16 logprobs a sample costs 6 bytes and a row 8 more.
        """
        n, samples = self.logprobs.shape
        seed = 0 if self.seed is None else int(self.seed) % (1 << 64)
        header = torch.tensor([_PACK_MAGIC, _PACK_VERSION, n, samples, int(self.seed is not None),
                               seed - (1 << 64) if seed >= 1 << 63 else seed, 0, 0], dtype=torch.int64)
        inner = TopK(self.logprobs, self.indices, self.lse, self.temperature).pack(logprobs_dtype)
        thresholds = torch.zeros(_padded_rows(n), dtype=torch.float32, device=inner.device)
        thresholds[:n] = self.log_threshold
        return torch.cat([header.view(torch.uint8).to(inner.device), thresholds.view(torch.uint8), inner])

    @staticmethod
    def packed_in(buffer: torch.Tensor) -> bool:
        """Whether a 1-D uint8 buffer starts with `pack`'s header (not, e.g., `TopK.pack`'s)."""
        return (buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() >= _HEADER_BYTES
                and int(buffer[:8].cpu().view(torch.int64)) == _PACK_MAGIC)

    @staticmethod
    def unpack(buffer: torch.Tensor) -> "TeacherSamples":
        """Inverse of `pack`: views into ``buffer`` (no copy) except the headers read."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError(f"buffer: expected a 1-D uint8 tensor from TeacherSamples.pack(), got {buffer.dtype} "
                            f"{tuple(buffer.shape)}")
        if buffer.numel() < _HEADER_BYTES:
            raise ValueError(f"buffer: {buffer.numel()} bytes is shorter than the {_HEADER_BYTES}-byte header")
        magic, version, n, samples, has_seed, seed, _, _ = buffer[:_HEADER_BYTES].cpu().view(torch.int64).tolist()
        if magic != _PACK_MAGIC or version != _PACK_VERSION:
            raise ValueError("buffer: not made by TeacherSamples.pack() of this version (bad magic or version)")
        threshold_end = _HEADER_BYTES + 4 * n
        topk = TopK.unpack(buffer[_HEADER_BYTES + 4 * _padded_rows(n):])
        if topk.logprobs.shape != (n, samples):
            raise ValueError(f"buffer: the header says N={n}, n={samples}, the samples hold "
                             f"{tuple(topk.logprobs.shape)}")
        return TeacherSamples(topk.logprobs, topk.indices, buffer[_HEADER_BYTES:threshold_end].view(torch.float32),
                              topk.lse, topk.temperature, (seed % (1 << 64)) if has_seed else None)


def _padded_rows(rows: int) -> int:
    """Thresholds stored a row: rows rounded up to even (the packed TopK after them stays 8-byte aligned)."""
    return rows + rows % 2
