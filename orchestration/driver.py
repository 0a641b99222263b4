"""The driver loop: data, a teacher worker and a student worker as Ray actors, teacher top-k
through the object store, overlap of teacher scoring with student training, metrics,
checkpoints, resume, and a clear stop when a worker dies."""
from __future__ import annotations

import glob
import json
import os
import time

import torch

from .config import Config
from .data import encode, pack, read_documents, stdlib_corpus, train_tokenizer


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


def latest_checkpoint(output_dir: str):
    paths = sorted(glob.glob(os.path.join(output_dir, "checkpoints", "step_*.pt")))
    return paths[-1] if paths else None


def run(config: Config, progress: bool = True) -> dict:
    import ray

    from .workers import StudentWorker, TeacherWorker

    os.makedirs(os.path.join(config.output_dir, "checkpoints"), exist_ok=True)
    if config.transfer == "cuda_ipc":
        raise NotImplementedError("transfer: cuda_ipc is not built yet; use object_store (or auto)")
    train_tokens, train_labels, held_tokens, held_labels, vocab = prepare_data(config)
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    teacher = ray.remote(TeacherWorker).options(max_restarts=0).remote(config, vocab)
    student = ray.remote(StudentWorker).options(max_restarts=0).remote(config, vocab)
    names = {id(teacher): "teacher-0", id(student): "student-0"}
    checkpoint = latest_checkpoint(config.output_dir) if config.resume else None

    def call(worker, ref, step):
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as error:
            raise WorkerDied(f"worker {names[id(worker)]} died at step {step}; last good checkpoint: "
                             f"{latest_checkpoint(config.output_dir) or 'none'} ({error.__class__.__name__})") from None

    teacher_pretrain_loss = call(teacher, teacher.pretrain.remote(train_tokens, train_labels), -1)
    start_step = 0
    if checkpoint:
        start_step = call(student, student.load.remote(checkpoint), -1) + 1

    def batches(step):
        return [(train_tokens[pick], train_labels[pick]) for pick in step_batches(config, step, len(train_tokens))]

    def submit(step):
        return [teacher.score.remote(tokens) for tokens, _ in batches(step)]

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
            result = call(student, student.train_step.remote(step, batches(step), refs), step)
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
                call(student, student.save.remote(os.path.join(config.output_dir, "checkpoints",
                                                               f"step_{step:07d}.pt"), step), step)
            if config.stop_after is not None and step >= config.stop_after:
                break
    if bar:
        bar.close()
    final = os.path.join(config.output_dir, "checkpoints", f"step_{last_step:07d}.pt")
    call(student, student.save.remote(final, last_step), last_step)
    summary = dict(
        last_step=last_step, vocab=vocab, teacher_pretrain_loss=teacher_pretrain_loss,
        teacher_held_out_ce=call(teacher, teacher.held_out_ce.remote(held_tokens, held_labels), last_step),
        student_held_out_ce=call(student, student.held_out_ce.remote(held_tokens, held_labels), last_step),
        metrics=metrics_path, checkpoint=final, student=student, teacher=teacher)
    return summary
