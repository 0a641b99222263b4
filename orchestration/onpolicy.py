"""The on-policy / GKD driver loop (``mode`` on_policy or gkd): rollout workers generate the
student's responses to prompts, the teacher scores those response tokens, the student trains on
them with the fused loss; the student's weights go to the rollout workers before a generation
that needs them.

Each step follows `gkd.GkdSchedule.plan`: an on-policy step trains on its share of its round's
samples (teacher top-k of the response rows only, at the driver's ``k`` and ``temperature``,
under the record's teacher prompt for OPSD; no CE term); a dataset step is exactly an
off-policy step of the driver (`driver._Session.submit` / ``train``) with CE weight
``sft_alpha``, so ``lmbda`` 0 trains as ``mode=off_policy`` does when ``sft_alpha`` equals
``ce_weight``.

Weight versions: ``weight_version`` = the number of optimizer steps in the weights (student and
rollouts start equal, at 0). Before a generation, the rollouts are synced to the student when
they hold an older version (`sync_and_generate`): rollouts on student-0's GPU (or, on CPU,
node) share their parameter buffer once and student-0 pushes into it (lock, copy, publish the
version); others pause -> flush -> take the broadcast -> continue; the generation is sent after
the update returned. ``max_staleness`` 0
generates round r after its previous step trained; 1 generates round r + 1 (with the weights at
the start of round r) while round r trains. A checkpoint keeps the samples of the current and
the pending round, so a resumed run trains on the samples an uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

import kd_kernels as kd

from . import checkpoint
from .chat_data import (ChatEncoder, PromptSource, align_response, parse_record, read_chat_records,
                        stdlib_function_records)
from .driver import _Session, _StopOnInterrupt
from .errors import UsageError
from .gkd import GkdSchedule
from .metrics_log import MetricsLog
from .process_group import free_port
from .rollout import SamplingParams

WEIGHT_GROUP = "kd-weights"
PUSHED = ("cuda_ipc", "shared_memory")  # the transports where student-0 pushes into the rollouts' shared buffers
_SAMPLING_STREAM = 3  # the rollouts' sampling seeds, distinct from other (seed, step) streams
EVAL_ROUND = -1  # the round index of the final evaluation's samples
EVAL_LOG_PROB_BYTES = 512 * 2**20  # a side's float64 [rows, V] log-probs the final evaluation holds at once


@dataclass(frozen=True)
class Sample:
    """One generated response: the prompt record's index, the response ids (up to and including
    its stop token), and the weight version that generated it."""
    record: int
    response: tuple[int, ...]
    weight_version: int


def sampling_seed(seed: int, round_index: int, rank: int) -> int:
    """The sampling seed of rollout worker ``rank`` in round ``round_index``."""
    return int(np.random.SeedSequence([seed, _SAMPLING_STREAM, round_index + 1, rank]).generate_state(1)[0])


def padded(sequences: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    """``[B, max length]`` int64, each sequence left-aligned and right-padded with ``pad_id``
    (a causal model's predictions at the real positions do not see the padding)."""
    width = max(len(sequence) for sequence in sequences)
    out = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, :len(sequence)] = sequence
    return out


def load_records(prompts_path: Optional[str]) -> list:
    """The prompt records: ``prompts_path`` (`chat_data.read_chat_records`) or the standard
    library's functions."""
    if prompts_path:
        return read_chat_records(prompts_path)
    return [parse_record(record, f"stdlib function {index}") for index, record in enumerate(stdlib_function_records())]


def reverse_kl_sums(student: torch.Tensor, teacher: torch.Tensor, k: int) -> tuple[float, float]:
    """Summed over the rows of ``[R, V]`` log-probabilities (temperature 1): KL(student ‖ teacher)
    over the whole vocab, Σ q (log q − log p); and over the k + 1 bins of the teacher's top-k and
    its tail (`kd.topk_divergence` with ``support="tail"``), in float64."""
    student, teacher = student.double(), teacher.double()
    whole = (student.exp() * (student - teacher)).sum()
    binned = kd.topk_divergence_from_logits(student, kd.teacher_topk_from_logits(teacher, k=k), None,
                                            divergence="reverse_kl", support="tail", reduction="sum")
    return float(whole), float(binned)


@dataclass
class ResponseBatch:
    """A micro-batch of responses, student and teacher side: tokens ``[B, T]`` (prompt +
    response), the flat rows predicting each response token ``[R]``, the labels ``[R]``."""
    student_tokens: torch.Tensor
    student_rows: torch.Tensor
    teacher_tokens: torch.Tensor
    teacher_rows: torch.Tensor
    labels: torch.Tensor


