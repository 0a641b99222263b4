"""Prompt / response records as users have them, encoded for distillation.

A record is JSONL: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a chat; when its last
message is the assistant's, that message is the response, else the record is a prompt only) or
``{"prompt": ..., "response": ...}`` (``response`` optional). For OPSD a record may carry the
teacher's own prompt: ``teacher_prompt`` (text) or ``teacher_messages`` (the teacher's messages
before the response); the teacher then scores the same response tokens under that prompt.

Encoding uses the tokenizer's own chat template when it has one (``prompt`` becomes a user
message). The response is located by rendering twice: the conversation before the response with
the generation prompt, and the whole conversation; the first rendering's tokens must be a prefix of
the second's, and the response is what follows, up to and including the first end-of-turn token
(``end_of_turn_ids``, the tokenizer's EOS by default, e.g. ``<|im_end|>`` for Qwen): the model
learns to emit it, and generation stops at the same tokens. Template text after it (Qwen's
newline) is not part of the encoding. Only the final assistant message is trained; earlier turns
are context (a conversation whose every turn should be trained becomes one record per turn).
Without a chat template, ``prompt`` and ``response`` are encoded separately and the response ends
with the first end-of-turn id.
"""
from __future__ import annotations

import ast
import json
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .data import Document, stdlib_sources

ROLES = ("system", "user", "assistant", "tool")
_PROMPT_STREAM = 1  # the prompt sampler's random stream, distinct from other (seed, step) streams


@dataclass(frozen=True)
class ChatRecord:
    """One record: the conversation before the response, the response text (None: a prompt
    only), the teacher's conversation before the response (None: the student's), whether it came
    as ``prompt``/``response`` text, and where it came from (for error messages)."""
    prompt_messages: tuple[dict, ...]
    response: Optional[str]
    teacher_messages: Optional[tuple[dict, ...]]
    plain: bool
    source: str


def _messages(value, key: str, source: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{source}: {key}: expected a non-empty list of {{role, content}}, got {value!r}")
    for message in value:
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"{source}: {key}: expected messages {{role: one of {ROLES}, content: text}}, "
                             f"got {message!r}")
    return tuple(dict(role=message["role"], content=message["content"]) for message in value)


