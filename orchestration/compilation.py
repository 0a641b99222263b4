"""``torch.compile`` of a model's decoder layers (the driver's ``compile`` option).

Each decoder layer (`fsdp.decoder_layers`) is compiled in place with ``nn.Module.compile``:
the module stays the same object, so state_dict keys, checkpoints, ``save_pretrained``,
FSDP2's units and the weight sync see no change. Every layer of a model runs the same
``forward`` code with its parameters as graph inputs, so one compiled graph serves all of
them (a second one for each other grad mode, dtype or shape: the teacher's scoring under
no_grad, a held-out chunk's batch). With activation checkpointing the checkpointed forward is
what is compiled (the checkpoint is traced into the graph).

Shapes: static where every micro-batch has one shape (`static_shapes`: off-policy and cache
runs, rows of ``row_tokens``), so a model of another width in the same process (a fused
teacher and student) gets its own static graph instead of turning the sizes symbolic for
both; torch's automatic dynamic shapes where the width changes from round to round
(on-policy rows are padded to their longest sequence), where static graphs would recompile
at each new width until dynamo's recompile limit and then run eagerly.
"""
from __future__ import annotations

from .fsdp import decoder_layers

# The torch.compile backend. A module constant, not an option: tests swap in a cheaper backend
# ("aot_eager" or a recording callable) in the worker processes.
BACKEND = "inductor"


# the modes whose micro-batches change width: on-policy rounds are padded to their longest sequence
VARIABLE_WIDTH_MODES = ("on_policy", "gkd")


def static_shapes(mode: str) -> bool:
    """Whether every micro-batch of a run of driver ``mode`` has one shape."""
    return mode not in VARIABLE_WIDTH_MODES


def compile_decoder_layers(causal_lm, *, static: bool = True) -> list:
    """Compiles each decoder layer of the Hugging Face model ``causal_lm`` in place with
    ``torch.compile`` (`BACKEND`; ``static``: ``dynamic=False``, else torch's automatic dynamic
    shapes); returns the layers. Call it after FSDP2's ``fully_shard`` and activation
    checkpointing are applied. Raises TypeError when the model names no decoder layer class
    (`fsdp.decoder_layers`)."""
    layers = decoder_layers(causal_lm)
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=False if static else None)
    return layers
