"""Hugging Face causal LMs in and out: load a local checkpoint and its tokenizer, read what the
fused loss takes from any causal LM (its final hidden states and output embedding, never its
logits), refuse a teacher / student pair whose vocabularies differ, and export a trained
student with ``save_pretrained``.

What the fused loss relies on: ``model(input_ids).logits == hidden @ W.T + b`` with ``hidden``
the decoder's ``last_hidden_state`` (after the final norm) and ``W``, ``b`` the output
embedding. `check_logits_from_hidden` verifies it on a few tokens; models that transform their
logits (soft-capping, a logit scale) fail it and are refused.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _check_directory(path: str, argument: str) -> None:
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise FileNotFoundError(f"{argument}: expected the directory of a local Hugging Face checkpoint "
                                f"(config.json, weights, tokenizer), got {path!r}")


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, attention: str = "sdpa",
                   argument: str = "path"):
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` in ``dtype`` with
    attention implementation ``attention`` ("sdpa" | "eager" | "flex_attention" |
    "flash_attention_2" | ...), on the CPU. Students load in float32 (the master weights; bf16
    compute comes from FSDP2's mixed precision or autocast), teachers in the dtype they score
    in. ``argument`` names the option in error messages (e.g. "student_path")."""
    from transformers import AutoModelForCausalLM

    _check_directory(path, argument)
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                attn_implementation=attention)


def load_tokenizer(path: str, *, argument: str = "path"):
    """The checkpoint's own tokenizer: ``AutoTokenizer.from_pretrained(path, local_files_only=True)``."""
    from transformers import AutoTokenizer

    _check_directory(path, argument)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def vocab_size(tokenizer) -> int:
    """V*: one past the largest token id the tokenizer knows (added special tokens included).
    An lm_head may have more rows (padding, e.g. 151,936 rows for Qwen2.5's 151,665 ids): the
    loss and the teacher top-k ignore the rows at or past V*."""
    return max(tokenizer.get_vocab().values()) + 1


def _special_tokens(tokenizer) -> dict:
    return {name: getattr(tokenizer, name, None) for name in _SPECIAL_TOKENS}


def check_same_vocabulary(teacher_tokenizer, student_tokenizer, *, check_special_tokens: bool = True) -> int:
    """V* shared by both tokenizers; raises ValueError when a token string maps to different ids
    (or exists in one only), or, with ``check_special_tokens``, when their bos / eos / unk / pad
    tokens differ. Distillation compares the two distributions id by id, so the ids must mean
    the same strings; sizes alone prove nothing."""
    teacher_vocab, student_vocab = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        differ = sorted(token for token in teacher_vocab.keys() & student_vocab.keys()
                        if teacher_vocab[token] != student_vocab[token])
        only_teacher = sorted(teacher_vocab.keys() - student_vocab.keys())
        only_student = sorted(student_vocab.keys() - teacher_vocab.keys())
        raise ValueError(
            f"tokenizers: the teacher's ({len(teacher_vocab)} tokens) and the student's ({len(student_vocab)} tokens) "
            f"vocabularies differ: {len(differ)} tokens with other ids (e.g. {differ[:3]}), {len(only_teacher)} only "
            f"in the teacher's (e.g. {only_teacher[:3]}), {len(only_student)} only in the student's (e.g. "
            f"{only_student[:3]}); top-k distillation needs one vocabulary: pick a student of the teacher's family")
    if check_special_tokens:
        teacher_special, student_special = _special_tokens(teacher_tokenizer), _special_tokens(student_tokenizer)
        differ = {name: (teacher_special[name], student_special[name]) for name in _SPECIAL_TOKENS
                  if teacher_special[name] != student_special[name]}
        if differ:
            raise ValueError(f"tokenizers: special tokens differ (name: (teacher, student)): {differ}; save the "
                             "tokenizer you mean to train with into both checkpoints, or pass "
                             "check_special_tokens=False to accept them")
    return vocab_size(teacher_tokenizer)