def _text(record: dict, key: str, source: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{source}: {key}: expected text, got {type(value).__name__}")
    return value


def parse_record(record: dict, source: str) -> ChatRecord:
    """A JSON object → `ChatRecord` (module docstring: the accepted keys); raises naming ``source``."""
    if not isinstance(record, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(record).__name__}")
    if ("messages" in record) == ("prompt" in record):
        raise ValueError(f"{source}: expected exactly one of the keys messages or prompt, got {sorted(record)}")
    if "teacher_prompt" in record and "teacher_messages" in record:
        raise ValueError(f"{source}: expected at most one of teacher_prompt and teacher_messages")
    if "messages" in record:
        messages = _messages(record["messages"], "messages", source)
        plain = False
        response = None
        if messages[-1]["role"] == "assistant":
            messages, response = messages[:-1], messages[-1]["content"]
        if not messages:
            raise ValueError(f"{source}: messages: expected a prompt before the assistant's response")
    else:
        messages, plain = (dict(role="user", content=_text(record, "prompt", source)),), True
        response = _text(record, "response", source) if "response" in record else None
    teacher = None
    if "teacher_prompt" in record:
        teacher = (dict(role="user", content=_text(record, "teacher_prompt", source)),)
    elif "teacher_messages" in record:
        teacher = _messages(record["teacher_messages"], "teacher_messages", source)
        if teacher[-1]["role"] == "assistant":
            raise ValueError(f"{source}: teacher_messages: expected the teacher's messages before the response "
                             "(the last one is the assistant's; the response is the student's)")
    return ChatRecord(messages, response, teacher, plain, source)


def read_chat_records(path: str) -> list[ChatRecord]:
    """The records of a JSONL file (blank lines skipped), each named ``path:line`` in errors."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                records.append(parse_record(json.loads(line), f"{path}:{number}"))
    return records


@dataclass(frozen=True)
class EncodedRecord:
    """Token ids of a record: the student's prompt (ending with the generation prompt), the
    response (None for a prompt only) and the teacher's prompt."""
    prompt_ids: list[int]
    response_ids: Optional[list[int]]
    teacher_prompt_ids: list[int]
    source: str


class ChatEncoder:
    """Encodes `ChatRecord`\\ s with ``tokenizer`` (a transformers tokenizer). ``end_of_turn_ids``:
    the tokens that end a response, and the stop tokens of its generation (`stop_token_ids`);
    default the tokenizer's EOS."""

    def __init__(self, tokenizer, end_of_turn_ids: Optional[Sequence[int]] = None):
        self.tokenizer = tokenizer
        if end_of_turn_ids is None:
            end_of_turn_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.stop_token_ids = tuple(int(token) for token in end_of_turn_ids)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render(self, messages: Sequence[dict], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        return self._tokens(text)

    def _prompt(self, record: ChatRecord, messages: tuple[dict, ...]) -> list[int]:
        if self.has_template:
            return self._render(messages, True)
        if not record.plain or len(messages) != 1:
            raise ValueError(f"{record.source}: messages and teacher_messages need a tokenizer with a chat "
                             "template; this tokenizer has none (use prompt/response/teacher_prompt records)")
        return self._tokens(messages[0]["content"])

    def prompt_ids(self, record: ChatRecord) -> list[int]:
        """The student's prompt, ending where the response begins (the generation prompt)."""
        return self._prompt(record, record.prompt_messages)

    def teacher_prompt_ids(self, record: ChatRecord) -> list[int]:
        """The teacher's prompt (`ChatRecord.teacher_messages`, else the student's)."""
        return self._prompt(record, record.teacher_messages or record.prompt_messages)

    def _end_of_turn(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to and including the first end-of-turn id (all of them if none)."""
        for position, token in enumerate(tokens):
            if token in self.stop_token_ids:
                return tokens[:position + 1]
        return tokens

    def _response(self, record: ChatRecord, messages: tuple[dict, ...], prompt_ids: list[int]) -> list[int]:
        if not self.has_template:
            return self._tokens(record.response) + list(self.stop_token_ids[:1])
        full = self._render(messages + (dict(role="assistant", content=record.response),), False)
        if full[:len(prompt_ids)] != prompt_ids:
            raise ValueError(f"{record.source}: the chat template renders the conversation with its response "
                             "differently from the conversation up to the generation prompt (the second is not a "
                             "prefix of the first), so the response tokens cannot be located")
        response = self._end_of_turn(full[len(prompt_ids):])
        if not response:
            raise ValueError(f"{record.source}: the response encodes to no tokens")
        return response

    def encode(self, record: ChatRecord) -> EncodedRecord:
        """Prompt, response and teacher prompt ids. With a teacher prompt, the response is also
        located in the teacher's rendering and must be the same tokens (`check_same_response`)."""
        prompt = self.prompt_ids(record)
        teacher_prompt = prompt if record.teacher_messages is None else self.teacher_prompt_ids(record)
        response = None
        if record.response is not None:
            response = self._response(record, record.prompt_messages, prompt)
            if record.teacher_messages is not None:
                teacher_response = self._response(record, record.teacher_messages, teacher_prompt)
                check_same_response(response, teacher_response, record.source)
        return EncodedRecord(prompt, response, teacher_prompt, record.source)

    def document(self, record: ChatRecord) -> Document:
        """Prompt + response as a `data.Document` whose trained predictions are the response's."""
        encoded = self.encode(record)
        if encoded.response_ids is None:
            raise ValueError(f"{record.source}: the record has no response to train on")
        return response_document(encoded.prompt_ids, encoded.response_ids)


def response_document(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> Document:
    """``prompt + response`` with ``trained[t]`` True exactly where token ``t + 1`` is a response
    token (`data.Document`'s convention)."""
    tokens = list(prompt_ids) + list(response_ids)
    return Document(tokens, [len(prompt_ids) <= t + 1 < len(tokens) for t in range(len(tokens))])


# ---- prompts for generation ----------------------------------------------------------------

@dataclass(frozen=True)
class PromptBatch:
    """A step's prompts: the drawn record indices, the student's and teacher's prompt ids, and how
    many draws were refused for a prompt longer than ``max_prompt_tokens``."""
    indices: tuple[int, ...]
    prompt_ids: tuple[list[int], ...]
    teacher_prompt_ids: tuple[list[int], ...]
    skipped: int


class PromptSource:
    """Draws the prompts of a step from ``records``, with replacement, as a function of (seed,
    step) alone: a resumed run draws the same prompts without saved state. A record whose student
    or teacher prompt is longer than ``max_prompt_tokens`` is skipped and another one drawn (each
    skip counted). Encodings are cached."""

    MAX_DRAWS_PER_PROMPT = 64

    def __init__(self, records: Sequence[ChatRecord], encoder: ChatEncoder, max_prompt_tokens: int, seed: int):
        if not records:
            raise ValueError("records: expected at least one record")
        if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens: expected an int >= 1, got {max_prompt_tokens!r}")
        self.records, self.encoder = list(records), encoder
        self.max_prompt_tokens, self.seed = max_prompt_tokens, seed
        self._prompts: dict[int, tuple[list[int], list[int]]] = {}

    def prompts(self, index: int) -> tuple[list[int], list[int]]:
        """(student, teacher) prompt ids of record ``index``."""
        if index not in self._prompts:
            record = self.records[index]
            student = self.encoder.prompt_ids(record)
            teacher = student if record.teacher_messages is None else self.encoder.teacher_prompt_ids(record)
            self._prompts[index] = (student, teacher)
        return self._prompts[index]

    def batch(self, step: int, size: int) -> PromptBatch:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected an int >= 1, got {size!r}")
        generator = np.random.default_rng([self.seed, _PROMPT_STREAM, step])
        indices, skipped = [], 0
        while len(indices) < size:
            if skipped >= self.MAX_DRAWS_PER_PROMPT * size:
                raise ValueError(f"max_prompt_tokens: {skipped} of {skipped + len(indices)} prompts drawn for step "
                                 f"{step} are longer than {self.max_prompt_tokens} tokens; raise it or filter the "
                                 "records")
            index = int(generator.integers(len(self.records)))
            student, teacher = self.prompts(index)
            if max(len(student), len(teacher)) > self.max_prompt_tokens:
                skipped += 1
            else:
                indices.append(index)
        pairs = [self.prompts(index) for index in indices]
        return PromptBatch(tuple(indices), tuple(s for s, _ in pairs), tuple(t for _, t in pairs), skipped)


# ---- OPSD: the teacher scores the student's response under its own prompt -------------------

def check_same_response(student_response: Sequence[int], teacher_response: Sequence[int], record: str) -> None:
    """Raises unless the two encodings of a response are the same tokens (OPSD aligns them
    position by position)."""
    if len(student_response) != len(teacher_response):
        raise ValueError(f"{record}: the response is {len(student_response)} tokens under the student's prompt and "
                         f"{len(teacher_response)} under the teacher's; OPSD aligns them position by position")
    for position, (mine, theirs) in enumerate(zip(student_response, teacher_response)):
        if mine != theirs:
            raise ValueError(f"{record}: the response differs at token {position} ({mine} for the student, {theirs} "
                             "for the teacher); OPSD aligns them position by position")


@dataclass(frozen=True)
class AlignedResponse:
    """Student and teacher inputs sharing one response. ``student_rows[j]`` / ``teacher_rows[j]``
    (``[R]`` int64) is the position in ``student_ids`` / ``teacher_ids`` whose next-token
    prediction is response token ``j`` (``labels[j]``): the teacher's top-k of row
    ``teacher_rows[j]`` is the target of the student's row ``student_rows[j]``."""
    student_ids: torch.Tensor
    teacher_ids: torch.Tensor
    student_rows: torch.Tensor
    teacher_rows: torch.Tensor
    labels: torch.Tensor


def align_response(student_prompt_ids: Sequence[int], teacher_prompt_ids: Sequence[int], response_ids: Sequence[int],
                   teacher_response_ids: Optional[Sequence[int]] = None, *, record: str = "record") -> AlignedResponse:
    """``student_prompt + response`` and ``teacher_prompt + response`` with the rows that predict
    each response token: ``student_rows = len(student_prompt) - 1 + arange(R)``, likewise for the
    teacher. ``teacher_response_ids`` (the response as encoded on the teacher's side, if encoded
    separately) must equal ``response_ids``; raises naming ``record`` otherwise."""
    if not student_prompt_ids or not teacher_prompt_ids:
        raise ValueError(f"{record}: prompts: expected at least one token each (a row must predict the first "
                         "response token)")
    if not response_ids:
        raise ValueError(f"{record}: response_ids: expected at least one token")
    if teacher_response_ids is not None:
        check_same_response(response_ids, teacher_response_ids, record)
    response = torch.as_tensor(list(response_ids), dtype=torch.long)
    positions = torch.arange(len(response_ids))
    return AlignedResponse(
        student_ids=torch.cat([torch.as_tensor(list(student_prompt_ids), dtype=torch.long), response]),
        teacher_ids=torch.cat([torch.as_tensor(list(teacher_prompt_ids), dtype=torch.long), response]),
        student_rows=positions + len(student_prompt_ids) - 1,
        teacher_rows=positions + len(teacher_prompt_ids) - 1,
        labels=response)


# ---- the embedded default: stdlib functions as prompts -------------------------------------

def _function_parts(lines: list[str], node) -> Optional[tuple[str, str]]:
    """(signature + docstring, body) of a function node with a docstring and a body after it,
    dedented by the ``def``'s indentation; None when it has no such parts."""
    if not node.body or ast.get_docstring(node, clean=False) is None or len(node.body) < 2:
        return None
    docstring_end = node.body[0].end_lineno
    if node.body[1].lineno <= docstring_end:
        return None  # the body shares the docstring's line
    indent = node.col_offset

    def dedent(line: str) -> str:
        return line[indent:] if line[:indent].strip() == "" else line

    prompt = "".join(dedent(line) for line in lines[node.lineno - 1:docstring_end])
    body = "".join(dedent(line) for line in lines[docstring_end:node.end_lineno])
    return prompt, body


def stdlib_function_records(max_records: int = 2000, max_prompt_chars: int = 800,
                            max_response_chars: int = 1500) -> list[dict]:
    """The standard library's functions that have a docstring (in `data.stdlib_sources` order, then
    source order) as ``{"prompt": signature + docstring, "response": body}``, for the embedded
    on-policy default: the student writes a body, the dataset body is GKD's off-policy response.
    Functions over the character limits are left out, and so are files Python cannot parse (the
    test suite's deliberately broken ones)."""
    records = []
    for path in stdlib_sources():
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences in old sources
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        functions = sorted((node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))),
                           key=lambda node: node.lineno)
        for node in functions:
            parts = _function_parts(lines, node)
            if parts and len(parts[0]) <= max_prompt_chars and len(parts[1]) <= max_response_chars:
                records.append(dict(prompt=parts[0], response=parts[1]))
                if len(records) == max_records:
                    return records
    return records
