"""Byte encodings of sparse teacher entries: per position (token) k vocab ids, their log-probs
and a few float32 fields (e.g. ``lse``, a sampling threshold), as one fixed-size record.

A block of P positions encodes to a ``[P, S]`` uint8 matrix (S = `Codec.bytes_per_position`),
so any subset of positions is a row gather and every operation is a torch op over the whole
block: encoding and decoding run on whatever device the tensors are on.

- ``lossless``: the float32 fields, the log-probs as bfloat16 (``2k`` bytes) and the ids
  bit-packed in ``b = ceil(log2 V)`` bits each, in groups of ``8 / gcd(b, 8)`` ids (a
  position's ids are padded to a whole group). Decoding gives the ids and fields exactly and
  the log-probs bit for bit as ``logprobs.to(torch.bfloat16)`` (round to nearest even), the
  values the live driver sends (`TopK.pack(torch.bfloat16)`).
- ``compact``: the float32 fields, a float32 ``top``, then per entry one little-endian integer
  ``id + V · c`` in E bytes, E the fewest bytes with ``levels = 256**E // V >= 64`` (E = 3 up to
  V = 262,144: 110 levels at V = 151,936). ``c`` quantizes the entry's gap below the
  position's largest log-prob, ``g = max − logprob``, uniformly in
  ``u = 1 − exp(−g / COMPACT_SCALE)`` over ``[0, 1 − exp(−COMPACT_RANGE / COMPACT_SCALE)]``
  (nearest of levels − 1 codes; gaps beyond the range clamp to it); the last code marks a
  missing (−inf) entry. An entry decodes to ``top − ĝ(c)``, with ``top`` chosen at encoding so
  that the decoded position's logsumexp equals the stored one's (to float32): the covered
  mass, hence the tail bin of ``support="tail"``, stays exact, and a renormalized loss sees
  only the gap error. Ids and fields are exact; `Codec.gap_error_bound` bounds each gap's
  error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

ENCODINGS = ("lossless", "compact")
COMPACT_SCALE = 3.0  # nats: the compander's scale s (levels are denser near the head)
COMPACT_RANGE = 16.0  # nats: gaps below the position's largest log-prob beyond this clamp to it
_MIN_COMPACT_LEVELS = 64
DECODE_CHUNK = 4096  # positions a decode step works on


@dataclass(frozen=True)
class Codec:
    """One encoding of ``[P, k]`` entries over a vocab of ``vocab_size`` with float32 ``fields``."""

    encoding: str
    vocab_size: int
    k: int
    fields: tuple[str, ...] = ()

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding: expected one of {ENCODINGS}, got {self.encoding!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"vocab_size: expected an int >= 2, got {self.vocab_size!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k: expected an int >= 1, got {self.k!r}")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields: expected distinct names, got {self.fields!r}")

    # ---- layout -------------------------------------------------------------------------

    @property
    def id_bits(self) -> int:
        """``ceil(log2 V)``: bits of a packed id (lossless)."""
        return max(1, (self.vocab_size - 1).bit_length())

    @property
    def entry_bytes(self) -> int:
        """Bytes of one compact entry: the fewest E with ``256**E // V >= 64``."""
        return next(size for size in range(1, 9) if 256 ** size // self.vocab_size >= _MIN_COMPACT_LEVELS)

    @property
    def levels(self) -> int:
        """Compact codes an entry has: ``levels − 1`` gap levels and the missing code."""
        return 256 ** self.entry_bytes // self.vocab_size

    @property
    def _id_group(self) -> tuple[int, int]:
        """(ids a group, bytes a group) of the lossless id packing."""
        ids = 8 // math.gcd(self.id_bits, 8)
        return ids, ids * self.id_bits // 8

    @property
    def _id_bytes(self) -> int:
        ids, group_bytes = self._id_group
        return -(-self.k // ids) * group_bytes

    @property
    def bytes_per_position(self) -> int:
        """S: bytes of one position's record."""
        fields = 4 * len(self.fields)
        if self.encoding == "lossless":
            return fields + 2 * self.k + self._id_bytes
        return fields + 4 + self.k * self.entry_bytes

    def describe(self) -> dict:
        """The encoding's parameters, for a cache header."""
        description = dict(encoding=self.encoding, vocab_size=self.vocab_size, k=self.k, fields=list(self.fields),
                           bytes_per_position=self.bytes_per_position)
        if self.encoding == "lossless":
            description.update(id_bits=self.id_bits, logprobs="bfloat16")
        else:
            description.update(entry_bytes=self.entry_bytes, levels=self.levels, scale=COMPACT_SCALE,
                               range=COMPACT_RANGE)
        return description

    # ---- compact quantizer --------------------------------------------------------------

    def gap_levels(self, device=None) -> torch.Tensor:
        """``[levels]`` float32 gap of each compact code (the last, missing, is +inf)."""
        steps = self.levels - 2
        top = -math.expm1(-COMPACT_RANGE / COMPACT_SCALE)
        codes = torch.arange(steps + 1, dtype=torch.float64, device=device)
        gaps = -COMPACT_SCALE * torch.log1p(-codes / steps * top)
        return torch.cat([gaps, gaps.new_full((1,), math.inf)]).float()

    def gap_error_bound(self, gaps: torch.Tensor) -> torch.Tensor:
        """``[...]`` float64: the largest error a compact round trip can make on gaps ``g >= 0``
        (before float32 rounding). Within the range, g lies between two levels and rounds to
        the one nearer in u: the error is at most the larger distance from either level to
        their midpoint in u. Beyond the range it is ``g − COMPACT_RANGE``."""
        steps = self.levels - 2
        top = -math.expm1(-COMPACT_RANGE / COMPACT_SCALE)
        gaps = gaps.double()
        below = (self._u_position(gaps).floor()).clamp(0, steps - 1)

        def level(position):
            return -COMPACT_SCALE * torch.log1p(-position / steps * top)

        middle = level(below + 0.5)
        within = torch.maximum(middle - level(below), level(below + 1) - middle)
        return torch.where(gaps > COMPACT_RANGE, gaps - COMPACT_RANGE, within)

    def _u_position(self, gaps: torch.Tensor) -> torch.Tensor:
        """float64 ``u(g) / u(COMPACT_RANGE) · (levels − 2)``: a gap's place on the code scale."""
        top = -math.expm1(-COMPACT_RANGE / COMPACT_SCALE)
        return -torch.expm1(-gaps.double() / COMPACT_SCALE) / top * (self.levels - 2)

    def _gap_codes(self, gaps: torch.Tensor) -> torch.Tensor:
        return torch.round(self._u_position(gaps)).clamp(0, self.levels - 2).to(torch.int64)

    # ---- encode / decode ----------------------------------------------------------------

    def encode(self, logprobs: torch.Tensor, indices: torch.Tensor,
               fields: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """logprobs ``[P, k]`` float (−inf: missing), indices ``[P, k]`` ids in ``[0, V)``,
        fields ``{name: [P]}`` for each of `fields` -> ``[P, S]`` uint8 on their device."""
        positions = self._check_entries(logprobs, indices)
        fields = self._check_fields(fields or {}, positions, logprobs.device)
        parts = [value.view(torch.uint8).view(positions, 4) for value in fields]
        if self.encoding == "lossless":
            parts += [logprobs.to(torch.bfloat16).contiguous().view(torch.uint8),
                      _pack_bits(indices.to(torch.int64), self.id_bits, self._id_group)]
        else:
            parts += self._encode_compact(logprobs, indices.to(torch.int64))
        return torch.cat(parts, dim=1)

    def decode(self, records: torch.Tensor, logprobs_dtype: Optional[torch.dtype] = None):
        """``[P, S]`` uint8 records -> (logprobs ``[P, k]``, indices ``[P, k]`` int32,
        ``{field: [P] float32}``), on the records' device. Logprobs come as bfloat16 (lossless)
        or float32 (compact) unless ``logprobs_dtype`` is given. Works through the records in
        chunks of `DECODE_CHUNK` positions (temporaries stay in cache)."""
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != self.bytes_per_position:
            raise ValueError(f"records: expected [P, {self.bytes_per_position}] uint8, got {records.dtype} "
                             f"{tuple(records.shape)}")
        positions, device = records.shape[0], records.device
        offset = 4 * len(self.fields)
        fields = _typed(records, 0, offset, torch.float32)
        decoded_fields = {name: fields[:, i].contiguous() for i, name in enumerate(self.fields)}
        natural = torch.bfloat16 if self.encoding == "lossless" else torch.float32
        logprobs = torch.empty(positions, self.k, dtype=logprobs_dtype or natural, device=device)
        indices = torch.empty(positions, self.k, dtype=torch.int32, device=device)
        gaps = self.gap_levels(device).neg() if self.encoding == "compact" else None
        for start in range(0, positions, DECODE_CHUNK):
            chunk = records[start:start + DECODE_CHUNK, offset:]
            if self.encoding == "lossless":
                logprobs[start:start + DECODE_CHUNK] = _typed(chunk, 0, 2 * self.k, torch.bfloat16)
                indices[start:start + DECODE_CHUNK] = _unpack_bits(chunk[:, 2 * self.k:], self.id_bits,
                                                                   self._id_group, self.k)
            else:
                self._decode_compact(chunk, gaps, logprobs[start:start + DECODE_CHUNK],
                                     indices[start:start + DECODE_CHUNK])
        return logprobs, indices, decoded_fields

    def _encode_compact(self, logprobs: torch.Tensor, indices: torch.Tensor) -> list[torch.Tensor]:
        values = logprobs.double()
        valid = torch.isfinite(values)
        largest = values.amax(dim=1, keepdim=True)
        gaps = torch.where(valid, largest - values, 0.0)
        codes = torch.where(valid, self._gap_codes(gaps), self.levels - 1)
        levels = self.gap_levels(logprobs.device).double()
        # the log-prob a gap-0 entry decodes to: the decoded position keeps its logsumexp
        covered = torch.exp(-levels)[codes].sum(dim=1)
        top = torch.where(covered > 0, torch.logsumexp(values, dim=1) - torch.log(covered), 0.0).float()
        words = indices + self.vocab_size * codes
        entries = words.view(torch.uint8).view(*words.shape, 8)[..., :self.entry_bytes]  # little-endian bytes
        return [top.contiguous().view(torch.uint8).view(-1, 4), entries.reshape(words.shape[0], -1)]

    def _decode_compact(self, records: torch.Tensor, neg_gaps: torch.Tensor, logprobs: torch.Tensor,
                        indices: torch.Tensor) -> None:
        """One chunk of compact records (fields dropped) into ``logprobs`` / ``indices`` (contiguous)."""
        top = _typed(records, 0, 4, torch.float32)
        entries = records[:, 4:].reshape(records.shape[0], self.k, self.entry_bytes)
        word_dtype = torch.int32 if self.entry_bytes <= 3 else torch.int64
        words = torch.nn.functional.pad(entries, (0, word_dtype.itemsize - self.entry_bytes)).view(word_dtype)[..., 0]
        codes = torch.div(words, self.vocab_size, rounding_mode="trunc")
        if word_dtype == torch.int32:
            torch.sub(words, codes, alpha=self.vocab_size, out=indices)
        else:
            indices.copy_(words - codes * self.vocab_size)
        relative = neg_gaps.index_select(0, codes.view(-1)).view(codes.shape)  # -inf where missing
        if logprobs.dtype == torch.float32:
            torch.add(relative, top, out=logprobs)
        else:
            logprobs.copy_(relative.add_(top))

    # ---- checks -------------------------------------------------------------------------

    def _check_entries(self, logprobs: torch.Tensor, indices: torch.Tensor) -> int:
        if logprobs.dim() != 2 or logprobs.shape[1] != self.k or not logprobs.is_floating_point():
            raise ValueError(f"logprobs: expected [P, {self.k}] floating point, got {logprobs.dtype} "
                             f"{tuple(logprobs.shape)}")
        if indices.shape != logprobs.shape or indices.is_floating_point() or indices.dtype == torch.bool:
            raise ValueError(f"indices: expected {tuple(logprobs.shape)} integers like logprobs, got {indices.dtype} "
                             f"{tuple(indices.shape)}")
        if indices.device != logprobs.device:
            raise ValueError(f"indices: on {indices.device}, logprobs on {logprobs.device}: expected one device")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.vocab_size):
            raise ValueError(f"indices: expected ids in [0, {self.vocab_size}), got [{int(indices.min())}, "
                             f"{int(indices.max())}]")
        if bool((torch.isnan(logprobs) | (logprobs == math.inf)).any()):
            raise ValueError("logprobs: NaN or +inf found; expected finite log-probs or -inf for missing entries")
        return logprobs.shape[0]

    def _check_fields(self, fields: dict, positions: int, device) -> list[torch.Tensor]:
        if set(fields) != set(self.fields):
            raise ValueError(f"fields: expected {sorted(self.fields)}, got {sorted(fields)}")
        checked = []
        for name in self.fields:
            value = fields[name]
            if value.shape != (positions,) or value.device != device:
                raise ValueError(f"fields[{name!r}]: expected [{positions}] on {device}, got {tuple(value.shape)} "
                                 f"on {value.device}")
            checked.append(value.to(torch.float32).contiguous())
        return checked


def _typed(records: torch.Tensor, start: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns ``[start, start + width)`` of ``[P, S]`` uint8 records as ``[P, width / size]``
    ``dtype``: a view where the layout allows it, else a copy."""
    if width == 0:
        return torch.empty(records.shape[0], 0, dtype=dtype, device=records.device)
    part = records[:, start:start + width]
    size = dtype.itemsize
    if part.stride(-1) != 1 or part.stride(0) % size or part.storage_offset() % size:
        part = part.contiguous()
    return part.view(dtype)


def _pack_bits(values: torch.Tensor, bits: int, group: tuple[int, int]) -> torch.Tensor:
    """``[P, k]`` int64 values < 2**bits -> ``[P, ceil(k / n) · B]`` uint8, each group of n
    values little-endian in B = n · bits / 8 bytes."""
    ids, group_bytes = group
    positions, k = values.shape
    padded = torch.nn.functional.pad(values, (0, -k % ids)).reshape(-1, ids)
    packed = torch.zeros(padded.shape[0], group_bytes, dtype=torch.int64, device=values.device)
    for slot in range(ids):  # a loop over a group's slots (at most 8), each a whole-tensor op
        first_bit = slot * bits
        for byte in range(first_bit // 8, (first_bit + bits - 1) // 8 + 1):
            shift = 8 * byte - first_bit
            part = padded[:, slot] >> shift if shift >= 0 else padded[:, slot] << -shift
            packed[:, byte] |= part & 0xFF
    return packed.to(torch.uint8).reshape(positions, -1)


def _unpack_bits(packed: torch.Tensor, bits: int, group: tuple[int, int], k: int) -> torch.Tensor:
    """Inverse of `_pack_bits`: ``[P, k]`` int32."""
    ids, group_bytes = group
    positions = packed.shape[0]
    wide = torch.int32 if bits <= 24 else torch.int64  # a value spans at most bits + 7 bits of its bytes
    grouped = packed.reshape(-1, group_bytes).to(wide)
    mask = (1 << bits) - 1
    slots = []
    for slot in range(ids):
        first_bit = slot * bits
        first_byte = first_bit // 8
        value = grouped[:, first_byte] >> (first_bit - 8 * first_byte)
        for byte in range(first_byte + 1, (first_bit + bits - 1) // 8 + 1):
            value = value | (grouped[:, byte] << (8 * byte - first_bit))
        slots.append(value & mask)
    return torch.stack(slots, dim=1).reshape(positions, -1)[:, :k].to(torch.int32)