def decoder_of(model):
    """The module that returns the final hidden states (``get_decoder()``: e.g. ``LlamaModel``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise TypeError(f"model: {type(model).__name__}.get_decoder() gives no separate decoder; the fused loss needs "
                        "the final hidden states without the logits")
    return decoder


def final_hidden_states(model, input_ids: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                        attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T, H]`` hidden states after the final norm, the lm_head's input; no logits.

    Args:
        input_ids: ``[B, T]`` int64.
        position_ids: ``[B, T]`` int64 (packed rows restart them per document), or None.
        attention_mask: ``[B, 1, T, T]`` (a block-causal mask from `packing.attention_mask`, a
            flex_attention BlockMask for models loaded with "flex_attention"), ``[B, T]``
            padding mask, or None (causal).
    """
    output = decoder_of(model)(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=False)
    return output.last_hidden_state


def output_embedding(model) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight ``[V, H]``, bias ``[V]`` or None) of ``get_output_embeddings()``. With tied
    embeddings the weight is the input embedding's parameter: gradients of both uses add up."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"model: {type(model).__name__}.get_output_embeddings() has no weight; expected a causal LM "
                        "with an lm_head")
    return head.weight, getattr(head, "bias", None)


# config keys of transformers models whose logits are not hidden @ W.T + b, and their neutral values
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


@torch.no_grad()
def check_logits_from_hidden(model, *, tokens: int = 4) -> None:
    """Raises ValueError when ``model``'s logits are not ``hidden @ W.T + b``: its config sets
    a known logit transform (soft-capping, a logit scale), or its logits differ from the
    recomputed product on ``tokens`` token ids (a transform small weights may hide)."""
    config = model.config
    for key, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, key, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"model: {type(model).__name__} sets {key}={value}: its logits are not hidden @ W.T + b, "
                             "which is what the fused loss computes")
    weight, bias = output_embedding(model)
    device = weight.device
    was_training = model.training
    model.eval()
    try:
        ids = torch.arange(tokens, device=device).unsqueeze(0) % weight.shape[0]
        logits = model(input_ids=ids, use_cache=False).logits.float()
        hidden = final_hidden_states(model, ids)
        recomputed = torch.nn.functional.linear(hidden, weight, bias).float()
    finally:
        model.train(was_training)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
    error = (logits - recomputed).abs().max().item()
    scale = max(logits.abs().max().item(), 1.0)
    if error > tolerance * scale:
        raise ValueError(f"model: {type(model).__name__}'s logits differ from its final hidden states times its "
                         f"output embedding (max difference {error:.3g}); the fused loss computes hidden @ W.T + b "
                         "and cannot reproduce a transformed output (logit soft-capping or scaling)")


def check_lm_head_covers(model, vocab: int, *, argument: str = "model") -> None:
    """Raises ValueError when the output embedding has fewer rows than the vocabulary ``vocab``."""
    rows = output_embedding(model)[0].shape[0]
    if rows < vocab:
        raise ValueError(f"{argument}: its lm_head has {rows} rows, fewer than the tokenizer's {vocab} ids")


def export_causal_lm(model, state_dict: dict, directory: str, *, tokenizer=None,
                     dtype: Optional[torch.dtype] = None) -> str:
    """Writes ``state_dict`` (a whole model's, keys as ``model.state_dict()``'s, e.g. from
    `fsdp.full_model_state_dict`) as a Hugging Face checkpoint in ``directory``: safetensors
    weights, config and generation config of ``model``'s architecture, and ``tokenizer`` when
    given, loadable by ``AutoModelForCausalLM.from_pretrained(directory)``. Floating tensors are
    cast to ``dtype`` when given. ``model`` gives only the config (a sharded model is fine);
    the weights are assigned to a model built on the meta device, so no second copy is made.
    Returns ``directory``."""
    from transformers import AutoModelForCausalLM

    if dtype is not None:
        state_dict = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                      for name, tensor in state_dict.items()}
    config = model.config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config)
    missing, unexpected = fresh.load_state_dict(state_dict, strict=False, assign=True)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or {})
    missing = [name for name in missing if name not in tied]
    if missing or unexpected:
        raise ValueError(f"state_dict: does not fit {type(fresh).__name__}: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    fresh.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = model.generation_config
    os.makedirs(directory, exist_ok=True)
    fresh.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
