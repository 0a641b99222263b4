"""Ray actors: a teacher worker that scores micro-batches into packed top-k buffers, and a
student worker that trains on them. They use only the public kd_kernels API."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import kd_kernels as kd

from .config import Config
from .data import IGNORE_INDEX
from .transfer import TopKSender, gpu_identity, handshake, receive_topk

LM_HEAD_ROW_MULTIPLE = 64  # lm_head rows padded like real models'; kd vocab_size keeps the real count


def pick_device(config: Config) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def build_model(path: Optional[str], hidden: int, layers: int, config: Config, vocab: int, seed: int):
    """A Hugging Face causal LM from a local path, or a small Llama built from a config."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation=config.attention)
    torch.manual_seed(seed)
    padded = -(-vocab // LM_HEAD_ROW_MULTIPLE) * LM_HEAD_ROW_MULTIPLE
    model_config = LlamaConfig(vocab_size=padded, hidden_size=hidden, intermediate_size=2 * hidden,
                               num_hidden_layers=layers, num_attention_heads=config.heads,
                               num_key_value_heads=config.heads, max_position_embeddings=config.row_tokens,
                               tie_word_embeddings=False, attn_implementation=config.attention)
    return LlamaForCausalLM(model_config)


def final_hidden_states(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[B·T, H]`` last hidden states (rows in (batch, position) order), no logits."""
    hidden = model.model(input_ids=tokens).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def lm_head_inputs(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, lm_head weight) in the dtype the lm_head matmul runs in: bfloat16 on GPUs, as
    autocast would run the model's own Linear (the final norm hands over float32, and a float32
    matmul of the lm_head costs more than the rest of a small student), the hidden dtype on
    CPU. The casts are differentiable."""
    weight = model.get_output_embeddings().weight
    dtype = torch.bfloat16 if hidden.is_cuda else hidden.dtype
    return hidden.to(dtype), weight.to(dtype)


@dataclass(frozen=True)
class World:
    """This worker's place in the torch.distributed process group, if it joins one: students
    are ranks 0..S-1; with NCCL transfer the teachers join as ranks S..S+T-1."""
    rank: int
    size: int
    port: int
    students: int
    backend: str


def join_world(world: Optional[World]):
    """Joins the process group; returns the students' group for gradient sums (or None)."""
    if world is None:
        return None
    import torch.distributed as dist

    dist.init_process_group(world.backend, init_method=f"tcp://127.0.0.1:{world.port}", rank=world.rank,
                            world_size=world.size)
    if world.size == world.students:
        return dist.group.WORLD
    return dist.new_group(list(range(world.students)))  # every rank calls it, teachers too


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)


class _TrainingRows:
    """The training rows, sent to each worker once: a step's calls then carry row indices, not
    tokens (a 128 KB tensor argument costs a Ray call several ms of serialization)."""

    rows: torch.Tensor  # [R, T] int64 tokens
    labels: torch.Tensor  # [R, T] int64 shifted labels

    def set_rows(self, rows: torch.Tensor, labels: torch.Tensor) -> None:
        self.rows, self.labels = rows, labels

    def micro_batch(self, pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) ``[B, T]`` of the training rows ``pick`` ``[B]``."""
        return self.rows[pick], self.labels[pick]


class TeacherWorker(_TrainingRows):
    """Frozen teacher (eval, no grad). Builds and pretrains itself when no path is given."""

    def __init__(self, config: Config, vocab: int, transfer: str = "object_store", world: Optional[World] = None):
        self.config, self.vocab = config, vocab
        self.device = pick_device(config)
        join_world(world)
        self.sender = TopKSender(transfer)
        self.model = build_model(config.teacher_path, config.teacher_hidden, config.teacher_layers, config, vocab,
                                 config.seed).to(self.device)

    def gpu(self):
        return gpu_identity()

    def pretrain(self) -> float:
        """CE steps on the training rows (`set_rows`) when the teacher was built, not loaded; last loss."""
        if self.config.teacher_path or self.config.teacher_pretrain_steps == 0:
            return float("nan")
        lr = self.config.lr if self.config.teacher_lr is None else self.config.teacher_lr
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=self.device.type == "cuda")
        # warm-up, then constant: the 768 x 8 GPU teacher at 3e-3 from step 0 ended worse than the
        # students it was to teach (held-out CE 5.41 against their 4.7); it now warms up and uses 1e-3
        warmup = max(1, self.config.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        generator = torch.Generator().manual_seed(self.config.seed + 17)
        loss = torch.zeros(())
        self.model.train()
        for _ in range(self.config.teacher_pretrain_steps):
            batch_rows = self.config.rows_per_micro_batch * self.config.micro_batches  # a student step's rows
            pick = torch.randint(0, self.rows.shape[0], (batch_rows,), generator=generator)
            tokens, targets = (part.to(self.device) for part in self.micro_batch(pick))
            with _autocast(self.device):
                logits = self.model(input_ids=tokens).logits[..., :self.vocab]
            loss = F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            optimizer.step()
            scheduler.step()
        if self.config.teacher_offload:
            self.model.to("cpu")
        return loss.item()

    def state_dict(self) -> dict:
        return {name: tensor.cpu() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, step: int = 0, student_rank: int = 0):
        """tokens ``[B, T]`` → (the transfer message of the packed bf16 top-k for the student
        of rank ``student_rank``, seconds spent). With ``teacher_offload`` the weights come
        from the CPU for the call and go back after it."""
        start = time.perf_counter()
        if self.config.teacher_offload:
            self.model.to(self.device)
        self.model.eval()
        tokens = tokens.to(self.device)
        with _autocast(self.device):
            hidden = final_hidden_states(self.model, tokens)
        topk = kd.teacher_topk(*lm_head_inputs(self.model, hidden), k=self.config.k,
                               temperature=self.config.temperature, vocab_size=self.vocab)
        message = self.sender.send(topk, step, student_rank)
        if self.config.teacher_offload:
            self.model.to("cpu")
        return message, time.perf_counter() - start

    def score_rows(self, pick: torch.Tensor, step: int = 0, student_rank: int = 0):
        """`score` of the training rows ``pick`` ``[B]`` int64."""
        return self.score(self.micro_batch(pick)[0], step, student_rank)

    def connect(self, student_ranks: list) -> None:
        """Creates the NCCL pair communicators with these students (before any scoring)."""
        handshake(student_ranks, self.device, sending=True)

    def release(self, step: int) -> None:
        """The students are done with the buffers of ``step``: free them."""
        self.sender.release(step)

    @torch.no_grad()
    def held_out_ce(self, rows: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.to(self.device)  # offloaded teachers come back for it
        return _held_out_ce(self.model, rows, labels, self.vocab, self.device)


@torch.no_grad()
def _held_out_ce(model, rows, labels, vocab, device) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, rows.shape[0], 8):
        tokens, targets = rows[start:start + 8].to(device), labels[start:start + 8].to(device)
        logits = model(input_ids=tokens).logits[..., :vocab].float()
        mask = targets != IGNORE_INDEX
        total += F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                 reduction="sum").item()
        count += mask.sum().item()
    return total / max(count, 1)


def _schedule(warmup_steps: int, total_steps: int):
    """LR factor of a step: linear warm-up, then cosine decay to 10 % at ``total_steps``."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


class StudentWorker(_TrainingRows):
    """Trains the student with kd.topk_divergence on its final hidden states (AdamW, clip,
    warm-up + cosine LR, bf16 autocast on GPU); saves and restores exact checkpoints."""

    def __init__(self, config: Config, vocab: int, rank: int = 0, world_size: int = 1, world: Optional[World] = None):
        self.config, self.vocab, self.rank, self.world_size = config, vocab, rank, world_size
        self.device = pick_device(config)
        self.gradient_group = join_world(world)
        self.model = build_model(config.student_path, config.student_hidden, config.student_layers, config, vocab,
                                 config.seed + 1).to(self.device)
        # one fused kernel for the whole update on GPUs (the per-tensor loop is launch-bound there)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           _schedule(config.warmup_steps, config.steps))
        self._values_checked = False
        torch.manual_seed(config.seed + 2)
        random.seed(config.seed + 2)

    def train_step(self, step: int, micro_batches: list, topk_refs: list, num_tokens: int) -> dict:
        """One optimizer step over this rank's micro-batches ``[(tokens, labels)]`` with the
        teacher's packed top-k (object refs, resolved here). The loss is normalized by the
        step's global token count ``num_tokens`` and gradients are summed over the ranks, so
        any split of the micro-batches gives the same update. Returns this rank's sums."""
        import os

        import ray

        if self.config.fail_student_at_step == step:
            os._exit(1)  # fault injection (tests): the process dies as a crashed worker would

        start = time.perf_counter()
        received = ray.get(topk_refs)  # waits for the teacher when it has not finished yet
        wait_seconds = time.perf_counter() - start
        teachers = [receive_topk(message, self.device) for message, _ in received]
        teacher_seconds = [seconds for _, seconds in received]
        transfer_seconds = time.perf_counter() - start - wait_seconds
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        names = ("loss", "kd_sum", "ce_sum", "teacher_mass_sum", "rows")
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)  # read once: one host sync a step
        for (tokens, labels), teacher in zip(micro_batches, teachers):
            tokens, labels = tokens.to(self.device), labels.to(self.device).reshape(-1)
            with _autocast(self.device):
                hidden = final_hidden_states(self.model, tokens)
            loss, metrics = kd.topk_divergence(
                *lm_head_inputs(self.model, hidden), teacher, labels, divergence=self.config.divergence,
                support=self.config.support, temperature=self.config.temperature, kd_weight=self.config.kd_weight,
                ce_weight=self.config.ce_weight, num_tokens=max(num_tokens, 1), vocab_size=self.vocab,
                return_metrics=True, check_values=not self._values_checked)
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

    def train_step_rows(self, step: int, picks: list, topk_refs: list, num_tokens: int) -> dict:
        """`train_step` on the training rows ``picks`` (one ``[B]`` int64 tensor per micro-batch)."""
        return self.train_step(step, [self.micro_batch(pick) for pick in picks], topk_refs, num_tokens)

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

    def save(self, path: str, step: int) -> str:
        torch.save(dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
                        scheduler=self.scheduler.state_dict(), step=step, torch_rng=torch.get_rng_state(),
                        python_rng=random.getstate()), path)
        return path

    def load(self, path: str) -> int:
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        return state["step"]

    def gpu(self):
        return gpu_identity()

    def connect(self, teacher_ranks: list) -> None:
        """Creates the NCCL pair communicators with these teachers (before any training)."""
        handshake(teacher_ranks, self.device, sending=False)

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().float().cpu().reshape(-1) for p in self.model.parameters()])

    @torch.no_grad()
    def held_out_ce(self, rows: torch.Tensor, labels: torch.Tensor) -> float:
        return _held_out_ce(self.model, rows, labels, self.vocab, self.device)