@dataclass
class OnPolicySession(_Session):
    """`driver._Session` with rollout workers and the GKD loop (module docstring)."""
    rollouts: list = field(default_factory=list)
    schedule: Optional[GkdSchedule] = None
    prompts: Optional[PromptSource] = None
    held_prompts: Optional[PromptSource] = None
    sampling: Optional[SamplingParams] = None
    pad_id: int = 0
    transport: str = "gloo"
    buckets: list = field(default_factory=list)
    rollout_version: int = 0  # the weight version the rollout workers hold
    samples: dict = field(default_factory=dict)  # round -> [Sample]: the current round's and a pending one's
    in_flight: dict = field(default_factory=dict)  # round -> (PromptBatch, [Call]) being generated

    # ---- setup ----

    def start_workers(self, device: str) -> None:
        """The teacher and student workers (`_Session.start_workers`), then the rollout workers
        (on a GPU: half of each student's GPU share) and the weight group."""
        config = self.config
        self.schedule = GkdSchedule(config.mode, config.lmbda, config.sft_alpha, config.steps_per_generation,
                                    config.max_staleness, config.seed)
        rollout_share = 0.0
        if device == "cuda":  # each rollout worker takes half of a student worker's GPU share
            if config.rollout_workers > config.student_workers:
                raise UsageError(f"rollout_workers: expected at most student_workers ({config.student_workers}) on "
                                 f"GPUs (each takes half of a student's GPU share), got {config.rollout_workers}")
            rollout_share = self.layout.gpus_per_student / 2
            self.layout = dataclasses.replace(self.layout, gpus_per_student=rollout_share)
        super().start_workers(device)
        encoder = self._prompt_sources()
        from .rollout_actor import RolloutActor

        self.rollouts = self.actors.start("rollout", RolloutActor, config.rollout_workers,
                                          dict(num_cpus=0, num_gpus=rollout_share),
                                          lambda rank: (config, self.data.vocab, self.pad_id))
        self.sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.gen_temperature,
                                       top_p=config.top_p, top_k=config.top_k, stop_token_ids=encoder.stop_token_ids)
        with self.report.phase(f"starting {len(self.rollouts)} rollout workers"):
            pids = self.get(self.each(self.rollouts, "pid"), "during setup")
            gpus = self.get(self.each(self.rollouts + self.students[:1], "gpu"), "during setup")
            nodes = self.get(self.each(self.rollouts + self.students[:1], "node"), "during setup")
        path = os.path.join(config.output_dir, "workers.json")
        with open(path) as handle:
            workers = json.load(handle)
        workers.update({name: dict(pid=pid, gpu=gpu) for name, pid, gpu in zip(self.rollouts, pids, gpus)})
        with open(path, "w") as handle:
            json.dump(workers, handle, indent=1)
        self.transport = self.weight_transport(device, gpus, nodes)
        self._connect_weights()

    def _prompt_sources(self) -> ChatEncoder:
        """Training and held-out prompts (the last 5 % of the records, one at least); the encoder."""
        from transformers import AutoTokenizer

        config = self.config
        directory = config.tokenizer_path or os.path.join(config.output_dir, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        encoder = ChatEncoder(tokenizer)
        with self.report.phase("reading the prompts"):
            records = load_records(config.prompts_path)
            if not config.prompts_path:  # the embedded default keeps the functions whose prompt fits
                records = [record for record in records
                           if len(encoder.prompt_ids(record)) <= config.max_prompt_tokens]
        if len(records) < 2:
            raise UsageError(f"prompts_path: expected at least 2 records (training and held-out prompts), got "
                             f"{len(records)}")
        held = max(1, len(records) // 20)
        self.prompts = PromptSource(records[:-held], encoder, config.max_prompt_tokens, config.seed)
        self.held_prompts = PromptSource(records[-held:], encoder, config.max_prompt_tokens, config.seed + 1)
        return encoder

    def weight_transport(self, device: str, gpus: list, nodes: list) -> str:
        """How the weights go from student-0 (the last of ``gpus`` and ``nodes``) to the rollout
        workers: pushed into their shared buffers when they all share its GPU ("cuda_ipc") or, on
        CPU, its node ("shared_memory"); else broadcast over a weight group ("nccl" across GPUs,
        "gloo" across CPU nodes). Raises when only some share student-0's GPU."""
        places, student = (gpus[:-1], gpus[-1]) if device == "cuda" else (nodes[:-1], nodes[-1])
        shared = [place == student for place in places]
        if all(shared):
            return "cuda_ipc" if device == "cuda" else "shared_memory"
        if device != "cuda":
            return "gloo"
        if any(shared):
            raise UsageError("rollout_workers: some rollout workers share student-0's GPU and some do not; NCCL "
                             "cannot join two ranks of one GPU (use rollout_workers = student_workers)")
        return "nccl"

    def _connect_weights(self) -> None:
        """The transport's setup: each rollout worker's buffer shared and mapped by student-0
        (flattened first, so that a push is one copy), or the bucket plan and the weight group."""
        config, first = self.config, self.students[0]
        if self.transport in PUSHED:
            self.get([self.actors.call(first, "flatten_weights")], "during setup")  # a replica: one buffer
            shares = self.get(self.each(self.rollouts, "share_weight_buffer"), "during setup")
            self.get([self.actors.call(first, "map_rollout_weights", shared) for shared in shares], "during setup")
            return
        self.buckets = self.get([self.actors.call(first, "open_weight_sender", config.weight_sync_bucket_mb << 20)],
                                "during setup")[0]
        port, world = free_port(), 1 + len(self.rollouts)
        calls = [self.actors.call(first, "init_weight_group", "127.0.0.1", port, world, WEIGHT_GROUP, self.transport)]
        calls += [self.actors.call(rollout, "init_weights_update_group", "127.0.0.1", port, rank + 1, world,
                                   WEIGHT_GROUP, self.transport) for rank, rollout in enumerate(self.rollouts)]
        self.get(calls, "during setup")

    # ---- weight sync and generation ----

    def sync_and_generate(self, weight_version: int, round_index: int, prompts: PromptSource, size: int,
                          when: str) -> tuple[tuple, dict]:
        """Starts round ``round_index``'s generation (`generate`) on the student's weights of
        ``weight_version`` trained steps, syncing the rollouts first if they hold another:
        pushed by student-0 into their shared buffers (one call; each under its worker's lock),
        or pause -> flush -> broadcast -> continue; then the generation. Returns the
        started generation and the update's metrics ({} if none; a push's ``sync_seconds`` is
        student-0's lock-held copy and publication, its wait for running generations
        ``sync_lock_wait_seconds``); ``sync_wall_seconds`` the whole update as the driver waits
        (the actor calls included)."""
        if weight_version == self.rollout_version:
            return self.generate(round_index, prompts, size), {}
        started, rollouts, first = time.perf_counter(), self.rollouts, self.students[0]
        if self.transport in PUSHED:
            # the push returns before the generation goes out: a refused push never leaves a generation waiting
            metrics = self.get([self.actors.call(first, "push_weights", weight_version)], when)[0]
            wall = time.perf_counter() - started
            generation = self.generate(round_index, prompts, size)
        else:
            self.get(self.each(rollouts, "pause_generation"), when)
            self.get(self.each(rollouts, "flush_cache"), when)
            calls = [self.actors.call(first, "send_weights", weight_version)]
            for names, dtypes, shapes in self.buckets:  # one actor call per bucket, in the sender's order
                calls += [self.actors.call(rollout, "update_weights_from_distributed", names, dtypes, shapes,
                                           WEIGHT_GROUP, weight_version) for rollout in rollouts]
            metrics = self.get(calls, when)[0]
            self.get(self.each(rollouts, "continue_generation"), when)
            wall = time.perf_counter() - started
            generation = self.generate(round_index, prompts, size)
        self.rollout_version = weight_version
        return generation, dict({f"sync_{key}": value for key, value in metrics.items() if key != "weight_version"},
                                sync_wall_seconds=wall)

    def generate(self, round_index: int, prompts: PromptSource, size: int) -> tuple:
        """Starts the generation of round ``round_index``: ``size`` prompts split over the rollout
        workers, each sampling with its own seed."""
        batch = prompts.batch(max(round_index, 0), size)
        parts = np.array_split(np.arange(size), len(self.rollouts))
        calls = [self.actors.call(rollout, "generate", [batch.prompt_ids[i] for i in part],
                                  dataclasses.replace(self.sampling, seed=sampling_seed(self.config.seed, round_index,
                                                                                        rank)))
                 for rank, (rollout, part) in enumerate(zip(self.rollouts, parts)) if len(part)]
        return batch, calls

    def collect(self, started: tuple, when: str) -> list[Sample]:
        batch, calls = started
        samples = []
        for rollout in self.get(calls, when):
            for response in rollout.responses():
                samples.append(Sample(batch.indices[len(samples)], tuple(response), rollout.weight_version))
        return samples

    def _round_samples(self, round_index: int, step: int, when: str) -> tuple[list[Sample], dict]:
        """Round ``round_index``'s samples (kept, in flight, or generated now on the weights of
        ``step`` trained steps); the metrics of the sync and generation it took."""
        metrics: dict = {}
        if round_index not in self.samples:
            started = self.in_flight.pop(round_index, None)
            if started is None:
                started, synced = self.sync_and_generate(step, round_index, self.prompts, self._round_size(), when)
                metrics.update(synced)
            waited = time.perf_counter()
            self.samples[round_index] = self.collect(started, when)
            metrics["generate_seconds"] = time.perf_counter() - waited
        self.samples = {index: samples for index, samples in self.samples.items() if index >= round_index}
        return self.samples[round_index], metrics

    def _round_size(self) -> int:
        config = self.config
        return config.micro_batches * config.rows_per_micro_batch * config.steps_per_generation

    def _start_next_round(self, step: int, when: str) -> dict:
        """With ``max_staleness`` 1: starts generating the next round (if on-policy) on the
        weights of ``step`` trained steps, to run while ``step`` trains."""
        plan = self.schedule.plan(step)
        following = (plan.round + 1) * self.config.steps_per_generation
        if (not self.config.max_staleness or following >= self.config.steps or plan.round + 1 in self.in_flight
                or plan.round + 1 in self.samples or not self.schedule.plan(following).on_policy):
            return {}
        self.in_flight[plan.round + 1], metrics = self.sync_and_generate(step, plan.round + 1, self.prompts,
                                                                         self._round_size(), when)
        return metrics

    # ---- training ----

    def response_batches(self, samples: list[Sample], prompts: PromptSource) -> list[ResponseBatch]:
        """Micro-batches of ``rows_per_micro_batch`` samples, each aligned student / teacher
        (`chat_data.align_response`: OPSD records use their teacher prompt)."""
        rows_per = self.config.rows_per_micro_batch
        batches = []
        for start in range(0, len(samples), rows_per):
            aligned = [align_response(*prompts.prompts(sample.record), sample.response,
                                      record=prompts.records[sample.record].source)
                       for sample in samples[start:start + rows_per]]
            student = padded([a.student_ids for a in aligned], self.pad_id)
            teacher = padded([a.teacher_ids for a in aligned], self.pad_id)
            batches.append(ResponseBatch(
                student, torch.cat([row * student.shape[1] + a.student_rows for row, a in enumerate(aligned)]),
                teacher, torch.cat([row * teacher.shape[1] + a.teacher_rows for row, a in enumerate(aligned)]),
                torch.cat([a.labels for a in aligned])))
        return batches

    def train_on_samples(self, step: int, samples: list[Sample]) -> dict:
        """One student step on generated responses, each micro-batch scored by its teacher
        worker (response rows only), no CE term."""
        plan = self.plan
        batches = self.response_batches(samples, self.prompts)
        scored = [self.actors.call(self.teachers[plan.teacher_of(m)], "score", batch.teacher_tokens, step,
                                   plan.student_of(m), batch.teacher_rows) for m, batch in enumerate(batches)]
        num_tokens = sum(len(batch.labels) for batch in batches)
        return self.train_with("train_step", step, [(b.student_tokens, b.labels, b.student_rows) for b in batches],
                               scored, num_tokens, 0.0)

    def train_loop(self, start_step: int) -> int:
        """Steps by the schedule's plans, metrics, checkpoints; the last step trained. Ctrl-C:
        Interrupted after the current step and its checkpoint."""
        config = self.config
        if self.metrics is None:
            self.metrics = MetricsLog(self._metrics_path(), tensorboard=config.tensorboard)
        self.teacher_memory = self.each(self.teachers, "memory")  # as the off-policy loop: step 0's row
        per_step = config.micro_batches * config.rows_per_micro_batch
        last_step = start_step - 1
        with self.report.bar(f"distill ({config.mode})", config.steps, "step", initial=start_step) as bar, \
                _StopOnInterrupt(self.report.note) as stop:
            for step in range(start_step, config.steps):
                started, when = time.perf_counter(), f"at step {step}"
                plan = self.schedule.plan(step)
                row: dict[str, Any] = dict(on_policy=plan.on_policy, policy_version=step)
                if plan.on_policy:
                    samples, metrics = self._round_samples(plan.round, step, when)
                    row.update(metrics)
                    row.update(self._start_next_round(step, when))
                    mine = samples[plan.share * per_step:(plan.share + 1) * per_step]
                    versions = [sample.weight_version for sample in mine]
                    row.update(self.train_on_samples(step, mine), sample_weight_versions=versions,
                               weight_version=min(versions))
                    row["staleness"] = step - row["weight_version"]
                else:
                    row.update(self.train(step, *self.submit(step), ce_weight=plan.ce_weight))
                last_step = step
                if self.finish_step(step, row, started, bar, stop):
                    break
        self.metrics.close()
        return last_step

    # ---- checkpoints ----

    def checkpoint_metadata(self) -> dict:
        """`_Session.checkpoint_metadata` and the kept and pending rounds' samples (a pending
        generation is waited for), so that a resume trains on the same samples."""
        for round_index in list(self.in_flight):
            self.samples[round_index] = self.collect(self.in_flight.pop(round_index), "while saving")
        rounds = {str(index): [[s.record, list(s.response), s.weight_version] for s in samples]
                  for index, samples in self.samples.items()}
        return dict(super().checkpoint_metadata(), onpolicy=dict(rounds=rounds, schedule=self._schedule_state()))

    def _schedule_state(self) -> dict:
        return dict(dataclasses.asdict(self.schedule), prompt_records=len(self.prompts.records))

    def restore(self, directory: str) -> int:
        """`_Session.restore`, then the kept samples; the rollouts get the restored weights before
        their next generation (their version is the restored step's)."""
        step = super().restore(directory)
        saved = checkpoint.read_manifest(directory)["metadata"].get("onpolicy")
        if saved is None or saved["schedule"] != self._schedule_state():
            raise UsageError(f"resume: {directory} was written with another mode, GKD schedule or prompts "
                             f"({None if saved is None else saved['schedule']} there, {self._schedule_state()} "
                             "here); resume with the options it was written with")
        self.samples = {int(index): [Sample(record, tuple(response), version) for record, response, version in rows]
                        for index, rows in saved["rounds"].items()}
        return step

    # ---- the end ----

    def teacher_reverse_kl(self, weight_version: int) -> tuple[float, float, int]:
        """(mean over response tokens of KL(student || teacher) at temperature 1 over the whole
        vocab; the same over the k + 1 bins of the teacher's top-k and its tail (what
        ``support=tail`` at temperature 1 trains: the student's distribution within the tail is not
        seen); tokens): the student's samples of held-out prompts (one step's worth, sampled as in
        training) scored by student-0 and teacher-0."""
        size = self.config.micro_batches * self.config.rows_per_micro_batch
        started, _ = self.sync_and_generate(weight_version, EVAL_ROUND, self.held_prompts, size,
                                            "during the final evaluation")
        samples = self.collect(started, "during the final evaluation")
        rows_per_call = max(1, EVAL_LOG_PROB_BYTES // (8 * self.data.vocab))
        total, binned, count = 0.0, 0.0, 0
        for batch in self.response_batches(samples, self.held_prompts):
            # [rows, V] log-probs of both sides cross the object store: a bounded number of rows at a time
            for start in range(0, len(batch.labels), rows_per_call):
                rows = slice(start, start + rows_per_call)
                student, teacher = self.get(
                    [self.actors.call(self.students[0], "row_log_probs", batch.student_tokens,
                                      batch.student_rows[rows]),
                     self.actors.call(self.teachers[0], "row_log_probs", batch.teacher_tokens,
                                      batch.teacher_rows[rows])],
                    "during the final evaluation")
                whole, top_k = reverse_kl_sums(student, teacher, self.config.k)
                total, binned = total + whole, binned + top_k
            count += len(batch.labels)
        return total / max(count, 1), binned / max(count, 1), count

    def summary(self, last_step: int, return_parameters: bool) -> dict:
        summary = super().summary(last_step, return_parameters)
        reverse_kl, binned, tokens = self.teacher_reverse_kl(last_step + 1)
        summary.update(mode=self.config.mode, teacher_reverse_kl=reverse_kl, teacher_reverse_kl_top_k=binned,
                       reverse_kl_tokens=tokens, weight_version=self.rollout_version, weight_sync=self.transport)
        return summary
