"""The driver's rollout worker as a Ray actor: a `rollout.RolloutWorker` holding a copy of the
student built as the student worker builds it (same path or config and seed, so both start with
equal weights), answering the driver's supervision (`workers.Worker`: ping, pid, GPU).

Generation runs in its own concurrency group, so that ``pause_generation`` (default group) can
arrive while a generation runs; the default group runs one call at a time, in the order the
driver sent them, so the buckets of an update are received in the sender's order."""
from __future__ import annotations

import ray
import torch

from .models import build_model, pick_device
from .rollout import RolloutWorker
from .workers import Worker


class RolloutActor(RolloutWorker, Worker):
    """``config`` (the run's `Config`), the real ``vocab``, the tokenizer's ``pad_token_id``. On a
    GPU it generates in bfloat16 (the received float32 weights are cast as they are copied in)."""

    RAY_CLASS_OPTIONS = dict(concurrency_groups={"generation": 1})  # `actors.Actors.start` applies them

    def __init__(self, config, vocab: int, pad_token_id: int):
        self.config, self.vocab = config, vocab
        super().__init__(lambda: build_model(config.student_path, config.student_hidden, config.student_layers,
                                             config, vocab, config.seed + 1),
                         pad_token_id=pad_token_id, device=pick_device(config), vocab_size=vocab,
                         dtype=torch.bfloat16 if pick_device(config).type == "cuda" else None)

    @ray.method(concurrency_group="generation")
    def generate(self, prompts, sampling):
        return super().generate(prompts, sampling)
