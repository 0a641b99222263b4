"""Records as users have them: parsing, the assistant-token mask under a Qwen-style chat template,
prompts and their resampling, OPSD alignment, and the stdlib prompts of the embedded default."""
import ast
import json

import pytest
import torch

from orchestration.chat_data import (ChatEncoder, PromptSource, align_response, parse_record, read_chat_records,
                                     response_document, stdlib_function_records)
from orchestration.data import shifted_labels

# Qwen2.5's chat template without its tool branches
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


def _tokenizer(chat_template=QWEN_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. The quick brown fox jumps. system user"
    tokenizer.train_from_iterator([text] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=["<|im_start|>"], chat_template=chat_template)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_only_the_assistant_tokens_and_its_end_of_turn_are_trained(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    record = parse_record({"prompt": "Jumps the fox?", "response": "The brown fox jumps."}, "r:1")
    encoded = ChatEncoder(tokenizer).encode(record)
    assert encoded.prompt_ids == _ids(tokenizer, SYSTEM + "<|im_start|>user\nJumps the fox?<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
    assert encoded.response_ids == _ids(tokenizer, "The brown fox jumps.") + [im_end]
    document = ChatEncoder(tokenizer).document(record)
    labels = shifted_labels(document)
    trained = [label for label in labels if label != -100]
    assert trained == encoded.response_ids  # every response token and <|im_end|>, nothing else
    assert labels[len(encoded.prompt_ids) - 2] == -100 and labels[len(encoded.prompt_ids) - 1] != -100
    assert tokenizer.decode(trained) == "The brown fox jumps.<|im_end|>"


def test_a_conversation_trains_its_final_assistant_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fox?"},
                {"role": "assistant", "content": "Brown."}, {"role": "user", "content": "Jumps?"},
                {"role": "assistant", "content": "The fox jumps."}]
    record = parse_record({"messages": messages}, "r:2")
    encoded = ChatEncoder(tokenizer).encode(record)
    assert encoded.prompt_ids == _ids(tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nFox?"
                                                 "<|im_end|>\n<|im_start|>assistant\nBrown.<|im_end|>\n"
                                                 "<|im_start|>user\nJumps?<|im_end|>\n<|im_start|>assistant\n")
    trained = [label for label in shifted_labels(response_document(encoded.prompt_ids, encoded.response_ids))
               if label != -100]
    assert tokenizer.decode(trained) == "The fox jumps.<|im_end|>"
    prompt_only = parse_record({"messages": messages[:4]}, "r:3")
    assert prompt_only.response is None and ChatEncoder(tokenizer).encode(prompt_only).prompt_ids == encoded.prompt_ids


def test_a_template_that_renders_the_response_elsewhere_is_refused():
    renamed = QWEN_TEMPLATE.replace("'<|im_start|>' + message.role", "'<|im_start|>' + message.role + '_'")
    record = parse_record({"prompt": "Fox?", "response": "Brown."}, "data.jsonl:7")
    with pytest.raises(ValueError, match="data.jsonl:7: the chat template renders .* cannot be located"):
        ChatEncoder(_tokenizer(renamed)).encode(record)


def test_without_a_chat_template_prompt_and_response_are_encoded_apart():
    plain = _tokenizer(chat_template=None)
    eos = plain.eos_token_id
    record = parse_record({"prompt": "The fox", "response": " jumps."}, "r:1")
    encoded = ChatEncoder(plain).encode(record)
    assert encoded.prompt_ids == _ids(plain, "The fox") and encoded.response_ids == _ids(plain, " jumps.") + [eos]
    with pytest.raises(ValueError, match="r:2: messages and teacher_messages need a tokenizer with a chat template"):
        ChatEncoder(plain).encode(parse_record({"messages": [{"role": "user", "content": "x"}]}, "r:2"))
    teacher_chat = {"prompt": "a", "teacher_messages": [{"role": "system", "content": "s"}, {"role": "user",
                                                                                            "content": "a"}]}
    with pytest.raises(ValueError, match="r:3: messages and teacher_messages need a tokenizer with a chat template"):
        ChatEncoder(plain).encode(parse_record(teacher_chat, "r:3"))
    with_teacher = ChatEncoder(plain).encode(parse_record({"prompt": "a", "teacher_prompt": "The a"}, "r:4"))
    assert with_teacher.teacher_prompt_ids == _ids(plain, "The a") and with_teacher.response_ids is None


@pytest.mark.parametrize("record, message", [
    ({"text": "x"}, "exactly one of the keys messages or prompt"),
    ({"prompt": "a", "messages": []}, "exactly one of the keys messages or prompt"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "expected messages \\{role: one of"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "expected a prompt before the assistant's response"),
    ({"prompt": 3}, "prompt: expected text, got int"),
    ({"prompt": "a", "teacher_prompt": "b", "teacher_messages": []}, "at most one of teacher_prompt"),
    ({"prompt": "a", "teacher_messages": [{"role": "assistant", "content": "x"}]}, "teacher's messages before the"),
])
def test_malformed_records_are_refused_with_their_source(record, message):
    with pytest.raises(ValueError, match=f"f.jsonl:3: .*{message}"):
        parse_record(record, "f.jsonl:3")


def test_reading_jsonl_names_each_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n\n" + json.dumps({"prompt": 1}) + "\n")
    with pytest.raises(ValueError, match="d.jsonl:3: prompt: expected text"):
        read_chat_records(str(path))
    path.write_text(json.dumps({"prompt": "a", "response": "b", "teacher_prompt": "c"}) + "\n")
    (record,) = read_chat_records(str(path))
    assert record.source.endswith("d.jsonl:1") and record.teacher_messages == ({"role": "user", "content": "c"},)


# ---- prompts and their resampling ----------------------------------------------------------

def _prompt_source(tokenizer, max_prompt_tokens, seed=5):
    words = "The quick brown fox jumps over the lazy dog again and again".split()
    records = [parse_record({"prompt": " ".join(words[:1 + (i * 7) % len(words)])}, f"r:{i}") for i in range(30)]
    return PromptSource(records, ChatEncoder(tokenizer), max_prompt_tokens, seed)


def test_prompts_too_long_are_redrawn_deterministically(tokenizer):
    unlimited = _prompt_source(tokenizer, 10**9)
    lengths = {i: len(unlimited.prompts(i)[0]) for i in range(30)}
    limit = sorted(lengths.values())[15]
    fits = {i for i, length in lengths.items() if length <= limit}
    skipped_somewhere = False
    for step in range(4):
        draws = list(unlimited.batch(step, 300).indices)
        batch = _prompt_source(tokenizer, limit).batch(step, 6)
        fitting = [position for position, i in enumerate(draws) if i in fits]
        assert list(batch.indices) == [draws[position] for position in fitting[:6]]  # the same stream, long ones skipped
        assert batch.skipped == fitting[5] + 1 - 6
        assert all(len(p) <= limit for p in batch.prompt_ids) and batch.teacher_prompt_ids == batch.prompt_ids
        skipped_somewhere |= batch.skipped > 0
    assert skipped_somewhere
    source = _prompt_source(tokenizer, limit)
    later, earlier = source.batch(9, 6), source.batch(2, 6)  # any call order: a function of (seed, step)
    assert later == _prompt_source(tokenizer, limit).batch(9, 6) and earlier != later
    assert _prompt_source(tokenizer, limit, seed=6).batch(9, 6).indices != later.indices
    with pytest.raises(ValueError, match="max_prompt_tokens: .* longer than 3 tokens"):
        _prompt_source(tokenizer, 3).batch(0, 2)


# ---- OPSD ---------------------------------------------------------------------------------

def test_opsd_rows_line_up_the_teacher_and_student_predictions_of_each_response_token():
    # both prompts end with the same generation prompt [7, 9], as chat templates render it
    student_prompt, teacher_prompt, response = [4, 8, 7, 9], [16, 23, 42, 1, 7, 9], [5, 11, 2, 30]
    aligned = align_response(student_prompt, teacher_prompt, response, record="r:1")
    assert aligned.student_ids.tolist() == student_prompt + response
    assert aligned.teacher_ids.tolist() == teacher_prompt + response
    assert aligned.labels.tolist() == response
    assert aligned.student_ids[aligned.student_rows + 1].tolist() == response
    assert aligned.teacher_ids[aligned.teacher_rows + 1].tolist() == response
    # a model whose row t depends only on token t: the aligned rows carry equal predictions
    bigram = torch.nn.Embedding(64, 64)
    with torch.no_grad():
        assert torch.equal(bigram(aligned.student_ids)[aligned.student_rows],
                           bigram(aligned.teacher_ids)[aligned.teacher_rows])
    with pytest.raises(ValueError, match="r:9: the response is 4 tokens under the student's prompt and 3 under"):
        align_response(student_prompt, teacher_prompt, response, response[:3], record="r:9")
    with pytest.raises(ValueError, match="r:9: the response differs at token 2"):
        align_response(student_prompt, teacher_prompt, response, [5, 11, 3, 30], record="r:9")


def test_a_teacher_prompt_is_encoded_with_the_template_and_must_keep_the_response(tokenizer):
    record = parse_record({"prompt": "Fox?", "response": "The fox jumps.", "teacher_prompt": "Fox? (it jumps)"}, "r:4")
    encoded = ChatEncoder(tokenizer).encode(record)
    assert encoded.teacher_prompt_ids == _ids(tokenizer, SYSTEM + "<|im_start|>user\nFox? (it jumps)<|im_end|>\n"
                                                         "<|im_start|>assistant\n")
    aligned = align_response(encoded.prompt_ids, encoded.teacher_prompt_ids, encoded.response_ids, record="r:4")
    assert aligned.teacher_ids.tolist() == _ids(tokenizer, SYSTEM + "<|im_start|>user\nFox? (it jumps)<|im_end|>\n"
                                                           "<|im_start|>assistant\nThe fox jumps.<|im_end|>")
    # a template that renders the response differently under the teacher's system prompt
    shouting = QWEN_TEMPLATE.replace("message.content + '<|im_end|>' + '\\n'",
                                     "(message.content | upper if messages[0].content == 'Shout.' else "
                                     "message.content) + '<|im_end|>' + '\\n'")
    loud = parse_record({"prompt": "Fox?", "response": "the fox jumps.",
                         "teacher_messages": [{"role": "system", "content": "Shout."},
                                              {"role": "user", "content": "Fox?"}]}, "data.jsonl:12")
    with pytest.raises(ValueError, match="data.jsonl:12: the response (is|differs)"):
        ChatEncoder(_tokenizer(shouting)).encode(loud)


# ---- the embedded default's prompts --------------------------------------------------------

def test_stdlib_functions_become_signature_prompts_and_body_responses():
    records = stdlib_function_records(max_records=40)
    assert len(records) == 40 and records == stdlib_function_records(max_records=40)
    for record in records:
        assert record["prompt"].lstrip("@").startswith(("def ", "async def "))
        (function,) = ast.parse(record["prompt"] + record["response"]).body
        docstring = ast.get_docstring(function, clean=False)
        assert docstring and docstring in record["prompt"] and len(function.body) >= 2
        prompt_lines = record["prompt"].count("\n")
        assert record["prompt"].endswith("\n") and function.body[0].end_lineno == prompt_lines
        assert function.body[1].lineno > prompt_lines  # the body is all in the response


def test_the_drivers_data_path_trains_the_response_under_a_real_or_format_template(tokenizer, tmp_path):
    """data.py: a prompt/response or messages record is encoded with the tokenizer's chat template
    (ChatEncoder), and a format-string template's text after {response} no longer counts as
    prompt (with a Qwen-style ending it used to mask the response's first tokens)."""
    from orchestration.data import encode, read_documents

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response = _ids(tokenizer, "The brown fox jumps.") + [im_end]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "Jumps the fox?", "response": "The brown fox jumps."}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Jumps the fox?"},
                                               {"role": "assistant", "content": "The brown fox jumps."}]}) + "\n")
    for record in read_documents(str(path)):
        assert [label for label in shifted_labels(encode(record, tokenizer, None)) if label != -100] == response

    plain = _tokenizer(chat_template=None)
    template = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"
    document = encode({"prompt": "Jumps the fox?", "response": "The brown fox jumps."}, plain, template)
    prompt = _ids(plain, "<|im_start|>user\nJumps the fox?<|im_end|>\n<|im_start|>assistant\n")
    assert document.tokens[:len(prompt)] == prompt
    trained = [label for label in shifted_labels(document) if label != -100]
    assert trained == document.tokens[len(prompt):]  # the response, its <|im_end|> and the newline after it
    assert plain.decode(trained) == "The brown fox jumps.<|im_end|>\n"
