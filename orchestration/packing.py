"""Pre-tokenized documents packed into rows that keep documents apart, read in epochs.

Input formats (token ids, so any vocabulary runs without a tokenizer):

- ``NAME.jsonl``: one document a line, ``{"input_ids": [int, ...]}``.
- ``NAME.npy`` + ``NAME.offsets.npy``: every document's ids concatenated into one 1-D integer
  array (any integer dtype; read memory-mapped) and a 1-D int64 array of ``D + 1`` offsets,
  ``offsets[0] = 0``, ``offsets[-1] = len(tokens)``: document ``d`` is
  ``tokens[offsets[d]:offsets[d + 1]]``. `save_token_documents` writes it.

Packing: an epoch visits every document once, in the order ``permutation(seed, epoch)``; each
document is followed by ``eos_id`` (unless it already ends with it) and the stream is cut into
rows of ``row_tokens``; the last row of an epoch is padded with ``pad_id``. Within a row, each
piece of a document gets its own document id, position ids restarting at 0, and labels
``tokens[t + 1]`` of the same document (the EOS and the padding predict nothing). A document
longer than the rest of a row continues in the next row as a new piece: its last token in the
row keeps its label, the next token of the document. Documents never attend to each other:
`attention_mask` makes the block-diagonal causal mask from the document ids (a dense mask
for sdpa / eager, a block-sparse BlockMask for flex_attention).

The data position ``(epoch, row)`` is the resumable state: `PackedRows.row(epoch, index)` is a
pure function of the data and the seed, so a resumed reader yields exactly the rows an
uninterrupted one would have.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from .data import IGNORE_INDEX

OFFSETS_SUFFIX = ".offsets.npy"


@dataclass(frozen=True)
class TokenDocuments:
    """Documents as one 1-D integer array ``tokens`` and ``D + 1`` int64 ``offsets``."""

    tokens: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        tokens, offsets = self.tokens, self.offsets
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens: expected a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
        if offsets.ndim != 1 or offsets.shape[0] < 2 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError(f"offsets: expected a 1-D integer array of D + 1 >= 2 entries, got shape "
                             f"{offsets.shape} dtype {offsets.dtype}")
        if offsets[0] != 0 or offsets[-1] != tokens.shape[0]:
            raise ValueError(f"offsets: expected offsets[0] = 0 and offsets[-1] = len(tokens) = {tokens.shape[0]}, "
                             f"got {int(offsets[0])} and {int(offsets[-1])}")
        lengths = np.diff(offsets)
        if (lengths < 1).any():
            empty = int(np.argmax(lengths < 1))
            raise ValueError(f"offsets: every document needs at least one token; document {empty} is empty or the "
                             "offsets decrease there")

    @property
    def count(self) -> int:
        return self.offsets.shape[0] - 1

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when an id is outside ``[0, vocab_size)``."""
        low, high = int(self.tokens.min()), int(self.tokens.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"tokens: ids must lie in [0, {vocab_size}), found [{low}, {high}]; the data was "
                             "tokenized with another vocabulary")


