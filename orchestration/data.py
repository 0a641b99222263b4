"""Data: documents → tokens → packed rows with shifted labels.

Documents are JSONL records ``{"prompt": ..., "response": ...}``, ``{"messages": [...]}`` (a
chat) or ``{"text": ...}``, or plain text files (one document per blank-line-separated block).
Chat records, and prompt/response records when the tokenizer has a chat template, are encoded
by `chat_data.ChatEncoder` (the tokenizer's own template; only the assistant's tokens trained).
Otherwise the ``chat_template`` option (a format string), when given, formats prompt/response,
and the text before ``{response}`` is the untrained prompt. Rows are packed to a token
budget; labels are shifted here, once: ``labels[t] = tokens[t + 1]`` within a document and
``ignore_index`` at each document's last token, so KD and CE score the same positions.
"""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

from .cache_identity import tokenizer_hash

IGNORE_INDEX = -100


@dataclass
class Document:
    """Token ids and, per token, whether the next-token prediction from it is trained on."""

    tokens: list[int]
    trained: list[bool]


def read_documents(path: str) -> Iterator[dict]:
    """JSONL records, or blocks of a text file separated by blank lines as ``{"text": ...}``."""
    with open(path, encoding="utf-8") as handle:
        if path.endswith(".jsonl"):
            for number, line in enumerate(handle, 1):
                if line.strip():
                    record = json.loads(line)
                    if not ({"prompt", "response"} <= record.keys() or "text" in record or "messages" in record):
                        raise ValueError(f"{path}:{number}: expected keys prompt/response, messages or text")
                    yield record
        else:
            for block in handle.read().split("\n\n"):
                if block.strip():
                    yield {"text": block}


def stdlib_sources() -> list[str]:
    """The standard library's ``.py`` files: the top level first, then its packages (installed
    third-party packages excluded: they differ between machines), each part sorted."""
    root = sysconfig.get_paths()["stdlib"]
    top = sorted(glob.glob(os.path.join(root, "*.py")))
    nested = sorted(path for path in glob.glob(os.path.join(root, "*", "**", "*.py"), recursive=True)
                    if not {"site-packages", "dist-packages"} & set(os.path.relpath(path, root).split(os.sep)))
    return top + nested


def stdlib_corpus(max_bytes: int = 3_000_000) -> list[dict]:
    """Docstring-rich text every Python install has: the stdlib sources, as text records
    (about 4.5 MB at the top level, 30 MB with the packages)."""
    records, total = [], 0
    for path in stdlib_sources():
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if not text.strip():
            continue  # empty __init__.py files
        records.append({"text": text})
        total += len(text)
        if total >= max_bytes:
            break
    return records


def encode(record: dict, tokenizer, chat_template: Optional[str]) -> Document:
    """One record → a `Document` (module docstring: which tokens are trained)."""
    if "text" in record:
        return _text_document(tokenizer.encode(record["text"]))
    if "messages" in record or (chat_template is None and getattr(tokenizer, "chat_template", None)):
        from .chat_data import ChatEncoder, parse_record

        return ChatEncoder(tokenizer).document(parse_record(record, "record"))
    if chat_template:
        # the prompt is the text before {response}: what follows it (an end-of-turn marker) is trained
        prompt = chat_template[:chat_template.index("{response}")].format(prompt=record["prompt"])
        full = chat_template.format(prompt=record["prompt"], response=record["response"])
    else:
        prompt, full = record["prompt"], record["prompt"] + record["response"]
    prompt_tokens, tokens = tokenizer.encode(prompt), tokenizer.encode(full)
    # the prediction of token t+1 is trained when t+1 belongs to the response
    trained = [t + 1 >= len(prompt_tokens) for t in range(len(tokens))]
    return Document(tokens, trained)


def _text_document(tokens: list[int]) -> Document:
    return Document(tokens, [True] * len(tokens))


