"""A rollout worker: a copy of the student that samples completions of prompts, and takes weight
updates from the trainer with the method names of SGLang's engines.

`RolloutWorker` is a plain class; the driver wraps it with ``ray.remote`` (with
``max_concurrency`` >= 2, so that `pause_generation` can arrive while `generate` runs). The
weight-update protocol, as SGLang's ``Engine`` spells it, so that an external engine can take the
worker's place through an adapter:

- ``init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
  backend)``: joins the weight group (`weight_sync.WeightGroup`) as rank ``rank_offset``;
- ``update_weights_from_distributed(names, dtypes, shapes, group_name, weight_version)``: one
  bucket broadcast by the trainer (SGLang's ``load_format="flattened_bucket"``: one flat buffer
  per call, offsets from `weight_sync.bucket_layout`);
- ``update_weights_from_tensor(names, dtypes, shapes, payload, weight_version, whole_update)``:
  one bucket as a packed buffer or a CUDA IPC handle of it (a worker on the trainer's GPU); with
  ``whole_update`` the payload is the whole update and the call does pause → update → continue
  itself, under the lock (one message instead of four; SGLang's call also takes its
  model-update lock and flushes itself);
- ``pause_generation()`` → ``flush_cache()`` → updates → ``continue_generation()``;
- ``destroy_weights_update_group(group_name)``.

One method is an extension beside SGLang's names: ``share_weight_buffer()`` hands the worker's
flat parameter buffer (CUDA IPC on its GPU, shared memory on CPU) and its lock-and-version file
(`shared_weights`) to a trainer on the same GPU or node once; from then on the trainer's
`weight_sync.WeightPusher` updates the weights by itself (lock, one copy, publish the version),
and a generation reads the version it runs with under that lock. The calls above keep working
beside it (they take the same lock).

Generation is Hugging Face ``generate`` (KV-cached, batched with left padding and an attention
mask). A generation and an update never overlap (`weight_sync.WeightReceiver`): a generation
requested during an update waits for ``continue_generation`` and runs on the whole new model.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch

from .flat_parameters import flatten_parameters
from .shared_weights import SharedWeights
from .weight_sync import UpdateMetrics, WeightReceiver


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. ``temperature`` 0 is greedy (``top_p`` / ``top_k`` unused);
    ``top_k`` 0 and ``top_p`` 1 switch those filters off. A completion ends after its first token
    in ``stop_token_ids`` (that token is part of the response) or after ``max_new_tokens``.
    ``seed``: the sampling of a call is a function of (seed, weights, prompts); None draws from
    the process's generator."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if not all(isinstance(token, int) and token >= 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected token ids (ints >= 0), got {self.stop_token_ids!r}")


@dataclass
class Rollout:
    """Completions of a batch of prompts. ``response_ids`` ``[B, N]`` int64, right-padded with the
    worker's ``pad_token_id``; ``response_mask`` ``[B, N]`` bool, True up to and including the
    first stop token; ``lengths`` ``[B]`` int64 (the mask's row sums); ``weight_version`` of the
    weights that generated every sample of the batch."""
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    lengths: torch.Tensor
    weight_version: int
    seconds: float

    def responses(self) -> list[list[int]]:
        """Each prompt's response token ids, without padding."""
        return [row[:length].tolist() for row, length in zip(self.response_ids, self.lengths.tolist())]


def response_mask(tokens: torch.Tensor, stop_token_ids: Sequence[int]) -> torch.Tensor:
    """``[B, N]`` bool: True at each position up to and including the row's first stop token
    (every position when the row has none)."""
    if not stop_token_ids:
        return torch.ones_like(tokens, dtype=torch.bool)
    is_stop = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=tokens.device))
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    return stops_before == 0


