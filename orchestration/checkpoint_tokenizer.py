"""The tokenizer of a run on local Hugging Face checkpoints: the checkpoints' own, the same
for teacher and student (`hf_models.check_same_vocabulary`), found before any work starts."""
from __future__ import annotations

import os
from .errors import UsageError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in _TOKENIZER_FILES)


def checkpoint_tokenizer(config):
    """The tokenizer saved with ``teacher_path`` / ``student_path`` (None when neither is
    given). Raises UsageError (one line) when the two differ (`hf_models.check_same_vocabulary`:
    ids, and special tokens), or when one of the given checkpoints has a tokenizer and the
    other none."""
    from .hf_models import check_same_vocabulary, load_tokenizer

    given = {name: path for name, path in (("teacher_path", config.teacher_path),
                                           ("student_path", config.student_path)) if path}
    found = {name: load_tokenizer(path, argument=name) for name, path in given.items() if has_tokenizer(path)}
    if not found:
        return None
    missing = sorted(set(given) - set(found))
    if missing:
        raise UsageError([f"{missing[0]}: {given[missing[0]]!r} has no tokenizer, and "
                          f"{sorted(found)[0]} has one; save the same tokenizer into both checkpoints"])
    if len(found) == 2:
        try:
            check_same_vocabulary(found["teacher_path"], found["student_path"])
        except ValueError as error:
            raise UsageError([f"teacher_path, student_path: {error}"]) from None
    return found.get("teacher_path") or found["student_path"]