def encoded(records: list[dict], tokenizer, chat_template: Optional[str],
            done: Optional[Callable[[int], None]] = None, batch_characters: Optional[int] = None
            ) -> Iterator[Document]:
    """`encode` of every record, in order; the plain texts in batches of ``batch_characters``
    (None: about 2 % of them, 64 K at least), one batched call each (a fast tokenizer encodes
    a batch on all cores: 30 MB of text in 21 s instead of 43 s on 2 cores).
    ``done(characters)`` is called after each batch."""
    target = batch_characters or max(1 << 16, sum(map(_characters, records)) // 50)
    batch: list[dict] = []
    characters = 0
    for index, record in enumerate(records):
        batch.append(record)
        characters += _characters(record)
        if index + 1 < len(records) and characters < target:
            continue
        texts = [record["text"] for record in batch if "text" in record]
        batched = iter(tokenizer(texts)["input_ids"] if texts else [])
        yield from [_text_document(next(batched)) if "text" in record else encode(record, tokenizer, chat_template)
                    for record in batch]
        if done is not None:
            done(characters)
        batch, characters = [], 0


def encode_all(records: list[dict], tokenizer, chat_template: Optional[str]) -> list[Document]:
    """`encode` of every record (batched: see `encoded`)."""
    return list(encoded(records, tokenizer, chat_template))


def _characters(record: dict) -> int:
    return len(_training_text(record))


def shifted_labels(document: Document) -> list[int]:
    """``labels[t] = tokens[t + 1]`` where trained; the document's last token predicts nothing."""
    labels = [IGNORE_INDEX] * len(document.tokens)
    for t in range(len(document.tokens) - 1):
        if document.trained[t]:
            labels[t] = document.tokens[t + 1]
    return labels


def pack(documents: Iterable[Document], row_tokens: int, pad_id: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Rows of exactly ``row_tokens`` (tokens, labels) int64; long documents are split (a
    split point keeps its label: the row boundary is not a document boundary), short ones
    share rows, the last row is padded with ``pad_id`` / ignored labels."""
    tokens: list[int] = []
    labels: list[int] = []
    for document in documents:
        tokens.extend(document.tokens)
        labels.extend(shifted_labels(document))
        while len(tokens) >= row_tokens:
            yield torch.tensor(tokens[:row_tokens]), torch.tensor(labels[:row_tokens])
            tokens, labels = tokens[row_tokens:], labels[row_tokens:]
    if tokens:
        padding = row_tokens - len(tokens)
        yield (torch.tensor(tokens + [pad_id] * padding), torch.tensor(labels + [IGNORE_INDEX] * padding))


def _training_text(record: dict) -> str:
    if "messages" in record:
        return "".join(str(message.get("content", "")) for message in record["messages"])
    return record["text"] if "text" in record else record["prompt"] + record["response"]


def train_tokenizer(records: list[dict], vocab_size: int, directory: str,
                    done: Optional[Callable[[int], None]] = None):
    """A byte-level BPE tokenizer trained on the records (seconds on CPU), saved to
    ``directory`` and loaded back as a transformers `PreTrainedTokenizerFast`.
    ``done(characters)`` is called as the trainer reads each record."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        for record in records:
            text = _training_text(record)
            yield text
            if done is not None:
                done(len(text))

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts(), trainer)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    wrapped = PreTrainedTokenizerFast(tokenizer_file=path, pad_token="<pad>", eos_token="<eos>")
    wrapped.save_pretrained(directory)
    return wrapped


@dataclass
class Dataset:
    """The packed rows of a run, ``[R, T]`` int64 tokens and shifted labels, split into
    training rows and held-out rows (the last 5 %, at least one), the vocab and the tokenizer's
    hash (`cache_identity.tokenizer_hash`, what a teacher cache must match)."""
    train_tokens: torch.Tensor
    train_labels: torch.Tensor
    held_tokens: torch.Tensor
    held_labels: torch.Tensor
    vocab: int
    tokenizer_hash: str = ""
    tokenizer: object = None  # the transformers tokenizer of the ids (None: pre-tokenized data without one)
    # packed pre-tokenized rows: position ids restarting per document and document ids [R, T] (None: plain rows)
    train_positions: Optional[torch.Tensor] = None
    train_documents: Optional[torch.Tensor] = None
    held_positions: Optional[torch.Tensor] = None
    held_documents: Optional[torch.Tensor] = None


def prepare_data(config, progress, tokenizer=None) -> Dataset:
    """Reads the documents (``data_path`` or the stdlib corpus), uses ``tokenizer`` (the
    checkpoints'), loads ``tokenizer_path`` or trains one, encodes and packs them; ``progress``
    (a `Progress`) shows each phase."""
    with progress.phase("reading the corpus"):
        records = (list(read_documents(config.data_path)) if config.data_path
                   else stdlib_corpus(config.max_corpus_bytes))
    characters = sum(_characters(record) for record in records)
    if tokenizer is None and config.tokenizer_path:
        from transformers import AutoTokenizer

        with progress.phase(f"loading the tokenizer {config.tokenizer_path}"):
            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    elif tokenizer is None:
        with progress.bar(f"tokenizer (BPE, vocab {config.tokenizer_vocab})", characters, "char", scale=True) as bar:
            tokenizer = train_tokenizer(records, config.tokenizer_vocab, os.path.join(config.output_dir, "tokenizer"),
                                        bar.update)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with progress.bar("encode and pack", characters, "char", scale=True) as bar:
        rows = list(pack(encoded(records, tokenizer, config.chat_template, done=bar.update), config.row_tokens,
                         pad_id))
    tokens = torch.stack([r[0] for r in rows])
    labels = torch.stack([r[1] for r in rows])
    held_out = max(1, len(rows) // 20)
    return Dataset(tokens[:-held_out], labels[:-held_out], tokens[-held_out:], labels[-held_out:], len(tokenizer),
                   tokenizer_hash(tokenizer), tokenizer=tokenizer)
