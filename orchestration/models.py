"""The models the workers hold: built (a small Llama) or loaded (a local Hugging Face causal
LM), their final hidden states and lm_head inputs for the kd_kernels API, and held-out CE."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX

HELD_OUT_LOGIT_ROWS = 2048  # positions whose [rows, V] float32 logits the held-out CE holds at once
LM_HEAD_ROW_MULTIPLE = 64  # lm_head rows padded like real models'; kd vocab_size keeps the real count


def pick_device(config) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def build_model(path: Optional[str], hidden: int, layers: int, config, vocab: int, seed: int,
                dtype: torch.dtype = torch.float32):
    """A Hugging Face causal LM from a local path, its weights in ``dtype`` whatever dtype the
    checkpoint holds (`hf_models.load_causal_lm`), or a small float32 Llama built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if path:
        from .hf_models import load_causal_lm

        return load_causal_lm(path, dtype=dtype, attention=config.attention)
    torch.manual_seed(seed)
    padded = -(-vocab // LM_HEAD_ROW_MULTIPLE) * LM_HEAD_ROW_MULTIPLE
    model_config = LlamaConfig(vocab_size=padded, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, num_attention_heads=config.heads,
                               num_key_value_heads=config.heads, max_position_embeddings=config.row_tokens,
                               tie_word_embeddings=False, attn_implementation=config.attention)
    return LlamaForCausalLM(model_config)


def lm_head_inputs(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, lm_head weight) in the dtype the lm_head matmul runs in: bfloat16 on GPUs, as
    autocast would run the model's own Linear (the final norm hands over float32, and a float32
    matmul of the lm_head costs more than the rest of a small student), the hidden dtype on
    CPU. The casts are differentiable."""
    weight = model.get_output_embeddings().weight
    dtype = torch.bfloat16 if hidden.is_cuda else hidden.dtype
    return hidden.to(dtype), weight.to(dtype)


def scoring_dtype(device: torch.device) -> torch.dtype:
    """The dtype a frozen teacher loaded from a checkpoint is held in: bfloat16 on GPUs (what
    autocast would cast every weight to at every forward), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def autocast(device: torch.device):
    """bf16 autocast on CUDA, none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def held_out_sums(model, chunk: tuple, vocab: int, device: torch.device, implementation: str) -> tuple[float, int]:
    """(summed CE in nats, counted tokens) of ``model`` on a held-out ``chunk`` ``(tokens,
    labels, positions or None, documents or None)``, each ``[R, T]`` int64 (labels shifted):
    packed rows with their position ids and block-diagonal mask for ``implementation``
    (`workers.layout_of`), so a token never attends across a document; plain causal rows
    without document ids."""
    from .hf_models import final_hidden_states, output_embedding
    from .workers import layout_of

    rows, labels, positions, documents = chunk
    model.eval()
    weight, bias = output_embedding(model)
    # float32 logits from float32 operands: a bf16 teacher's lm_head is cast once a call
    weight, bias = weight[:vocab].float(), None if bias is None else bias[:vocab].float()
    total, count = 0.0, 0
    for start in range(0, rows.shape[0], 8):
        part = slice(start, start + 8)
        position_ids, mask = layout_of(None if positions is None else positions[part],
                                       None if documents is None else documents[part], device, implementation)
        tokens, targets = rows[part].to(device), labels[part].to(device).reshape(-1)
        with autocast(device):
            hidden = final_hidden_states(model, tokens, position_ids=position_ids, attention_mask=mask)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        # float32 logits of HELD_OUT_LOGIT_ROWS positions at a time: never [8·T, V] at once
        for first in range(0, hidden.shape[0], HELD_OUT_LOGIT_ROWS):
            piece = slice(first, first + HELD_OUT_LOGIT_ROWS)
            logits = hidden[piece].float() @ weight.T
            if bias is not None:
                logits = logits + bias
            total += F.cross_entropy(logits, targets[piece], ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += (targets != IGNORE_INDEX).sum().item()
    return total, count