def from_lists(documents: Iterable[Iterable[int]]) -> TokenDocuments:
    """`TokenDocuments` of lists of token ids."""
    arrays = [np.asarray(list(document), dtype=np.int64) for document in documents]
    lengths = np.array([len(array) for array in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return TokenDocuments(tokens, offsets)


def save_token_documents(path: str, documents: TokenDocuments) -> str:
    """Writes ``path`` (``.npy`` of the tokens) and ``path`` with ``.offsets.npy`` instead of
    ``.npy``; returns ``path``."""
    if not path.endswith(".npy"):
        raise ValueError(f"path: expected a name ending in .npy, got {path!r}")
    np.save(path, documents.tokens)
    np.save(path[:-len(".npy")] + OFFSETS_SUFFIX, documents.offsets.astype(np.int64))
    return path


def load_token_documents(path: str) -> TokenDocuments:
    """Reads ``NAME.jsonl`` (``{"input_ids": [...]}`` a line) or ``NAME.npy`` + ``NAME.offsets.npy``
    (memory-mapped)."""
    if path.endswith(".jsonl"):
        documents = []
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                ids = record.get("input_ids") if isinstance(record, dict) else None
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                    raise ValueError(f"{path}:{number}: expected {{\"input_ids\": [int, ...]}} with at least one id")
                documents.append(ids)
        if not documents:
            raise ValueError(f"{path}: no documents")
        return from_lists(documents)
    if path.endswith(".npy"):
        offsets_path = path[:-len(".npy")] + OFFSETS_SUFFIX
        if not os.path.exists(offsets_path):
            raise FileNotFoundError(f"{path}: its document offsets {offsets_path} are missing (D + 1 int64 "
                                    "offsets; save_token_documents writes both)")
        return TokenDocuments(np.load(path, mmap_mode="r"), np.load(offsets_path))
    raise ValueError(f"path: expected NAME.jsonl or NAME.npy (with NAME.offsets.npy), got {path!r}")


@dataclass(frozen=True)
class PackedBatch:
    """Rows ``[B, T]`` int64: ``input_ids``, ``labels`` (shifted, ``IGNORE_INDEX`` where
    nothing is predicted), ``position_ids`` (restarting per document piece) and
    ``document_ids`` (0, 1, ... per piece in a row; the padding is a piece of its own)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens that predict something (labels not ignored)."""
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class DataPosition:
    """The next row to read: row ``index`` of epoch ``epoch``."""

    epoch: int = 0
    index: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_state_dict(cls, state: dict) -> "DataPosition":
        return cls(int(state["epoch"]), int(state["index"]))


class PackedRows:
    """Rows of ``row_tokens`` packed from ``documents`` (see the module docstring).
    ``eos_id=None`` packs documents without an EOS between them (their document ids still
    keep them apart); ``shuffle=False`` reads them in file order every epoch."""

    def __init__(self, documents: TokenDocuments, row_tokens: int, *, eos_id: Optional[int], pad_id: int,
                 seed: int = 0, shuffle: bool = True):
        if not isinstance(row_tokens, int) or row_tokens < 2:
            raise ValueError(f"row_tokens: expected an int >= 2, got {row_tokens!r}")
        self.documents, self.row_tokens = documents, row_tokens
        self.eos_id, self.pad_id, self.seed, self.shuffle = eos_id, pad_id, seed, shuffle
        ends_with_eos = (documents.tokens[documents.offsets[1:] - 1] == eos_id) if eos_id is not None else True
        # tokens a document takes in the stream: its own plus the EOS appended after it
        self._stream_lengths = np.diff(documents.offsets) + (~np.asarray(ends_with_eos, dtype=bool)).astype(np.int64)
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] = (-1, np.zeros(0), np.zeros(0))

    def order(self, epoch: int) -> np.ndarray:
        """``[D]`` int64: the documents of ``epoch`` in reading order (a permutation drawn from
        ``(seed, epoch)``, or 0..D-1 without shuffling)."""
        if not self.shuffle:
            return np.arange(self.documents.count, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.documents.count).astype(np.int64)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, stream start of each document in that order plus the stream's end)."""
        if self._epoch_cache[0] != epoch:
            order = self.order(epoch)
            starts = np.concatenate([[0], np.cumsum(self._stream_lengths[order])]).astype(np.int64)
            self._epoch_cache = (epoch, order, starts)
        return self._epoch_cache[1], self._epoch_cache[2]

    def rows_in_epoch(self) -> int:
        return -(-int(self._stream_lengths.sum()) // self.row_tokens)

    def _stream_document(self, document: int) -> np.ndarray:
        """A document's tokens followed by the EOS when it does not end with one."""
        tokens = np.asarray(self.documents.document(document), dtype=np.int64)
        if self._stream_lengths[document] > tokens.shape[0]:
            tokens = np.concatenate([tokens, [self.eos_id]])
        return tokens

    def row(self, epoch: int, index: int) -> tuple[np.ndarray, ...]:
        """(input_ids, labels, position_ids, document_ids), each ``[row_tokens]`` int64, of row
        ``index`` of ``epoch``."""
        if not 0 <= index < self.rows_in_epoch():
            raise IndexError(f"index: expected a row in [0, {self.rows_in_epoch()}), got {index}")
        order, starts = self._epoch(epoch)
        begin, end = index * self.row_tokens, min((index + 1) * self.row_tokens, int(starts[-1]))
        columns = [np.zeros(self.row_tokens, dtype=np.int64) for _ in range(4)]
        input_ids, labels, positions, documents = columns
        labels[:] = IGNORE_INDEX
        piece, cursor = 0, 0
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        for slot in range(first, order.shape[0]):
            start = int(starts[slot])
            if start >= end:
                break
            tokens = self._stream_document(int(order[slot]))
            low, high = max(begin, start) - start, min(end, start + tokens.shape[0]) - start
            width = high - low
            span = slice(cursor, cursor + width)
            input_ids[span] = tokens[low:high]
            following = tokens[low + 1:high + 1]  # the next token of the same document, where there is one
            labels[cursor:cursor + following.shape[0]] = following
            positions[span] = np.arange(width)
            documents[span] = piece
            piece, cursor = piece + 1, cursor + width
        if cursor < self.row_tokens:  # the epoch's last row: padding, a piece of its own
            input_ids[cursor:] = self.pad_id
            positions[cursor:] = np.arange(self.row_tokens - cursor)
            documents[cursor:] = piece
        return input_ids, labels, positions, documents

    def batch(self, rows: list[tuple[int, int]]) -> PackedBatch:
        """The rows ``[(epoch, index), ...]`` stacked into a `PackedBatch`."""
        parts = [self.row(epoch, index) for epoch, index in rows]
        return PackedBatch(*(torch.from_numpy(np.stack(column)) for column in zip(*parts)))


class EpochReader:
    """Reads `PackedRows` in order, epoch after epoch, from a `DataPosition`."""

    def __init__(self, rows: PackedRows, position: DataPosition = DataPosition()):
        self.rows, self.position = rows, position

    def next_batch(self, count: int) -> PackedBatch:
        """The next ``count`` rows (crossing into the next epoch where one ends)."""
        picks, epoch, index = [], self.position.epoch, self.position.index
        per_epoch = self.rows.rows_in_epoch()
        for _ in range(count):
            if index >= per_epoch:
                epoch, index = epoch + 1, 0
            picks.append((epoch, index))
            index += 1
        self.position = DataPosition(epoch, index)
        return self.rows.batch(picks)

    def state_dict(self) -> dict:
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.position = DataPosition.from_state_dict(state)


FLEX_BLOCK_SIZE = 128  # flex_attention's tile: a [BLOCK, BLOCK] tile with no allowed pair is skipped


def attention_mask(document_ids: torch.Tensor, implementation: str, dtype: torch.dtype = torch.float32):
    """The block-diagonal causal mask of packed rows for Hugging Face attention.

    Token i may attend to token j iff ``document_ids[b, i] == document_ids[b, j]`` and ``j <= i``.

    Args:
        document_ids: ``[B, T]`` int.
        implementation: the model's ``attn_implementation``: "sdpa" → ``[B, 1, T, T]`` bool
            (True attends); "eager" → ``[B, 1, T, T]`` additive ``dtype`` mask (0 or the dtype's
            minimum); "flex_attention" → a `torch.nn.attention.flex_attention.BlockMask` of
            shape ``(B, 1, T, T)`` in tiles of `FLEX_BLOCK_SIZE` (rows shorter than a tile are
            one partial tile), whose ``mask_mod`` reads ``document_ids``; "flash_attention_2" /
            "flash_attention_3" → None: pass the packed position_ids alone, the varlen kernels
            cut sequences where they restart.
        dtype: the eager mask's dtype, the model's compute dtype.
    """
    if implementation in ("flash_attention_2", "flash_attention_3"):
        return None
    if implementation not in ("sdpa", "eager", "flex_attention"):
        raise ValueError(f"implementation: expected sdpa, eager, flex_attention, flash_attention_2 or "
                         f"flash_attention_3, got {implementation!r}")
    if document_ids.ndim != 2:
        raise ValueError(f"document_ids: expected [B, T], got shape {tuple(document_ids.shape)}")
    if implementation == "flex_attention":
        return _flex_block_mask(document_ids)
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    allowed = (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)) & causal
    allowed = allowed.unsqueeze(1)
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)


