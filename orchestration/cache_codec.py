"""Byte encodings of sparse teacher entries: per position (token) k vocab ids, their log-probs
and a few float32 fields (e.g. ``lse``, a sampling threshold), as one fixed-size record.

A block of P positions encodes to a ``[P, S]`` uint8 matrix (S = `Codec.bytes_per_position`),
so any subset of positions is a row gather and every operation is a torch op over the whole
block: encoding and decoding run on whatever device the tensors are on (lossless decodes bit
for bit alike on every device, compact to float32 rounding: its sums over k run in the
device's order).

- ``lossless``: the float32 fields, the log-probs as bfloat16 (``2k`` bytes) and the ids
  bit-packed in ``b = ceil(log2 V)`` bits each, in groups of ``8 / gcd(b, 8)`` ids (a
  position's ids are padded to a whole group). Decoding gives the ids and fields exactly and
  the log-probs bit for bit as ``logprobs.to(torch.bfloat16)`` (round to nearest even), the
  values the live driver sends (`TopK.pack(torch.bfloat16)`).
- ``compact``: the float32 fields, then per entry one little-endian integer
  ``id + V · (c + L · x)`` in E bytes: nothing else, ``S = 4 · fields + E · k``. Its value above
  the id, ``c + L · x < D = 256**E // V``, holds the entry's code c of L codes and a digit x of
  radix ``X = D // L`` of the position's covered mass (`mass_radices`: the last
  ``min(k, MASS_CARRIERS)`` entries carry X of 2-4 with ``MASS_LEVELS = 2**14``, the others
  X = 1; with ``descending``, the first entry, always gap 0 or missing, has L = 2 and X = D // 2).
  E is the fewest bytes that hold the mass with every other entry keeping L >= 16 (E = 3 at
  V = 151,936 for k >= 8: D = 110; at k = 64 L = 55 or 110, at k = 8 and 12 L = 27 to 55).

  c quantizes the entry's gap below the position's largest log-prob, ``g = max − logprob``,
  uniformly in ``u = 1 − exp(−g / s)`` over ``[0, 1 − exp(−COMPACT_RANGE / s)]`` (s =
  ``Codec.scale``; nearest of L − 1 codes; gaps beyond the range clamp to it); code L − 1
  marks a missing (−inf) entry. The digits x, read as one mixed-radix number (first entry
  lowest), are the code of the covered mass ``m = Σ exp(logprobs)`` as its logit
  ``log(m / (1 − m))``, clamped to ``[−MASS_RANGE, MASS_RANGE]`` and rounded to the nearest of
  `MASS_LEVELS` uniform codes. An entry decodes to ``top − ĝ(c)`` with ``top = log m̂ −
  log Σ exp(−ĝ)``: the decoded covered mass is m̂, whose logit is within ``Codec.mass_step / 2``
  of m's (inside the range), so the tail bin ``1 − m̂`` of ``support="tail"`` and the head's
  mass each keep a relative error below that (plus float32 rounding), and a renormalized loss
  sees only the gap error (`Codec.gap_error_bound` bounds each gap's). Ids and fields are exact.
  Decoding is one integer division and three table lookups an entry (`Codec._decode_tables`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

ENCODINGS = ("lossless", "compact")
COMPACT_SCALE = 3.0  # nats: the compander's scale s for top-k (levels denser near the head)
SAMPLES_COMPACT_SCALE = 8.0  # nats: s for samples (the estimator weighs a sample's error about alike)
COMPACT_RANGE = 16.0  # nats: gaps below the position's largest log-prob beyond this clamp to it
MASS_LEVELS = 1 << 14  # codes of the covered mass's logit
MASS_RANGE = 20.0  # the covered mass's logit is clamped to [-MASS_RANGE, MASS_RANGE]
MASS_CARRIERS = 16  # at most this many entries (a position's last) carry the covered mass's digits
_MIN_COMPACT_LEVELS = 16
DECODE_CHUNK = 4096  # positions a decode step works on
_TABLE_ENTRIES = 1 << 20  # compact decode tables indexed by (column, value above the id) up to this size


def mass_radices(k: int, digits: int, descending: bool = False) -> tuple[int, ...]:
    """``[k]`` radix of the covered mass's digit each compact entry carries (1: none), for words
    of ``digits`` values above the id. With ``descending`` the first entry, always the
    position's largest (gap 0) or missing, carries ``digits // 2``. The rest of
    ``MASS_LEVELS`` goes to the last ``n = min(entries left, MASS_CARRIERS)`` entries: each
    carries x − 1 or x (x the least with ``x**n`` enough), as many x − 1 as the product allows,
    the x last."""
    first = (max(1, digits // 2),) if descending else ()
    needed = -(-MASS_LEVELS // first[0]) if descending else MASS_LEVELS
    rest = k - len(first)
    carriers = min(rest, MASS_CARRIERS)
    if carriers == 0 or needed == 1:  # (the former may fall short of MASS_LEVELS: `Codec.entry_bytes` checks)
        return first + (1,) * rest
    largest = 2
    while largest ** carriers < needed:
        largest += 1
    smaller = 0
    while smaller < carriers and (largest - 1) ** (smaller + 1) * largest ** (carriers - smaller - 1) >= needed:
        smaller += 1
    return first + (1,) * (rest - carriers) + (largest - 1,) * smaller + (largest,) * (carriers - smaller)


@dataclass(frozen=True)
class Codec:
    """One encoding of ``[P, k]`` entries over a vocab of ``vocab_size`` with float32 ``fields``.
    ``descending``: each position's entries come in descending log-prob order, missing ones
    last (`kd_kernels.TopK`'s contract); `encode` refuses others. The compact encoding then
    stores the covered mass partly in the first entry's word. ``scale``: the compact
    compander's s > 0 in nats (`COMPACT_SCALE` for top-k, whose entries weigh by their mass in
    the loss; `SAMPLES_COMPACT_SCALE` for samples, more even)."""

    encoding: str
    vocab_size: int
    k: int
    fields: tuple[str, ...] = ()
    descending: bool = False
    scale: float = COMPACT_SCALE

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding: expected one of {ENCODINGS}, got {self.encoding!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"vocab_size: expected an int >= 2, got {self.vocab_size!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k: expected an int >= 1, got {self.k!r}")
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"fields: expected distinct names, got {self.fields!r}")
        if not isinstance(self.descending, bool):
            raise ValueError(f"descending: expected a bool, got {self.descending!r}")
        if not isinstance(self.scale, (int, float)) or not 0 < self.scale < math.inf:
            raise ValueError(f"scale: expected a number > 0 (nats), got {self.scale!r}")

    # ---- layout -------------------------------------------------------------------------

    @property
    def id_bits(self) -> int:
        """``ceil(log2 V)``: bits of a packed id (lossless)."""
        return max(1, (self.vocab_size - 1).bit_length())

    @functools.cached_property
    def entry_bytes(self) -> int:
        """Bytes of one compact entry: the fewest E whose words, of D = ``256**E // V`` values
        above the id, hold the covered mass (`mass_radices`, product ``>= MASS_LEVELS``) with
        every entry keeping ``D // radix >= 16`` codes (but a descending first entry's 2)."""
        def fits(size):
            digits = 256 ** size // self.vocab_size
            radices = mass_radices(self.k, digits, self.descending)
            kept = radices[1:] if self.descending else radices
            return math.prod(radices) >= MASS_LEVELS and all(digits // r >= _MIN_COMPACT_LEVELS for r in kept)

        return next(size for size in range(1, 9) if fits(size))

    @property
    def digits(self) -> int:
        """D = ``256**E // V``: values of a compact entry's word above its id."""
        return 256 ** self.entry_bytes // self.vocab_size

    @functools.cached_property
    def mass_radices(self) -> tuple[int, ...]:
        """``[k]`` radix of the covered mass's digit each compact entry carries (`mass_radices`)."""
        return mass_radices(self.k, self.digits, self.descending)

    @functools.cached_property
    def entry_levels(self) -> tuple[int, ...]:
        """``[k]`` codes of each compact entry, ``D // radix``: ``levels − 1`` gap levels and the
        missing code."""
        return tuple(self.digits // radix for radix in self.mass_radices)

    @property
    def mass_step(self) -> float:
        """Spacing of the covered mass's logit codes: ``2 · MASS_RANGE / (MASS_LEVELS − 1)``."""
        return 2 * MASS_RANGE / (MASS_LEVELS - 1)

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
        return fields + self.k * self.entry_bytes

    def describe(self) -> dict:
        """The encoding's parameters, for a cache header."""
        description = dict(encoding=self.encoding, vocab_size=self.vocab_size, k=self.k, fields=list(self.fields),
                           bytes_per_position=self.bytes_per_position)
        if self.encoding == "lossless":
            description.update(id_bits=self.id_bits, logprobs="bfloat16")
        else:
            description.update(descending=self.descending, entry_bytes=self.entry_bytes,
                               entry_levels=list(self.entry_levels),
                               scale=self.scale, range=COMPACT_RANGE, mass_levels=MASS_LEVELS,
                               mass_range=MASS_RANGE)
        return description

    # ---- compact quantizer --------------------------------------------------------------

    def gap_table(self, device=None) -> torch.Tensor:
        """``[k, max levels]`` float32: the gap of each entry's codes (its missing code and the
        columns past its levels +inf). An entry with L codes has ``L − 1`` gap levels
        ``−s · log(1 − j / (L − 2) · u(R))``, j = 0 .. L − 2 (s = `scale`, R =
        `COMPACT_RANGE`, ``u(g) = 1 − exp(−g / s)``)."""
        levels = self._levels_tensor(device).double()
        codes = torch.arange(max(self.entry_levels), dtype=torch.float64, device=device)
        top = -math.expm1(-COMPACT_RANGE / self.scale)
        steps = (levels - 2).unsqueeze(1)
        gaps = -self.scale * torch.log1p(-(codes / steps.clamp_min(1)).clamp(max=1) * top)
        return torch.where(codes <= steps, gaps, math.inf).float()

    def gap_error_bound(self, gaps: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` float64: the largest error a compact round trip can make on the gaps
        ``g >= 0`` of entries in those columns (before float32 rounding). Within the range, g lies
        between two levels and rounds to the one nearer in u: the error is at most the larger
        distance from either level to their midpoint in u. Beyond the range it is
        ``g − COMPACT_RANGE``."""
        levels = self._levels_tensor(gaps.device).double()
        steps = (levels - 2).clamp_min(1)  # an entry of 2 codes (a descending first) decodes to gap 0
        top = -math.expm1(-COMPACT_RANGE / self.scale)
        gaps = gaps.double()
        below = torch.minimum(self._u_position(gaps, steps).floor().clamp_min(0), steps - 1)

        def level(position):
            return -self.scale * torch.log1p(-position / steps * top)

        middle = level(below + 0.5)
        within = torch.maximum(middle - level(below), level(below + 1) - middle)
        within = torch.where(levels > 2, within, gaps)
        return torch.where(gaps > COMPACT_RANGE, gaps - COMPACT_RANGE, within)

    def _levels_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.entry_levels, dtype=torch.int64, device=device)

    def _u_position(self, gaps: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """float64 ``u(g) / u(COMPACT_RANGE) · steps``: a gap's place on its entry's code scale."""
        top = -math.expm1(-COMPACT_RANGE / self.scale)
        return -torch.expm1(-gaps.double() / self.scale) / top * steps

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
            parts.append(self._encode_compact(logprobs, indices.to(torch.int64)))
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
        tables = self._decode_tables(device) if self.encoding == "compact" else None
        for start in range(0, positions, DECODE_CHUNK):
            chunk = records[start:start + DECODE_CHUNK, offset:]
            if self.encoding == "lossless":
                logprobs[start:start + DECODE_CHUNK] = _typed(chunk, 0, 2 * self.k, torch.bfloat16)
                indices[start:start + DECODE_CHUNK] = _unpack_bits(chunk[:, 2 * self.k:], self.id_bits,
                                                                   self._id_group, self.k)
            else:
                self._decode_compact(chunk, tables, logprobs[start:start + DECODE_CHUNK],
                                     indices[start:start + DECODE_CHUNK])
        return logprobs, indices, decoded_fields

    def _encode_compact(self, logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        device = logprobs.device
        values = logprobs.double()
        valid = torch.isfinite(values)
        levels = self._levels_tensor(device)
        gaps = torch.where(valid, values.amax(dim=1, keepdim=True) - values, 0.0)
        codes = torch.round(self._u_position(gaps, levels - 2))
        codes = torch.where(valid, torch.minimum(codes.to(torch.int64), levels - 2), levels - 1)
        # the covered mass m = Σ exp(logprobs) as a code of its logit, clamped to the range
        log_mass = torch.logsumexp(values, dim=1).clamp(max=0.0)
        logit = (log_mass - torch.log(-torch.expm1(log_mass))).clamp(-MASS_RANGE, MASS_RANGE)
        mass = torch.round((logit + MASS_RANGE) / self.mass_step).to(torch.int64).unsqueeze(1)
        radices = torch.tensor(self.mass_radices, dtype=torch.int64, device=device)
        carried = torch.div(mass, self._mass_weights(device), rounding_mode="floor") % radices
        words = indices + self.vocab_size * (codes + levels * carried)
        entries = words.view(torch.uint8).view(*words.shape, 8)[..., :self.entry_bytes]  # little-endian bytes
        return entries.reshape(words.shape[0], -1)

    def _mass_weights(self, device) -> torch.Tensor:
        """``[k]`` int64: the place value of each entry's mass digit (mixed radix, first entry lowest)."""
        radices = torch.tensor(self.mass_radices, dtype=torch.int64, device=device)
        return torch.cumprod(torch.cat([radices.new_ones(1), radices[:-1]]), dim=0)

    def _decode_tables(self, device) -> tuple:
        """What `_decode_compact` looks up: ``[k]`` int32 column offsets, then float32 −gap,
        exp(−gap) and the covered mass's code part (``digit · place value``, exact: < 2**24)
        indexed by ``offset + v`` (v the word's value above the id) where ``k · D <=
        _TABLE_ENTRIES``; else (wide words, k < 8) −gap and exp(−gap) indexed by ``offset + c``
        and no mass table, the ``[k]`` levels and place values splitting v arithmetically."""
        return _compact_tables(self, str(device))

    def _decode_compact(self, records: torch.Tensor, tables: tuple[torch.Tensor, ...], logprobs: torch.Tensor,
                        indices: torch.Tensor) -> None:
        """One chunk of compact records (fields dropped) into ``logprobs`` / ``indices`` (contiguous)."""
        offsets, neg_gaps, weights, mass_parts, levels, places = tables
        entries = records.reshape(records.shape[0], self.k, self.entry_bytes)
        word_dtype = torch.int32 if self.entry_bytes <= 3 else torch.int64
        words = torch.nn.functional.pad(entries, (0, word_dtype.itemsize - self.entry_bytes)).view(word_dtype)[..., 0]
        digits = torch.div(words, self.vocab_size, rounding_mode="trunc")
        if word_dtype == torch.int32:
            torch.sub(words, digits, alpha=self.vocab_size, out=indices)
        else:
            indices.copy_(words - digits * self.vocab_size)
        if mass_parts is None:  # wide words: v = c + L · x split arithmetically
            carried = torch.div(digits, levels, rounding_mode="trunc")
            digits -= carried * levels
            mass = (carried * places).sum(dim=1).float()
        flat = digits.add_(offsets).view(-1)
        relative = neg_gaps.index_select(0, flat).view(digits.shape)  # -inf where missing
        covered = weights.index_select(0, flat).view(digits.shape).sum(dim=1)
        if mass_parts is not None:
            mass = mass_parts.index_select(0, flat).view(digits.shape).sum(dim=1)
        # top: the decoded entries' logsumexp is the stored covered mass's log
        log_mass = torch.nn.functional.logsigmoid(mass.mul_(self.mass_step).sub_(MASS_RANGE))
        top = log_mass.sub_(covered.clamp_min_(torch.finfo(torch.float32).tiny).log_()).unsqueeze(1)
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
        if self.descending and bool((logprobs[:, 1:] > logprobs[:, :-1]).any()):
            row = int((logprobs[:, 1:] > logprobs[:, :-1]).any(dim=1).nonzero()[0])
            raise ValueError(f"logprobs: row {row} is not in descending order ({logprobs[row].tolist()[:8]}...); "
                             f"expected descending rows, missing entries last (descending=True)")
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


@functools.lru_cache(maxsize=32)
def _compact_tables(codec: Codec, device: str) -> tuple:
    """`Codec._decode_tables` of ``codec`` on ``device`` (made once a codec and device)."""
    levels, places = codec._levels_tensor(device), codec._mass_weights(device)
    by_value = codec.k * codec.digits <= _TABLE_ENTRIES
    width = codec.digits if by_value else max(codec.entry_levels)
    values = torch.arange(width, dtype=torch.int64, device=device).expand(codec.k, -1)
    codes = values % levels.unsqueeze(1) if by_value else values  # [k, width]
    gaps = codec.gap_table(device).double().gather(1, codes)
    parts = (torch.div(values, levels.unsqueeze(1), rounding_mode="floor") * places.unsqueeze(1)).float().view(-1)
    offsets = torch.arange(codec.k, dtype=torch.int32, device=device) * width
    return (offsets, gaps.neg().float().view(-1), torch.exp(-gaps).float().view(-1), parts if by_value else None,
            levels, places)


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
