"""The driver loop: data, a teacher worker and a student worker as Ray actors, teacher top-k
through the object store, overlap of teacher scoring with student training, metrics,
checkpoints, resume, and a clear stop when a worker dies."""
from __future__ import annotations

import glob
import json
import os
import socket
import time

import torch

from .comm_plan import CommPlan
from .config import Config
from .data import IGNORE_INDEX, encode, pack, read_documents, stdlib_corpus, train_tokenizer


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
    rows = list(pack((encode(r, tokenizer, config.chat_template) for r in records), config.row_tokens, pad_id))
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


def run(config: Config, progress: bool = True) -> dict:
    import ray

    from .workers import StudentWorker, TeacherWorker

    plan = CommPlan(config.teacher_workers, config.student_workers, config.micro_batches)  # refuse bad layouts first
    os.makedirs(os.path.join(config.output_dir, "checkpoints"), exist_ok=True)
    if config.transfer == "cuda_ipc":
        raise NotImplementedError("transfer: cuda_ipc is not built yet; use object_store (or auto)")
    train_tokens, train_labels, held_tokens, held_labels, vocab = prepare_data(config)
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    # actors take no CPU slot: the driver decides placement, and more actors than cores must start
    teachers = [ray.remote(TeacherWorker).options(num_cpus=0, max_restarts=0).remote(config, vocab)
                for _ in range(config.teacher_workers)]
    port = _free_port()
    students = [ray.remote(StudentWorker).options(num_cpus=0, max_restarts=0).remote(
        config, vocab, rank, config.student_workers, port) for rank in range(config.student_workers)]
    names = {id(w): f"teacher-{i}" for i, w in enumerate(teachers)}
    names.update({id(w): f"student-{i}" for i, w in enumerate(students)})
    teacher, student = teachers[0], students[0]
    checkpoint = latest_checkpoint(config.output_dir) if config.resume else None

    def call(workers, refs, step):
        """ray.get of one ref per worker, stopping with the name of the first that died."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as error:
            dead = next((w for w, r in zip(workers, refs) if _died(ray, r)), workers[0])
            raise WorkerDied(f"worker {names[id(dead)]} died at step {step}; last good checkpoint: "
                             f"{latest_checkpoint(config.output_dir) or 'none'} ({error.__class__.__name__})") from None

    teacher_pretrain_loss = call([teacher], [teacher.pretrain.remote(train_tokens, train_labels)], -1)[0]
    if len(teachers) > 1:  # pretrained once, then copied: every teacher worker scores with the same weights
        state = ray.put(call([teacher], [teacher.state_dict.remote()], -1)[0])
        call(teachers[1:], [t.load_state_dict.remote(state) for t in teachers[1:]], -1)
    start_step = 0
    if checkpoint:
        start_step = call(students, [s.load.remote(checkpoint) for s in students], -1)[0] + 1

    def batches(step):
        return [(train_tokens[pick], train_labels[pick]) for pick in step_batches(config, step, len(train_tokens))]

    def submit(step):
        """Each micro-batch scored by the teacher worker the plan gives it."""
        return [teachers[plan.teacher_of(m)].score.remote(tokens) for m, (tokens, _) in enumerate(batches(step))]

    def train(step, refs):
        micro = batches(step)
        num_tokens = max(1, sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro))
        calls = [s.train_step.remote(step, [micro[m] for m in plan.micro_batches_of_student(rank)],
                                     [refs[m] for m in plan.micro_batches_of_student(rank)], num_tokens)
                 for rank, s in enumerate(students)]
        parts = call(students, calls, step)
        total = {key: sum(part[key] for part in parts) for key in parts[0] if key != "lr"}
        rows = max(total["rows"], 1)
        return dict(loss=total["loss"], kd=total["kd_sum"] / rows, ce=total["ce_sum"] / rows,
                    teacher_tail_mass=1.0 - total["teacher_mass_sum"] / rows, tokens=num_tokens,
                    teacher_seconds=total["teacher_seconds"], transfer_seconds=max(p["transfer_seconds"] for p in parts),
                    student_seconds=max(p["student_seconds"] for p in parts), lr=parts[0]["lr"])

    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start_step, desc="distill", unit="step")
    last_step = start_step - 1
    with open(metrics_path, "a" if config.resume else "w") as metrics_file:
        pending = submit(start_step) if start_step < config.steps else None
        for step in range(start_step, config.steps):
            started = time.perf_counter()
            refs, pending = pending, None
            if config.overlap and step + 1 < config.steps:
                pending = submit(step + 1)  # the teacher scores the next step while the student trains
            result = train(step, refs)
            if pending is None and step + 1 < config.steps:
                pending = submit(step + 1)
            result.update(step=step, tokens_per_s=result["tokens"] / (time.perf_counter() - started))
            metrics_file.write(json.dumps(result) + "\n")
            metrics_file.flush()
            last_step = step
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{result['loss']:.3f}", kd=f"{result['kd']:.3f}", ce=f"{result['ce']:.3f}")
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                path = os.path.join(config.output_dir, "checkpoints", f"step_{step:07d}.pt")
                call([student], [student.save.remote(path, step)], step)  # ranks hold identical state
            if config.stop_after is not None and step >= config.stop_after:
                break
    if bar:
        bar.close()
    final = os.path.join(config.output_dir, "checkpoints", f"step_{last_step:07d}.pt")
    call([student], [student.save.remote(final, last_step)], last_step)
    summary = dict(
        last_step=last_step, vocab=vocab, teacher_pretrain_loss=teacher_pretrain_loss,
        teacher_held_out_ce=call([teacher], [teacher.held_out_ce.remote(held_tokens, held_labels)], last_step)[0],
        student_held_out_ce=call([student], [student.held_out_ce.remote(held_tokens, held_labels)], last_step)[0],
        metrics=metrics_path, checkpoint=final, student=student, teacher=teacher, students=students)
    return summary
