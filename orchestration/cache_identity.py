"""Hashes of what a teacher cache must match: the tokenizer, the teacher and the data.

The data hash is taken over the token rows the teacher scores (shape, then the ids as int64
little-endian, row after row), not over the data files: it is exact (it changes with the
files, the tokenizer, the chat template, the packing and the row length, which a list of
file names, sizes and mtimes would miss), it does not change when the files are copied or
touched, and it costs one sha256 pass over the ids.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

# config keys that change how a model is called, not what it computes
_RUNTIME_CONFIG_KEYS = ("_name_or_path", "_commit_hash", "transformers_version", "use_cache", "output_attentions",
                        "output_hidden_states", "return_dict")
# tokenizer.json keys that follow call options (truncation / padding set by a call), not the tokenizer
_RUNTIME_TOKENIZER_KEYS = ("truncation", "padding")


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 of a Hugging Face tokenizer's vocab, merges and pre/post-processing (its
    ``tokenizer.json`` for fast tokenizers, the sorted vocab otherwise), its special tokens
    and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = {key: value for key, value in json.loads(backend.to_str()).items()
                 if key not in _RUNTIME_TOKENIZER_KEYS}
    else:
        model = sorted(tokenizer.get_vocab().items())
    return _sha256_json(dict(model=model, special_tokens=tokenizer.special_tokens_map,
                             added_tokens={str(key): str(value)
                                           for key, value in sorted(tokenizer.added_tokens_decoder.items())},
                             chat_template=getattr(tokenizer, "chat_template", None)))


def teacher_identity(path: Optional[str], model_config, state_dict: Optional[dict] = None) -> dict:
    """``{"path", "config_sha256"}`` of a teacher (a Hugging Face ``PretrainedConfig``; the
    path absolute, None for a model built in the run), plus ``"weights_sha256"`` over the
    tensors of ``state_dict`` (name order, bytes as stored) when given: a teacher built and
    trained in the run is identified by its weights, not by a path."""
    config = {key: value for key, value in json.loads(model_config.to_json_string(use_diff=False)).items()
              if key not in _RUNTIME_CONFIG_KEYS}
    identity = dict(path=os.path.abspath(path) if path else None, config_sha256=_sha256_json(config))
    if state_dict is not None:
        digest = hashlib.sha256()
        for name in sorted(state_dict):
            tensor = state_dict[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
        identity["weights_sha256"] = digest.hexdigest()
    return identity


def data_hash(tokens: torch.Tensor) -> str:
    """sha256 of the token rows ``[R, T]`` (or any shape) of integer ids: the shape, then the
    ids as int64 little-endian in row-major order."""
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens: expected integer token ids, got {tokens.dtype}")
    digest = hashlib.sha256(f"{tuple(tokens.shape)};".encode())
    flat = tokens.detach().cpu().to(torch.int64).contiguous().view(-1)
    for start in range(0, flat.numel(), 1 << 24):  # 128 MB at a time
        digest.update(flat[start:start + (1 << 24)].numpy().tobytes())
    return digest.hexdigest()