FLEX_MASK_CHUNK_ELEMENTS = 1 << 26  # query-by-key pairs evaluated at once while classifying tiles


def _flex_block_mask(document_ids: torch.Tensor):
    """The `attention_mask` contract as a flex_attention BlockMask, built from the tiles' classes
    directly (`BlockMask.from_kv_blocks`): each ``[BLOCK, BLOCK]`` tile is skipped (no allowed
    pair), full (every pair allowed, a whole tile inside the row: no mask_mod call) or partial
    (the mask_mod decides), which is what ``create_block_mask`` computes, without its vmap over
    the mask_mod. The pairs are evaluated in chunks of query tiles of at most
    `FLEX_MASK_CHUNK_ELEMENTS` pairs (one query tile a chunk at least). The mask_mod is the one
    function of the document ids that every batch uses, so the compiled flex_attention kernel
    sees a new tensor of the same shape, not a new graph."""
    from torch.nn.attention.flex_attention import BlockMask

    def same_document_causal(batch, head, query, key):
        return (document_ids[batch, query] == document_ids[batch, key]) & (key <= query)

    rows, length = document_ids.shape
    tile = FLEX_BLOCK_SIZE
    tiles = -(-length // tile)
    padded = tiles * tile
    documents = torch.nn.functional.pad(document_ids, (0, padded - length), value=-1)  # padding: no pair
    position = torch.arange(padded, device=document_ids.device)
    inside = position < length
    counts = []
    chunk = max(1, FLEX_MASK_CHUNK_ELEMENTS // (rows * tile * padded))
    for first in range(0, tiles, chunk):  # query tiles [first, first + chunk)
        query = slice(first * tile, min(tiles, first + chunk) * tile)
        allowed = ((documents[:, query, None] == documents[:, None, :])
                   & (position[None, None, :] <= position[None, query, None])
                   & inside[None, query, None] & inside[None, None, :])
        counts.append(allowed.reshape(rows, -1, tile, tiles, tile).sum(dim=(2, 4)))
    counts = torch.cat(counts, dim=1)  # [B, query tiles, key tiles]: allowed pairs of each tile
    whole = inside.reshape(tiles, tile).all(dim=1)
    full = (counts == tile * tile) & whole[None, :, None] & whole[None, None, :]
    partial = (counts > 0) & ~full

    def blocks(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, indices) of the kept key tiles of each query tile, kept ones first in order."""
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)
        return kept.sum(dim=-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num_blocks, kv_indices = blocks(partial)
    full_kv_num_blocks, full_kv_indices = blocks(full)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=tile, mask_mod=same_document_causal, seq_lengths=(length, length))
