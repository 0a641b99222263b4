"""``torch.compile`` of a model's decoder layers (the driver's ``compile`` option: "true",
"false", or "auto": compiled on CUDA in off-policy runs of a replica student, `compiles`).

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

import torch

from .fsdp import decoder_layers, names_decoder_layers

# The torch.compile backend. A module constant, not an option: tests swap in a cheaper backend
# ("aot_eager" or a recording callable) in the worker processes.
BACKEND = "inductor"


# Graphs dynamo keeps per code object before it runs a new shape eagerly: every decoder layer of
# both models shares its forward's code, and a run makes one graph per (model, grad mode, shape),
# plus one a layer for each no_grad shape of an FSDP2 student with activation checkpointing
RECOMPILE_LIMIT = 32

# the modes whose micro-batches change width: on-policy rounds are padded to their longest sequence
VARIABLE_WIDTH_MODES = ("on_policy", "gkd")


def static_shapes(mode: str) -> bool:
    """Whether every micro-batch of a run of driver ``mode`` has one shape."""
    return mode not in VARIABLE_WIDTH_MODES


def compiles(config, device: torch.device, causal_lm) -> bool:
    """Whether a worker of the run ``config`` on ``device`` compiles the decoder layers of
    ``causal_lm`` under ``config.compile``: "true" / "false", or "auto": off-policy runs of a
    replica student on CUDA devices (where it was measured the faster) of a model that names its
    decoder layers (`fsdp.decoder_layers`); eager on the CPU (compilation costs minutes there),
    in on-policy and cache runs and with an FSDP2 student (none measured compiled on a GPU) and
    for a model that names none."""
    if config.compile not in ("auto", "true", "false"):
        raise ValueError(f"compile: expected one of 'auto', 'true', 'false', got {config.compile!r}")
    if config.compile == "auto":
        return (device.type == "cuda" and config.mode == "off_policy" and config.student_strategy == "replica"
                and names_decoder_layers(causal_lm))
    return config.compile == "true"


def compile_decoder_layers(causal_lm, *, static: bool = True) -> list:
    """Compiles each decoder layer of the Hugging Face model ``causal_lm`` in place with
    ``torch.compile`` (`BACKEND`; ``static``: ``dynamic=False``, else torch's automatic dynamic
    shapes); returns the layers. Call it after FSDP2's ``fully_shard`` and activation
    checkpointing are applied. Raises dynamo's recompile limit of this process to at least
    `RECOMPILE_LIMIT` plus two graphs a layer, and lets dynamo trace a checkpointed layer whose
    forward sets and restores outside state (see the body). Raises TypeError when the model
    names no decoder layer class (`fsdp.decoder_layers`)."""
    import torch._dynamo

    layers = decoder_layers(causal_lm)
    # a layer forward that sets and resets state outside itself (transformers >= 5.25 routes
    # attention through the `kernels` hub's context variable) cannot be traced inside an
    # activation checkpoint unless the recompute may skip replaying it; the state comes back
    # to its value before the forward, so there is nothing to replay
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT + 2 * len(layers))
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=False if static else None)
    return layers
