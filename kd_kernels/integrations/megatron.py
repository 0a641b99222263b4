"""Megatron-core: the fused top-k KD loss on a `GPTModel`'s vocab-parallel output layer.

Megatron's output layer is a `ColumnParallelLinear` whose weight on tensor-parallel rank r
holds global vocab rows ``[r·V_local, (r+1)·V_local)`` (`VocabUtility`), exactly the shard
convention of ``group=`` here. So the loss takes the decoder's final hidden states and the
output layer's weight shard, and never builds ``[tokens, vocab]`` logits.

Gradients: the hidden states (replicated over the TP group, sequence parallel off) receive
the gradient already summed over the group, which is what Megatron's column-parallel
output layer does in its backward; the output layer itself is bypassed, so nothing is
summed twice. The model's vocab is padded to a multiple of the TP size; pass the real
tokenizer vocab as ``vocab_size`` so padded rows never count.

Megatron-core's GPTModel cannot run forward on CPU (its attention allocates a buffer on
``torch.cuda.current_device()``), so the CPU tests check these helpers on a CPU-built
model's output layer with gloo, and ``examples/megatron_tp2_distill.py`` trains on GPUs.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import api
from ..topk import TopK


def tensor_parallel_group():
    """Megatron's tensor-model-parallel process group (parallel_state must be initialized)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def output_layer_weight(model) -> torch.Tensor:
    """``[V_local, H]`` weight of a GPTModel's output layer (the shared embedding when tied)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def check_vocab_layout(model) -> tuple[int, int]:
    """(vocab_start, vocab_end) of this rank's output-layer rows, checked against Megatron's
    own `VocabUtility` so a layout change upstream fails loudly instead of silently."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.utils import VocabUtility

    local = output_layer_weight(model).shape[0]
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(local, rank, world)
    if (start, end) != (rank * local, (rank + 1) * local):
        raise RuntimeError(f"Megatron's vocab range for rank {rank} is [{start}, {end}), expected "
                           f"[{rank * local}, {(rank + 1) * local}); kd_kernels' shard convention no longer matches")
    if getattr(model.config, "sequence_parallel", False):
        raise ValueError("model.config.sequence_parallel: expected False (the loss needs every token's hidden state "
                         "on every tensor-parallel rank)")
    return start, end


def gpt_hidden_states(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Final hidden states of a Megatron GPTModel, ``[B·S, H]`` in (batch, position) row
    order (matching ``labels.reshape(-1)``), without the output layer."""
    embeddings = model.embedding(input_ids=input_ids, position_ids=position_ids)
    hidden = model.decoder(hidden_states=embeddings, attention_mask=attention_mask)  # [S, B, H]
    return hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])


def teacher_topk(model, input_ids, position_ids, attention_mask, k: int = 64, *, temperature: float = 1.0,
                 vocab_size: Optional[int] = None, **kwargs) -> TopK:
    """`kd_kernels.teacher_topk` of a (teacher) GPTModel over its TP group; rows (batch, position)."""
    check_vocab_layout(model)
    with torch.no_grad():
        hidden = gpt_hidden_states(model, input_ids, position_ids, attention_mask)
        return api.teacher_topk(hidden, output_layer_weight(model), k, temperature=temperature, vocab_size=vocab_size,
                                group=tensor_parallel_group(), **kwargs)


def topk_divergence(model, input_ids, position_ids, attention_mask, teacher: TopK, labels: Optional[torch.Tensor],
                    **options):
    """`kd_kernels.topk_divergence` of a (student) GPTModel over its TP group. ``labels``
    ``[B, S]`` already shifted (position s predicts token s + 1), or None."""
    check_vocab_layout(model)
    hidden = gpt_hidden_states(model, input_ids, position_ids, attention_mask)
    flat_labels = None if labels is None else labels.reshape(-1)
    return api.topk_divergence(hidden, output_layer_weight(model), teacher, flat_labels,
                               group=tensor_parallel_group(), **options)
