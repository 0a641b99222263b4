"""`TopK`: the teacher's top-k log-probs and vocab ids, the unit that travels to the student."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_PACK_MAGIC = 0x4B444B54  # "KDKT"
_PACK_VERSION = 1
_HEADER_BYTES = 64  # 8 int64 slots; keeps every segment after it 8-byte aligned
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclass
class TopK:
    """Teacher top-k of a tempered distribution, normalized over the whole vocab.

    Attributes:
        logprobs: ``[N, k]`` float32 (or bfloat16/float16), ``log_softmax(z_t / τ_t)`` at the
            k largest entries of each row, sorted descending; ``-inf`` marks a missing entry.
        indices: ``[N, k]`` int32 global vocab ids of those entries (0 where missing).
        lse: optional ``[N]`` float32, ``logsumexp(z_t / τ_t)`` over the vocab.
        temperature: the teacher temperature τ_t these were made at, or None if unknown.
            `topk_divergence` refuses a student temperature that differs from it.
    """

    logprobs: torch.Tensor
    indices: torch.Tensor
    lse: Optional[torch.Tensor] = None
    temperature: Optional[float] = None

    @property
    def num_rows(self) -> int:
        return self.logprobs.shape[0]

    @property
    def k(self) -> int:
        return self.logprobs.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[N, k]`` bool: the entry exists (its log-prob is finite)."""
        return torch.isfinite(self.logprobs)

    @property
    def tail_mass(self) -> torch.Tensor:
        """``[N]`` (float32 or wider): teacher probability outside the k entries, ``1 - Σ exp(logprobs)``."""
        logprobs = self.logprobs.to(torch.promote_types(self.logprobs.dtype, torch.float32))
        covered_log_mass = torch.logsumexp(logprobs, dim=-1)
        return -torch.expm1(covered_log_mass)

    def to(self, *args, **kwargs) -> "TopK":
        """Moves every tensor (``.to(device)``); a dtype argument applies to logprobs only."""
        dtype = kwargs.pop("dtype", None)
        if args and isinstance(args[0], torch.dtype):
            dtype, args = args[0], args[1:]
        logprobs = self.logprobs.to(*args, **kwargs)
        if dtype is not None:
            logprobs = logprobs.to(dtype)
        return TopK(
            logprobs=logprobs,
            indices=self.indices.to(*args, **kwargs),
            lse=None if self.lse is None else self.lse.to(*args, **kwargs),
            temperature=self.temperature,
        )

    def pack(self, logprobs_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One contiguous uint8 buffer on the same device, for a single transfer.

        Layout: a 64-byte header (magic, version, N, k, dtype code, has_lse, τ_t bits),
        int32 indices ``[N, k]``, float32 lse ``[N]`` if present, logprobs ``[N, k]``.
        With bfloat16 logprobs an entry costs 6 bytes.
        """
        logprobs = self.logprobs if logprobs_dtype is None else self.logprobs.to(logprobs_dtype)
        if logprobs.dtype not in _DTYPE_CODES:
            raise TypeError(f"logprobs_dtype: expected one of {list(_DTYPE_CODES)}, got {logprobs.dtype}")
        n, k = logprobs.shape
        temperature = float("nan") if self.temperature is None else float(self.temperature)
        header = torch.tensor(
            [_PACK_MAGIC, _PACK_VERSION, n, k, _DTYPE_CODES[logprobs.dtype], int(self.lse is not None),
             _float_bits(temperature), 0],
            dtype=torch.int64,
        )
        parts = [header.view(torch.uint8).to(logprobs.device),
                 self.indices.to(torch.int32).contiguous().view(-1).view(torch.uint8)]
        if self.lse is not None:
            parts.append(self.lse.to(torch.float32).contiguous().view(-1).view(torch.uint8))
        parts.append(logprobs.contiguous().view(-1).view(torch.uint8))
        return torch.cat(parts)

    @staticmethod
    def unpack(buffer: torch.Tensor) -> "TopK":
        """Inverse of `pack`: views into ``buffer`` (no copy) except the 64-byte header read."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TypeError(f"buffer: expected a 1-D uint8 tensor from TopK.pack(), got {buffer.dtype} {tuple(buffer.shape)}")
        if buffer.numel() < _HEADER_BYTES:
            raise ValueError(f"buffer: {buffer.numel()} bytes is shorter than the {_HEADER_BYTES}-byte header")
        magic, version, n, k, dtype_code, has_lse, temperature_bits, _ = buffer[:_HEADER_BYTES].cpu().view(torch.int64).tolist()
        if magic != _PACK_MAGIC or version != _PACK_VERSION:
            raise ValueError("buffer: not made by TopK.pack() of this version (bad magic or version)")
        logprobs_dtype = _CODE_DTYPES[dtype_code]
        entries = n * k
        offset = _HEADER_BYTES
        indices = buffer[offset:offset + 4 * entries].view(torch.int32).view(n, k)
        offset += 4 * entries
        lse = None
        if has_lse:
            lse = buffer[offset:offset + 4 * n].view(torch.float32)
            offset += 4 * n
        item = torch.tensor([], dtype=logprobs_dtype).element_size()
        if buffer.numel() != offset + item * entries:
            raise ValueError(f"buffer: expected {offset + item * entries} bytes for N={n}, k={k}, got {buffer.numel()}")
        logprobs = buffer[offset:].view(logprobs_dtype).view(n, k)
        temperature = _bits_float(temperature_bits)
        return TopK(logprobs, indices, lse, None if temperature != temperature else temperature)


def _float_bits(value: float) -> int:
    return torch.tensor([value], dtype=torch.float64).view(torch.int64).item()


def _bits_float(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).view(torch.float64).item()