class _PaddingRowsOff:
    """A logits processor: the scores of ids >= ``vocab_size`` (lm_head padding rows) -> -inf."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.vocab_size:] = -float("inf")  # in place: no copy of [B, V] a token
        return scores


class RolloutWorker:
    """Holds a copy of the student (``model``: a Hugging Face causal LM, or a callable returning
    one) on ``device``, in ``dtype`` (None keeps the model's), and generates completions with it.
    ``pad_token_id`` pads prompts (left) and responses (right). ``vocab_size``: the tokenizer's
    real vocab when the lm_head has padding rows beyond it (ids >= it are never sampled); None:
    every row is a token. Parameters of one dtype are moved into one flat buffer
    (`flat_parameters`), so that an update from a flattened trainer is one copy."""

    def __init__(self, model: Union[torch.nn.Module, Callable[[], torch.nn.Module]], *, pad_token_id: int,
                 device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None,
                 vocab_size: Optional[int] = None):
        if not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id: expected a token id (int >= 0), got {pad_token_id!r}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size: expected None or an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        built = model if isinstance(model, torch.nn.Module) else model()
        self.model = built.to(device=self.device, dtype=dtype).eval()
        self.model.requires_grad_(False)
        if len({parameter.dtype for parameter in self.model.parameters()}) == 1:
            flatten_parameters(self.model)  # an update from a flattened trainer is then one copy
        # generate() fills what its GenerationConfig leaves unset from the model's own: a checkpoint's
        # (repetition_penalty, top_k, EOS ids, ...) would reshape the student's distribution, and the
        # samples would no longer be on-policy. Only `SamplingParams` shape them.
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()
        self.pad_token_id = pad_token_id
        self._receiver = WeightReceiver(self.model)

    @property
    def weight_version(self) -> int:
        return self._receiver.weight_version

    def get_weight_version(self) -> int:
        return self._receiver.weight_version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams()) -> Rollout:
        """Completions of ``prompts`` (token id lists, each non-empty), batched. Waits while the
        worker is paused or a push writes its weights; the weights cannot change while it runs."""
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("prompts: expected a non-empty list of non-empty token id lists")
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        options: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, pad_token_id=self.pad_token_id,
                                       eos_token_id=list(sampling.stop_token_ids) or None, use_cache=True)
        if self.vocab_size is not None:
            from transformers import LogitsProcessorList

            options["logits_processor"] = LogitsProcessorList([_PaddingRowsOff(self.vocab_size)])
        if sampling.temperature > 0:
            options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k)
        else:
            options.update(do_sample=False)
        with self._receiver.generation() as weight_version:
            start = time.perf_counter()
            with self._seeded(sampling.seed):
                output = self.model.generate(input_ids=input_ids.to(self.device),
                                             attention_mask=attention_mask.to(self.device), **options)
            seconds = time.perf_counter() - start
        tokens = output[:, width:].cpu()
        if tokens.shape[1] < sampling.max_new_tokens:  # every row stopped early
            padding = torch.full((tokens.shape[0], sampling.max_new_tokens - tokens.shape[1]), self.pad_token_id)
            tokens = torch.cat([tokens, padding], dim=1)
        mask = response_mask(tokens, sampling.stop_token_ids)
        tokens = tokens.masked_fill(~mask, self.pad_token_id)
        return Rollout(tokens, mask, mask.sum(dim=1), weight_version, seconds)

    @contextmanager
    def _seeded(self, seed: Optional[int]) -> Iterator[None]:
        """With a seed: the global generators seeded with it, restored afterwards; else untouched."""
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    # ---- the weight-update protocol (SGLang's names) ----

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo") -> None:
        """Joins the trainer's weight group as rank ``rank_offset`` (>= 1; the trainer is 0)."""
        self._receiver.join_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence, shapes: Sequence[Sequence[int]],
                                        group_name: str, weight_version: int) -> dict:
        """The trainer's next broadcast bucket into the weights (between pause and continue)."""
        return self._receiver.receive_broadcast(names, dtypes, shapes, group_name, weight_version)

    def update_weights_from_tensor(self, names: Optional[Sequence[str]], dtypes: Optional[Sequence],
                                   shapes: Optional[Sequence[Sequence[int]]], payload: Any, weight_version: int,
                                   whole_update: bool = False) -> dict:
        """A packed bucket (a ``uint8`` buffer, or a CUDA IPC handle of one), or a list of CUDA IPC
        handles of the tensors themselves, into the weights (`WeightReceiver.receive_buffer`):
        between pause and continue, the bucket's reply. ``whole_update`` True: the payload is the
        whole update, and this one call pauses (waiting for a running generation), copies and
        continues under the worker's lock (`WeightReceiver.receive_whole`; no cache outlives a
        `generate` call, so none to flush); the update's metrics, as `continue_generation`
        returns them."""
        if not isinstance(whole_update, bool):
            raise ValueError(f"whole_update: expected a bool, got {whole_update!r}")
        if not whole_update:
            return self._receiver.receive_buffer(names, dtypes, shapes, payload, weight_version)
        return self._receiver.receive_whole(names, dtypes, shapes, payload, weight_version).as_dict()

    # ---- an extension beside SGLang's names: the trainer pushes into the shared buffer ----

    def share_weight_buffer(self) -> SharedWeights:
        """The flat parameter buffer, shared once with a trainer on this GPU (CUDA IPC) or node
        (shared memory), with the lock and version file (`WeightReceiver.share_buffer`): the
        trainer's `weight_sync.WeightPusher` then updates the weights without calling this worker."""
        return self._receiver.share_buffer()

    def pause_generation(self) -> None:
        """Blocks new generations and returns once the running one has finished."""
        self._receiver.pause()

    def flush_cache(self) -> bool:
        """Nothing to flush: the KV cache lives within one `generate` call. True, as SGLang's."""
        return True

    def continue_generation(self) -> Optional[dict]:
        """Resumes generation, on the update received during the pause if any (its metrics)."""
        metrics: Optional[UpdateMetrics] = self._receiver.resume()
        return None if metrics is None else metrics.as_dict()

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._receiver.leave_group(group_name)
