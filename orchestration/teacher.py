"""The teacher worker: a frozen causal LM that scores micro-batches into packed top-k
(`kd_kernels.teacher_topk`) and sends them by its `Transfer`; a teacher built from a config
pretrains itself first, in chunks the driver calls (so it can show progress)."""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

import kd_kernels as kd

from .compilation import compile_decoder_layers, compiles, static_shapes
from .data import IGNORE_INDEX
from .hf_models import final_hidden_states
from .models import autocast, build_model, held_out_sums, lm_head_inputs, pick_device, scoring_dtype
from .process_group import World, join_world
from .transfer import transfer_for
from .workers import Worker, layout_of


class TeacherWorker(Worker):
    """Frozen teacher (eval, no grad). Loaded from ``teacher_path`` in `models.scoring_dtype`
    (bf16 weights on GPUs); built from the config when no path is given, in float32 (it
    pretrains itself)."""

    def __init__(self, config, vocab: int, transfer: str = "object_store", world: Optional[World] = None):
        self.config, self.vocab = config, vocab
        self.device = pick_device(config)
        join_world(world)
        self.transfer = transfer_for(transfer)
        self.model = build_model(config.teacher_path, config.teacher_hidden, config.teacher_layers, config, vocab,
                                 config.seed, dtype=scoring_dtype(self.device)).to(self.device)
        if compiles(config, self.device, self.model):
            compile_decoder_layers(self.model, static=static_shapes(config.mode))
        self._pretraining = None

    def pretrain(self, steps: int) -> float:
        """``steps`` more CE steps on the training rows (`set_rows`), continuing the earlier
        calls' optimizer, schedule and data order; the last loss. The whole pretraining is
        ``config.teacher_pretrain_steps`` steps, for a teacher built from a config."""
        if self._pretraining is None:
            lr = self.config.lr if self.config.teacher_lr is None else self.config.teacher_lr
            optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=self.device.type == "cuda")
            # warm-up, then constant at teacher_lr (docs/DECISIONS.md: a teacher at the students' lr from
            # step 0 can end worse than the students it is to teach)
            warmup = max(1, self.config.warmup_steps)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
            self._pretraining = optimizer, scheduler, torch.Generator().manual_seed(self.config.seed + 17)
        optimizer, scheduler, generator = self._pretraining
        loss = torch.full((), float("nan"))
        self.model.train()
        for _ in range(steps):
            batch_rows = self.config.rows_per_micro_batch * self.config.micro_batches  # a student step's rows
            pick = torch.randint(0, self.rows.shape[0], (batch_rows,), generator=generator)
            tokens, targets = (part.to(self.device) for part in self.micro_batch(pick))
            positions, mask = self.row_layout(pick, self.device, self.config.attention, share=False)
            with autocast(self.device):
                logits = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                                    use_cache=False).logits
            logits = logits[..., :self.vocab]
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            optimizer.step()
            scheduler.step()
        return loss.item()

    def finish_pretraining(self) -> None:
        """Drops the pretraining's optimizer; with ``teacher_offload`` the weights go to the CPU."""
        self._pretraining = None
        if self.config.teacher_offload:
            self.model.to("cpu")

    def state_dict(self) -> dict:
        return {name: tensor.cpu() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def _layout(self, pick: torch.Tensor):
        return self.row_layout(pick, self.device, self.config.attention)

    @torch.no_grad()
    def entries(self, tokens: torch.Tensor, first_row: int = 0, samples: int = 0,
                position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                rows: Optional[torch.Tensor] = None):
        """The teacher's entries of tokens ``[B, T]`` (the consecutive training rows from
        ``first_row``; packed rows with their position ids and block-diagonal mask) on its device:
        `kd.TopK` of k a position, or with ``samples`` > 0 `kd.TeacherSamples` of that many a
        position, seeded by the run's seed, the noise row of a position its global index
        (row · T + t): a row's samples do not depend on how rows are batched. ``rows`` ``[R]``
        (flat indices into ``B·T``): the entries of those rows only (a response's)."""
        if self.config.teacher_offload:
            self.model.to(self.device)
        self.model.eval()
        tokens = tokens.to(self.device)
        with autocast(self.device):
            hidden = final_hidden_states(self.model, tokens, position_ids=position_ids,
                                         attention_mask=attention_mask)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            hidden = hidden[rows.to(self.device)]
        inputs = lm_head_inputs(self.model, hidden)
        if samples:
            entries = kd.teacher_sample(*inputs, samples, seed=self.config.seed, temperature=self.config.temperature,
                                        vocab_size=self.vocab, row_offset=first_row * tokens.shape[1])
        else:
            entries = kd.teacher_topk(*inputs, k=self.config.k, temperature=self.config.temperature,
                                      vocab_size=self.vocab)
        if self.config.teacher_offload:
            self.model.to("cpu")
        return entries

    def score(self, tokens: torch.Tensor, step: int = 0, student_rank: int = 0, rows: Optional[torch.Tensor] = None,
              position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None):
        """tokens ``[B, T]`` → (the transfer message of the packed bf16 top-k for the student
        of rank ``student_rank``, seconds spent). ``rows`` ``[R]`` (flat indices into ``B·T``):
        the top-k of those rows only (a response's). With ``teacher_offload`` the weights come
        from the CPU for the call and go back after it."""
        start = time.perf_counter()
        message = self.transfer.send(self.entries(tokens, position_ids=position_ids, attention_mask=attention_mask,
                                                  rows=rows), step, student_rank)
        return message, time.perf_counter() - start

    def score_rows(self, pick: torch.Tensor, step: int = 0, student_rank: int = 0):
        """`score` of the training rows ``pick`` ``[B]`` int64."""
        return self.score(self.micro_batch(pick)[0], step, student_rank, None, *self._layout(pick))

    def topk_of_chunk(self, chunk: tuple) -> kd.TopK:
        """The CPU `kd.TopK` of a held-out chunk ``(tokens, labels, positions or None,
        documents or None)``, for `StudentWorker.evaluate`."""
        tokens, _, positions, documents = chunk
        position_ids, mask = layout_of(positions, documents, self.device, self.config.attention)
        top = self.entries(tokens, position_ids=position_ids, attention_mask=mask)
        return kd.TopK(top.logprobs.cpu(), top.indices.cpu(), None if top.lse is None else top.lse.cpu(),
                       top.temperature)

    def connect(self, student_ranks: list) -> None:
        """Connects to these students' process-group ranks before any scoring (`Transfer.setup`)."""
        self.transfer.setup(student_ranks, self.device, sending=True)

    def release(self, step: int) -> dict:
        """The students are done with the buffers of ``step``: free them. Returns this
        process's peak memory (`Worker.memory`), for the metrics."""
        self.transfer.release(step)
        return self.memory()

    def held_out_sums(self, chunk: tuple) -> tuple[float, int]:
        """(summed CE, tokens) on a held-out chunk (see `models.held_out_sums`)."""
        self.model.to(self.device)  # offloaded teachers come back for it
        return held_out_sums(self.model, chunk, self.vocab, self.device, self.config.attention)
