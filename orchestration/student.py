"""The student worker: trains a causal LM with kd_kernels.topk_divergence on its final
hidden states and the teacher's top-k (AdamW without decay on norms and biases, clip,
warm-up + cosine LR). ``student_strategy``: "replica" (the whole model on every rank, bf16
autocast on GPU, gradients summed in one all-reduce) or "fsdp2" (`fsdp.parallelize_student`:
sharded over the student ranks, bf16 compute with float32 master weights on GPU, the fused
loss inside the root unit's forward). Its training state saves and restores exactly: one file
for replicas, a sharded ``torch.distributed.checkpoint`` directory under FSDP2."""
from __future__ import annotations

import math
import os
import random
import time
from typing import Optional

import torch

import kd_kernels as kd

from . import checkpoint, fsdp
from .compilation import compile_decoder_layers, compiles, static_shapes
from .distillation import DistillationStudent
from .hf_models import final_hidden_states
from .models import autocast, build_model, held_out_sums, lm_head_inputs, pick_device
from .process_group import World, join_world
from .transfer import transfer_for
from .weight_source import WeightSource
from .workers import Worker, layout_of

STATE_FILE = "student.pt"
SHARDS_DIR = "student_shards"  # the FSDP2 student's torch.distributed.checkpoint directory


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
        self.sharded = config.student_strategy == "fsdp2"
        model = build_model(config.student_path, config.student_hidden, config.student_layers, config, vocab,
                            config.seed + 1).to(self.device)
        compute_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.student = DistillationStudent(model, vocab_size=vocab, compute_dtype=compute_dtype, **self.loss_options)
        fsdp.parallelize_student(self.student, strategy="fsdp" if self.sharded else "replicate",
                                 group=self.gradient_group, compute_dtype=compute_dtype,
                                 activation_checkpointing=config.activation_checkpointing)
        self.model = self.student.causal_lm
        # after fully_shard and activation checkpointing (docs/DECISIONS.md)
        if compiles(config, self.device, self.model):
            compile_decoder_layers(self.model, static=static_shapes(config.mode))
        self.optimizer = fsdp.build_optimizer(self.student, lr=config.lr, weight_decay=config.weight_decay,
                                              betas=(config.adam_beta1, config.adam_beta2))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config.warmup_steps, config.steps))
        self._values_checked = False
        torch.manual_seed(config.seed + 2)
        random.seed(config.seed + 2)

    def _layout(self, pick: torch.Tensor):
        return self.row_layout(pick, self.device, self.config.attention)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, teacher: kd.TopK, num_tokens: int,
             rows: Optional[torch.Tensor] = None, ce_weight: Optional[float] = None,
             position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None):
        """(loss, metrics) of kd.topk_divergence for one micro-batch: tokens ``[B, T]``,
        shifted labels ``[B·T]``, the teacher's top-k of its ``B·T`` rows, and for packed rows
        their position ids and block-diagonal mask; the loss is a sum divided by
        ``num_tokens`` (the step's global count). ``rows`` ``[R]`` (flat indices into ``B·T``):
        only those rows are trained, ``labels`` and the top-k are then ``[R]`` (a response's
        rows). ``ce_weight``: the CE weight of this step (None: the option's)."""
        if self.sharded:  # the loss runs in the root unit's forward: FSDP2 gathers the lm_head around it
            return self.student(tokens, labels, teacher, num_tokens=max(num_tokens, 1), position_ids=position_ids,
                                attention_mask=attention_mask, rows=rows, ce_weight=ce_weight,
                                check_values=not self._values_checked)
        with autocast(self.device):
            hidden = final_hidden_states(self.model, tokens, position_ids=position_ids,
                                         attention_mask=attention_mask)
            hidden = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            hidden = hidden[rows]
        options = self.loss_options if ce_weight is None else dict(self.loss_options, ce_weight=ce_weight)
        return kd.topk_divergence(*lm_head_inputs(self.model, hidden), teacher, labels, **options,
                                  num_tokens=max(num_tokens, 1), vocab_size=self.vocab, return_metrics=True,
                                  check_values=not self._values_checked)

    def train_step(self, step: int, micro_batches: list, topk_refs: list, num_tokens: int,
                   ce_weight: Optional[float] = None) -> dict:
        """One optimizer step over this rank's micro-batches ``[(tokens, labels[, rows[,
        position_ids, attention_mask]])]`` (`loss`; ``ce_weight`` likewise) with the
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
        for (tokens, labels, *extra), teacher in zip(micro_batches, teachers):
            rows, *layout = extra if extra else (None,)  # (rows[, position_ids, attention_mask])
            loss, metrics = self.loss(tokens.to(self.device), labels.to(self.device).reshape(-1), teacher, num_tokens,
                                      None if rows is None else rows.to(self.device), ce_weight, *layout)
            loss.backward()
            sums += torch.stack([loss.detach().double()] + [metrics[name].double() for name in names[1:]])
        # our own teacher and data pipeline made them: their ids and labels are checked on the first step only
        self._values_checked = True
        fsdp.synchronize_gradients(self.student, self.gradient_group)
        grad_norm = fsdp.clip_gradients(self.student, self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        *values, grad_norm = torch.cat([sums, grad_norm.to(sums.device, torch.float64).reshape(1)]).tolist()
        totals = dict(zip(names, values), teacher_seconds=sum(teacher_seconds))
        worker_seconds = time.perf_counter() - start
        return dict(totals, wait_seconds=wait_seconds, transfer_seconds=transfer_seconds,
                    student_seconds=worker_seconds - wait_seconds - transfer_seconds, worker_seconds=worker_seconds,
                    lr=self.scheduler.get_last_lr()[0], grad_norm=grad_norm, memory=self.memory())

    def train_step_rows(self, step: int, picks: list, topk_refs: list, num_tokens: int,
                        ce_weight: Optional[float] = None) -> dict:
        """`train_step` on the training rows ``picks`` (one ``[B]`` int64 tensor per micro-batch)."""
        return self.train_step(step, [(*self.micro_batch(pick), None, *self._layout(pick)) for pick in picks],
                               topk_refs, num_tokens, ce_weight)

    def training_state(self, step: int) -> dict:
        """Everything an exact resume after ``step`` needs: model, optimizer and `loop_state`."""
        return dict(model=self.model.state_dict(), optimizer=self.optimizer.state_dict(), **self.loop_state(step))

    def loop_state(self, step: int) -> dict:
        """The scheduler, the step and the RNG states (torch, CUDA, Python) of this process."""
        state = dict(scheduler=self.scheduler.state_dict(), step=step, torch_rng=torch.get_rng_state(),
                     python_rng=random.getstate())
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, directory: str, step: int, metadata: dict) -> str:
        """Writes the checkpoint of ``step`` atomically (`checkpoint.write`) with the driver's
        ``metadata`` (its data order, the run segment) in the manifest. Replicas: rank 0 alone
        is called. FSDP2: every rank is called and writes its shards into the staging
        directory, which rank 0 publishes once all are written."""
        if not self.sharded:
            state = self.training_state(step)
            return checkpoint.write(directory, step, {STATE_FILE: lambda path: torch.save(state, path)}, metadata)
        import torch.distributed as dist

        if self.rank == 0:
            checkpoint.begin(directory)
        dist.barrier(group=self.gradient_group)
        # collective: on return every rank's shards are written
        fsdp.save_checkpoint(os.path.join(checkpoint.staging_of(directory), SHARDS_DIR), self.student,
                             self.optimizer, extra=self.loop_state(step), group=self.gradient_group)
        if self.rank == 0:
            checkpoint.commit(directory, step, metadata)
        return directory

    def load(self, directory: str) -> tuple[int, dict]:
        """Restores a checkpoint written by `save`; (its step, the driver's metadata)."""
        if self.sharded:
            state = fsdp.load_checkpoint(os.path.join(directory, SHARDS_DIR), self.student, self.optimizer,
                                         group=self.gradient_group)
        else:
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
        """Every parameter, whole (gathered from the shards under FSDP2: every rank calls it), flat, float32, CPU."""
        parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.model.parameters()]
        return torch.cat([p.detach().float().cpu().reshape(-1) for p in parts])

    def held_out_sums(self, chunk: tuple) -> tuple[float, int]:
        """(summed CE, tokens) on a held-out chunk (see `models.held_out_sums`); replicas only."""
        return held_out_sums(self.model, chunk, self.vocab, self.device, self.config.attention)

    def evaluate(self, chunks: list, topk_refs: list) -> dict:
        """`metrics.held_out_losses` over held-out ``chunks`` (object refs of ``(tokens, labels,
        positions or None, documents or None)``) and the teacher's top-k of each (object refs
        of CPU `kd.TopK`): every rank evaluates its share of the chunks (as many each), sums over the
        student ranks. Every student rank is called."""
        import ray

        from .metrics import held_out_losses
        from .packing import PackedBatch

        share = -(-len(chunks) // self.world_size)
        mine = list(range(self.rank * share, min((self.rank + 1) * share, len(chunks))))
        batches, masks, teachers = [], [], []
        for index in mine + [mine[-1] if mine else 0] * (share - len(mine)):  # equal forward counts under FSDP2
            tokens, labels, positions, documents = ray.get(chunks[index])
            positions, mask = layout_of(positions, documents, self.device, self.config.attention)
            batches.append(PackedBatch(tokens.to(self.device), labels.to(self.device), positions, None))
            masks.append(mask)
            top = ray.get(topk_refs[index])
            teachers.append(kd.TopK(top.logprobs.to(self.device), top.indices.to(self.device),
                                    None if top.lse is None else top.lse.to(self.device), top.temperature))
        counted = [1.0] * len(mine) + [0.0] * (share - len(mine))  # repeated chunks only keep FSDP2 in step
        with autocast(self.device):
            sums = [held_out_losses(self.student, [batch], [teacher], attention_masks=[mask])
                    for batch, teacher, mask in zip(batches, teachers, masks)]
        totals = torch.tensor([[s["held_out_ce"] * s["held_out_tokens"], s["held_out_kd"] * s["held_out_tokens"],
                                s["held_out_tokens"]] for s in sums], dtype=torch.float64).reshape(-1, 3)
        totals = (totals * torch.tensor(counted, dtype=torch.float64).unsqueeze(1)).sum(0)
        if self.gradient_group is not None:
            import torch.distributed as dist

            reduced = totals.to(self.device)
            dist.all_reduce(reduced, group=self.gradient_group)
            totals = reduced.cpu()
        ce, kd_sum, tokens = totals.tolist()
        return {"held_out_ce": ce / max(tokens, 1), "held_out_kd": kd_sum / max(tokens, 1),
                "held_out_tokens": int(tokens)}

    def export(self, directory: str) -> Optional[str]:
        """Writes the whole student with ``save_pretrained`` into ``directory`` (rank 0; every
        rank is called under FSDP2, whose gather is collective); the directory or None."""
        state = fsdp.full_model_state_dict(self.student) if self.sharded else self.model.state_dict()
        if self.rank != 0:
            return None
        from .hf_models import export_causal_lm

        return export_causal_lm(self.model, {name: tensor.cpu() for name, tensor in state.items()}, directory)

