"""The student worker: trains a causal LM with kd_kernels.topk_divergence on its final
hidden states and the teacher's top-k (AdamW, clip, warm-up + cosine LR, bf16 autocast on
GPU); data-parallel ranks sum gradients; its training state saves and restores exactly."""
from __future__ import annotations

import math
import os
import random
import time
from typing import Optional

import torch

import kd_kernels as kd

from . import checkpoint
from .models import autocast, build_model, final_hidden_states, held_out_sums, lm_head_inputs, pick_device
from .process_group import World, join_world
from .transfer import transfer_for
from .weight_source import WeightSource
from .workers import Worker

STATE_FILE = "student.pt"


def lr_factor(warmup_steps: int, total_steps: int):
    """LR factor of a step: linear warm-up, then cosine decay to 10 % at ``total_steps``."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


class StudentWorker(Worker, WeightSource):
    """One data-parallel rank of the student. The loss options (``config.loss_options()``:
    divergence, support, temperature, weights, beta, ...) go to kd.topk_divergence as one
    dict; the driver owns ``vocab_size`` and the normalization by the step's token count."""

    def __init__(self, config, vocab: int, rank: int = 0, world_size: int = 1, world: Optional[World] = None,
                 transfer: str = "object_store"):
        self.config, self.vocab, self.rank, self.world_size = config, vocab, rank, world_size
        self.device = pick_device(config)
        self.loss_options = config.loss_options()
        self.transfer = transfer_for(transfer)
        self.gradient_group = join_world(world)
        self.model = build_model(config.student_path, config.student_hidden, config.student_layers, config, vocab,
                                 config.seed + 1).to(self.device)
        # one fused kernel for the whole update on GPUs (the per-tensor loop is launch-bound there)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config.warmup_steps, config.steps))
        self._values_checked = False
        torch.manual_seed(config.seed + 2)
        random.seed(config.seed + 2)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, teacher: kd.TopK, num_tokens: int,
             rows: Optional[torch.Tensor] = None, ce_weight: Optional[float] = None):
        """(loss, metrics) of kd.topk_divergence for one micro-batch: tokens ``[B, T]``,
        shifted labels ``[B·T]``, the teacher's top-k of its ``B·T`` rows; the loss is a sum
        divided by ``num_tokens`` (the step's global count). ``rows`` ``[R]`` (flat indices
        into ``B·T``): only those rows are trained, ``labels`` and the top-k are then ``[R]``
        (a response's rows). ``ce_weight``: the CE weight of this step (None: the option's)."""
        with autocast(self.device):
            hidden = final_hidden_states(self.model, tokens)
        if rows is not None:
            hidden = hidden[rows]
        options = self.loss_options if ce_weight is None else dict(self.loss_options, ce_weight=ce_weight)
        return kd.topk_divergence(*lm_head_inputs(self.model, hidden), teacher, labels, **options,
                                  num_tokens=max(num_tokens, 1), vocab_size=self.vocab, return_metrics=True,
                                  check_values=not self._values_checked)

    def train_step(self, step: int, micro_batches: list, topk_refs: list, num_tokens: int,
                   ce_weight: Optional[float] = None) -> dict:
        """One optimizer step over this rank's micro-batches ``[(tokens, labels)]`` or
        ``[(tokens, labels, rows)]`` (`loss`; ``ce_weight`` likewise) with the
        teacher's replies (object refs of (message, seconds), resolved here). The loss is
        normalized by the step's global token count ``num_tokens`` and gradients are summed
        over the ranks, so any split of the micro-batches gives the same update. Returns
        this rank's sums."""
        import ray

        if self.config.fail_student_at_step == step:
            os._exit(1)  # fault injection (tests): the process dies as a crashed worker would

        start = time.perf_counter()
        received = ray.get(topk_refs)  # waits for the teacher when it has not finished yet
        wait_seconds = time.perf_counter() - start
        teachers = [self.transfer.receive(message, self.device) for message, _ in received]
        teacher_seconds = [seconds for _, seconds in received]
        transfer_seconds = time.perf_counter() - start - wait_seconds
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        names = ("loss", "kd_sum", "ce_sum", "teacher_mass_sum", "rows")
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)  # read once: one host sync a step
        for (tokens, labels, *rows), teacher in zip(micro_batches, teachers):
            loss, metrics = self.loss(tokens.to(self.device), labels.to(self.device).reshape(-1), teacher, num_tokens,
                                      rows[0].to(self.device) if rows else None, ce_weight)
            loss.backward()
            sums += torch.stack([loss.detach().double()] + [metrics[name].double() for name in names[1:]])
        # our own teacher and data pipeline made them: their ids and labels are checked on the first step only
        self._values_checked = True
        self._sum_gradients_over_ranks()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        totals = dict(zip(names, sums.tolist()), teacher_seconds=sum(teacher_seconds))
        worker_seconds = time.perf_counter() - start
        return dict(totals, wait_seconds=wait_seconds, transfer_seconds=transfer_seconds,
                    student_seconds=worker_seconds - wait_seconds - transfer_seconds, worker_seconds=worker_seconds,
                    lr=self.scheduler.get_last_lr()[0])

    def train_step_rows(self, step: int, picks: list, topk_refs: list, num_tokens: int,
                        ce_weight: Optional[float] = None) -> dict:
        """`train_step` on the training rows ``picks`` (one ``[B]`` int64 tensor per micro-batch)."""
        return self.train_step(step, [self.micro_batch(pick) for pick in picks], topk_refs, num_tokens, ce_weight)

    def _sum_gradients_over_ranks(self) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.gradient_group)  # one collective for all parameters
        offset = 0
        for parameter, grad in zip(self.model.parameters(), grads):
            parameter.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def training_state(self, step: int) -> dict:
        """Everything an exact resume after ``step`` needs: model, optimizer, scheduler and
        the RNG states (torch, CUDA, Python) of this process."""
        state = dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                     scheduler=self.scheduler.state_dict(), step=step, torch_rng=torch.get_rng_state(),
                     python_rng=random.getstate())
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, directory: str, step: int, metadata: dict) -> str:
        """Writes the checkpoint of ``step`` atomically (`checkpoint.write`) with the driver's
        ``metadata`` (its data order, the run segment) in the manifest."""
        state = self.training_state(step)
        return checkpoint.write(directory, step, {STATE_FILE: lambda path: torch.save(state, path)}, metadata)

    def load(self, directory: str) -> tuple[int, dict]:
        """Restores a checkpoint written by `save`; (its step, the driver's metadata)."""
        state = torch.load(os.path.join(directory, STATE_FILE), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return state["step"], checkpoint.read_manifest(directory)["metadata"]

    def connect(self, teacher_ranks: list) -> None:
        """Connects to these teachers' process-group ranks before any training (`Transfer.setup`)."""
        self.transfer.setup(teacher_ranks, self.device, sending=False)

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().float().cpu().reshape(-1) for p in self.model.parameters()])

    def held_out_sums(self, rows: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """(summed CE, tokens) on held-out rows (see `models.held_out_sums`)."""
        return held_out_sums(self.model, rows, labels, self.vocab, self.device)
