"""Pre-tokenized data for the driver: documents of token ids (`packing`: JSONL of
``{"input_ids": [...]}`` or ``NAME.npy`` + ``NAME.offsets.npy``) packed into rows with an EOS
between documents, position ids restarting per document and document ids for the
block-diagonal mask; read in epochs (`sampler.EpochSampler`), the data position a function of
the step.

The last 5 % of the documents (at least one) are held out. Training documents are packed
once, in the order of a permutation drawn from the seed; each epoch then visits every packed
row once, in an order drawn from (seed, epoch). The rows live in memory: four int64 tensors
of the data's size.
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import torch

from .data import Dataset
from .packing import PackedRows, load_token_documents

HELD_OUT_SHARE = 20  # one document in 20 is held out


def is_pre_tokenized(path: Optional[str]) -> bool:
    """True for ``NAME.npy`` and for a JSONL whose first record has ``input_ids``."""
    if path is None:
        return False
    if path.endswith(".npy"):
        return True
    if not path.endswith(".jsonl"):
        return False
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                return isinstance(record, dict) and "input_ids" in record
    return False


def _packed(rows: PackedRows) -> tuple[torch.Tensor, ...]:
    parts = [rows.row(0, index) for index in range(rows.rows_in_epoch())]
    return tuple(torch.from_numpy(np.stack(column)) for column in zip(*parts))


def prepare_token_data(config, tokenizer, progress) -> Dataset:
    """The `Dataset` of the pre-tokenized ``config.data_path``: rows of ``config.row_tokens``
    with positions and document ids. The vocabulary, EOS and padding ids are ``tokenizer``'s
    (the checkpoints' or ``tokenizer_path``'s); without one, the vocabulary is
    ``tokenizer_vocab``, no EOS is inserted (document ids still keep documents apart) and
    padding is id 0. Raises ValueError when an id lies outside the vocabulary."""
    if tokenizer is None and config.tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    if tokenizer is None:
        vocab, eos_id, pad_id = config.tokenizer_vocab, None, 0
    else:
        vocab, eos_id = len(tokenizer), tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    from .packing import TokenDocuments

    with progress.phase(f"reading the token ids {config.data_path}"):
        documents = load_token_documents(config.data_path)
    documents.check_vocab(vocab)
    held = max(1, documents.count // HELD_OUT_SHARE)
    if documents.count < 2:
        raise ValueError(f"expected at least 2 documents (one is held out), got {documents.count}")
    split = documents.count - held
    offsets = documents.offsets
    train = TokenDocuments(documents.tokens[:offsets[split]], offsets[:split + 1])
    held_out = TokenDocuments(documents.tokens[offsets[split]:], offsets[split:] - offsets[split])
    with progress.phase("packing the documents"):
        tokens, labels, positions, ids = _packed(PackedRows(train, config.row_tokens, eos_id=eos_id, pad_id=pad_id,
                                                            seed=config.seed))
        held_tokens, held_labels, held_positions, held_ids = _packed(
            PackedRows(held_out, config.row_tokens, eos_id=eos_id, pad_id=pad_id, shuffle=False))
    return Dataset(tokens, labels, held_tokens, held_labels, vocab, tokenizer=tokenizer, train_positions=positions,
                   train_documents=ids, held_positions=held_positions, held_documents=held_ids)
