"""The driver loop: data, teacher and student workers as Ray actors placed on the GPUs
(colocated or disaggregated), teacher top-k through CUDA IPC, NCCL or the object store,
overlap of teacher scoring with student training, metrics, checkpoints, resume, and a clear
stop when a worker dies."""
from __future__ import annotations

import glob
import json
import os
import socket
import time
from dataclasses import dataclass

import torch

from .comm_plan import CommPlan
from .config import Config
from .data import IGNORE_INDEX, encode_all, pack, read_documents, stdlib_corpus, train_tokenizer
from .transfer import Layout, resolve_layout


class WorkerDied(RuntimeError):
    """A Ray worker died; the message names it and the last good checkpoint."""


def prepare_data(config: Config):
    """(train tokens, train labels, held-out tokens, held-out labels, vocab) as ``[R, T]`` int64."""
    records = list(read_documents(config.data_path)) if config.data_path else stdlib_corpus(config.max_corpus_bytes)
    tokenizer_dir = os.path.join(config.output_dir, "tokenizer")
    if config.tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    else:
        tokenizer = train_tokenizer(records, config.tokenizer_vocab, tokenizer_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = list(pack(encode_all(records, tokenizer, config.chat_template), config.row_tokens, pad_id))
    tokens = torch.stack([r[0] for r in rows])
    labels = torch.stack([r[1] for r in rows])
    held_out = max(1, len(rows) // 20)
    return tokens[:-held_out], labels[:-held_out], tokens[-held_out:], labels[-held_out:], len(tokenizer)


def step_batches(config: Config, step: int, num_rows: int):
    """The micro-batches' row indices of a step: a function of (seed, step) only, so resuming
    at a step sees exactly the data an uninterrupted run would."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    picks = torch.randint(0, num_rows, (config.micro_batches, config.rows_per_micro_batch), generator=generator)
    return list(picks)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _died(ray, ref) -> bool:
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - not finished or another error: not the dead one
        return False
    return False


def latest_checkpoint(output_dir: str):
    paths = sorted(glob.glob(os.path.join(output_dir, "checkpoints", "step_*.pt")))
    return paths[-1] if paths else None


def run(config: Config, progress: bool = True, return_parameters: bool = False) -> dict:
    """Runs the distillation; returns a summary (held-out CEs, paths, layout; with
    ``return_parameters`` each student's flattened parameters). Its Ray actors are killed
    before it returns, so runs can follow each other in one process."""
    import ray

    from .workers import StudentWorker, TeacherWorker, pick_device

    num_teachers, num_students = config.teacher_workers, config.student_workers
    plan = CommPlan(num_teachers, num_students, config.micro_batches)  # refuse bad layouts first
    device_type = pick_device(config).type
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    layout = resolve_layout(config.placement, config.transfer, device_type, gpus, num_teachers, num_students)
    os.makedirs(os.path.join(config.output_dir, "checkpoints"), exist_ok=True)
    train_tokens, train_labels, held_tokens, held_labels, vocab = prepare_data(config)
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    teacher_worlds, student_worlds = _worlds(layout, num_teachers, num_students, device_type)
    # actors take no CPU slot: the driver decides placement, and more actors than cores must start
    teachers = [ray.remote(TeacherWorker).options(num_cpus=0, num_gpus=layout.gpus_per_teacher, max_restarts=0)
                .remote(config, vocab, layout.transfer, teacher_worlds[t]) for t in range(num_teachers)]
    students = [ray.remote(StudentWorker).options(num_cpus=0, num_gpus=layout.gpus_per_student, max_restarts=0)
                .remote(config, vocab, rank, num_students, student_worlds[rank]) for rank in range(num_students)]
    session = _Session(ray, config, plan, layout, vocab, teachers, students,
                       _Data(train_tokens, train_labels, held_tokens, held_labels))
    try:
        session.prepare_workers(device_type)
        return session.train_loop(progress, return_parameters)
    finally:
        for worker in teachers + students:
            ray.kill(worker, no_restart=True)


@dataclass
class _Data:
    train_tokens: torch.Tensor  # [R, T] int64
    train_labels: torch.Tensor
    held_tokens: torch.Tensor
    held_labels: torch.Tensor


@dataclass
class _Session:
    """One run's workers and what they work on; its methods are the driver loop's parts."""
    ray: object
    config: Config
    plan: CommPlan
    layout: Layout
    vocab: int
    teachers: list
    students: list
    data: _Data
    teacher_pretrain_loss: float = float("nan")

    def call(self, workers: list, refs: list, step: int) -> list:
        """ray.get of one ref per worker, stopping with the name of the first that died."""
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as error:
            dead = next((index for index, ref in enumerate(refs) if _died(self.ray, ref)), 0)
            raise WorkerDied(f"worker {self._name(workers[dead])} died at step {step}; last good checkpoint: "
                             f"{latest_checkpoint(self.config.output_dir) or 'none'} "
                             f"({error.__class__.__name__})") from None

    def _name(self, worker) -> str:
        for kind, workers in (("teacher", self.teachers), ("student", self.students)):
            for index, candidate in enumerate(workers):
                if candidate is worker:
                    return f"{kind}-{index}"
        return "unknown"

    def prepare_workers(self, device_type: str) -> None:
        """Placement check, NCCL pair handshake, teacher pretraining (and copies)."""
        teachers, students = self.teachers, self.students
        if device_type == "cuda":
            _check_placement(self.layout, self.call(teachers, [t.gpu.remote() for t in teachers], -1),
                             self.call(students, [s.gpu.remote() for s in students], -1))
        if self.layout.transfer == "nccl":  # both sides of every pair at once: see orchestration/transfer.py
            pairs = sorted({(self.plan.teacher_of(m), self.plan.student_of(m))
                            for m in range(self.config.micro_batches)})
            first_teacher_rank = len(students)  # teachers follow the students in the process group
            calls = [t.connect.remote([s for tt, s in pairs if tt == index]) for index, t in enumerate(teachers)]
            calls += [s.connect.remote([first_teacher_rank + t for t, ss in pairs if ss == index])
                      for index, s in enumerate(students)]
            self.call(teachers + students, calls, -1)
        rows = self.ray.put(self.data.train_tokens), self.ray.put(self.data.train_labels)
        self.call(teachers + students, [worker.set_rows.remote(*rows) for worker in teachers + students], -1)
        teacher = teachers[0]
        self.teacher_pretrain_loss = self.call([teacher], [teacher.pretrain.remote()], -1)[0]
        if len(teachers) > 1:  # pretrained once, then copied: every teacher worker scores with the same weights
            state = self.ray.put(self.call([teacher], [teacher.state_dict.remote()], -1)[0])
            self.call(teachers[1:], [t.load_state_dict.remote(state) for t in teachers[1:]], -1)

    def submit(self, step: int) -> tuple[list, list]:
        """The step's micro-batches (training row indices, ``[B]`` each), each scored by the
        teacher worker the plan gives it, and the teacher's replies (refs)."""
        picks = step_batches(self.config, step, len(self.data.train_tokens))
        return picks, [self.teachers[self.plan.teacher_of(m)].score_rows.remote(pick, step, self.plan.student_of(m))
                       for m, pick in enumerate(picks)]

    def train(self, step: int, picks: list, refs: list) -> dict:
        """One student step over the micro-batches ``picks`` and the teacher's replies ``refs``
        (both from `submit`); the step's metrics."""
        plan = self.plan
        num_tokens = max(1, sum(int((self.data.train_labels[pick] != IGNORE_INDEX).sum()) for pick in picks))
        calls = [s.train_step_rows.remote(step, [picks[m] for m in plan.micro_batches_of_student(rank)],
                                          [refs[m] for m in plan.micro_batches_of_student(rank)], num_tokens)
                 for rank, s in enumerate(self.students)]
        called = time.perf_counter()
        parts = self.call(self.students, calls, step)
        call_seconds = time.perf_counter() - called
        for worker in self.teachers:
            worker.release.remote(step)  # actor calls run in order: after this step's scoring
        total = {key: sum(part[key] for part in parts) for key in parts[0] if key not in ("lr", "worker_seconds")}
        rows = max(total["rows"], 1)
        return dict(loss=total["loss"], kd=total["kd_sum"] / rows, ce=total["ce_sum"] / rows,
                    teacher_tail_mass=1.0 - total["teacher_mass_sum"] / rows, tokens=num_tokens,
                    teacher_seconds=total["teacher_seconds"], wait_seconds=max(p["wait_seconds"] for p in parts),
                    transfer_seconds=max(p["transfer_seconds"] for p in parts),
                    student_seconds=max(p["student_seconds"] for p in parts),
                    dispatch_seconds=call_seconds - max(p["worker_seconds"] for p in parts), lr=parts[0]["lr"])

    def save(self, step: int) -> str:
        path = os.path.join(self.config.output_dir, "checkpoints", f"step_{step:07d}.pt")
        student = self.students[0]
        self.call([student], [student.save.remote(path, step)], step)  # ranks hold identical state
        return path

    def train_loop(self, progress: bool, return_parameters: bool) -> dict:
        """Steps with the teacher one step ahead (``overlap``), metrics, checkpoints; the summary."""
        config = self.config
        start_step = 0
        checkpoint = latest_checkpoint(config.output_dir) if config.resume else None
        if checkpoint:
            start_step = self.call(self.students, [s.load.remote(checkpoint) for s in self.students], -1)[0] + 1
        metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=config.steps, initial=start_step, desc="distill", unit="step")
        last_step = start_step - 1
        with open(metrics_path, "a" if config.resume else "w") as metrics_file:
            pending = self.submit(start_step) if start_step < config.steps else None
            for step in range(start_step, config.steps):
                started = time.perf_counter()
                submitted, pending = pending, None
                if config.overlap and step + 1 < config.steps:
                    pending = self.submit(step + 1)  # the teacher scores the next step while the student trains
                result = self.train(step, *submitted)
                if pending is None and step + 1 < config.steps:
                    pending = self.submit(step + 1)
                step_seconds = time.perf_counter() - started
                result.update(step=step, step_seconds=step_seconds, tokens_per_s=result["tokens"] / step_seconds)
                metrics_file.write(json.dumps(result) + "\n")
                metrics_file.flush()
                last_step = step
                if bar:
                    bar.update(1)
                    bar.set_postfix(loss=f"{result['loss']:.3f}", kd=f"{result['kd']:.3f}", ce=f"{result['ce']:.3f}")
                if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                    self.save(step)
                if config.stop_after is not None and step >= config.stop_after:
                    break
        if bar:
            bar.close()
        return self.summary(last_step, metrics_path, return_parameters)

    def summary(self, last_step: int, metrics_path: str, return_parameters: bool) -> dict:
        teacher, student, data = self.teachers[0], self.students[0], self.data
        checkpoint = self.save(last_step)
        held_out = (data.held_tokens, data.held_labels)
        summary = dict(
            last_step=last_step, vocab=self.vocab, teacher_pretrain_loss=self.teacher_pretrain_loss,
            teacher_held_out_ce=self.call([teacher], [teacher.held_out_ce.remote(*held_out)], last_step)[0],
            student_held_out_ce=self.call([student], [student.held_out_ce.remote(*held_out)], last_step)[0],
            train_rows=len(data.train_tokens), held_out_rows=len(data.held_tokens),
            metrics=metrics_path, checkpoint=checkpoint, placement=self.layout.placement,
            transfer=self.layout.transfer)
        if return_parameters:
            summary["student_parameters"] = self.call(self.students,
                                                      [s.parameters_vector.remote() for s in self.students], last_step)
        return summary


def _worlds(layout: Layout, num_teachers: int, num_students: int, device_type: str):
    """Each worker's `World` (or None): with NCCL transfer, teachers and students share one
    process group; otherwise students form their own when there are several."""
    from .workers import World

    port = _free_port()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if layout.transfer == "nccl":
        size = num_students + num_teachers
        return ([World(num_students + t, size, port, num_students, backend) for t in range(num_teachers)],
                [World(r, size, port, num_students, backend) for r in range(num_students)])
    students = [World(r, num_students, port, num_students, backend) if num_students > 1 else None
                for r in range(num_students)]
    return [None] * num_teachers, students


def _check_placement(layout: Layout, teacher_gpus: list, student_gpus: list) -> None:
    """Colocated pairs must share a GPU (CUDA IPC maps its memory); disaggregated workers must not."""
    if layout.placement == "colocated":
        if teacher_gpus != student_gpus:
            raise RuntimeError(f"placement colocated: Ray put teacher and student workers on different GPUs "
                               f"(teachers {teacher_gpus}, students {student_gpus})")
    elif len(set(teacher_gpus + student_gpus)) != len(teacher_gpus) + len(student_gpus):
        raise RuntimeError(f"placement disaggregated: workers share GPUs (teachers {teacher_gpus}, students "
                           f"{student_gpus})")
