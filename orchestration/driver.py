"""The driver loop: data, teacher and student workers as Ray actors placed on the GPUs
(colocated, disaggregated, or fused: a pair in one actor), teacher top-k through a
`Transfer`, teacher scoring of step i + 1 overlapped with student training of step i,
metrics, atomic checkpoints, resume from the newest one that verifies, a stop naming the
worker that died, and Ctrl-C that stops after the current step with a checkpoint."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from . import checkpoint
from .actors import Actors, Call
from .checkpoint_tokenizer import checkpoint_tokenizer
from .cluster import connect
from .comm_plan import CommPlan
from .config import check_machine, fused_allowed
from .data import IGNORE_INDEX, Dataset, prepare_data
from .errors import Interrupted, UsageError
from .metrics import should_evaluate
from .metrics_log import MetricsLog
from .placement import Layout, check_placement, device_type, gpu_count, resolve_layout
from .process_group import worlds
from .progress import Progress
from .sampler import StepSampler, sampler_class
from .token_data import is_pre_tokenized, prepare_token_data

PRETRAIN_UPDATES = 50  # the teacher pretrains in this many calls, so its bar moves
HELD_OUT_ROWS_PER_CALL = 32


def run(config, progress: bool = True, return_parameters: bool = False) -> dict:
    """Runs the distillation; returns a summary (held-out CEs, paths, layout; with
    ``return_parameters`` each student's flattened parameters). Raises UsageError (a run that
    cannot start as asked), WorkerDied / WorkerFailed, Interrupted (Ctrl-C, after saving).
    Its Ray actors are killed before it returns, and Ray is shut down if it started it."""
    problems = check_machine(vars(config), set())
    if problems:
        raise UsageError(problems)
    report = Progress(progress)
    tokenizer = checkpoint_tokenizer(config)
    pre_tokenized = is_pre_tokenized(config.data_path)
    if (config.teacher_path or config.student_path) and tokenizer is None and not pre_tokenized \
            and not config.tokenizer_path:
        raise UsageError(["teacher_path, student_path: the checkpoints hold no tokenizer; set tokenizer_path to the "
                          "one they were trained with, or give pre-tokenized data_path"])
    if config.mode == "cache":
        from .cache_run import write_cache

        os.makedirs(config.output_dir, exist_ok=True)
        return write_cache(config, _dataset(config, report, tokenizer, pre_tokenized), report)
    resume_from = _resume_point(config, report)
    os.makedirs(config.output_dir, exist_ok=True)
    import ray

    device = device_type(config.device)
    # a teacher cache is read on the CPU: its entries go through the object store
    layout = resolve_layout(config.placement, "object_store" if config.teacher_cache else config.transfer, device,
                            gpu_count() if device == "cuda" else 0, config.teacher_workers, config.student_workers,
                            fused_allowed=fused_allowed(vars(config)))
    plan = CommPlan(config.teacher_workers, config.student_workers, config.micro_batches)
    data = _dataset(config, report, tokenizer, pre_tokenized)
    sampler = sampler_class(config)(config.seed, len(data.train_tokens), config.micro_batches,
                                    config.rows_per_micro_batch)
    if config.epochs:  # the workers' LR schedule and the loop read the steps from the config
        config = dataclasses.replace(config, steps=sampler.steps_for(config.epochs))
    if config.k > data.vocab:
        raise UsageError(f"k: expected at most the vocab ({data.vocab} tokens in the tokenizer), got {config.k}")
    if config.teacher_cache:
        from .cache_run import check_cache

        check_cache(config, data)
    elif config.support == "sampled":
        raise UsageError("support: 'sampled' trains from a teacher cache of samples (mode=cache with cache_samples "
                         "> 0, then teacher_cache=DIR); the live teacher sends its top-k")
    if resume_from and (problem := sampler.mismatch(checkpoint.read_manifest(resume_from)["metadata"]["sampler"])):
        raise UsageError(f"resume: {resume_from} was written with another data order ({problem}); resume with the "
                         "options and data it was written with")
    started_ray = not ray.is_initialized()
    if started_ray:
        with report.phase("starting Ray" if config.ray_address is None else f"joining Ray at {config.ray_address}"):
            local = {} if config.ray_address else dict(num_cpus=max(2, os.cpu_count() or 2),
                                                       num_gpus=gpu_count() if device == "cuda" else 0)
            connect(config.ray_address, runtime_env=_worker_environment(config.ray_address), **local)
    actors = Actors(ray, lambda: checkpoint.newest_good(config.output_dir))
    if config.mode == "off_policy":  # mode "cache" returned above
        session = _Session(config, plan, layout, data, sampler, actors, report)
    else:
        from .onpolicy import OnPolicySession

        session = OnPolicySession(config, plan, layout, data, sampler, actors, report)
    try:
        session.start_workers(device)
        start_step = session.restore(resume_from) if resume_from else 0
        session.pretrain_teachers()
        last_step = session.train_loop(start_step)
        return session.summary(last_step, return_parameters)
    finally:
        actors.kill_all()
        if session.slots:
            from .cluster import release_slots

            release_slots(session.slots)
        if started_ray:
            ray.shutdown()


def _dataset(config, report: Progress, tokenizer, pre_tokenized: bool):
    """The run's `Dataset`: packed pre-tokenized documents, or text through the tokenizer."""
    if not pre_tokenized:
        return prepare_data(config, report, tokenizer)
    try:
        return prepare_token_data(config, tokenizer, report)
    except ValueError as error:
        raise UsageError([f"data_path: {error}"]) from None


def _worker_environment(address: Optional[str]) -> Optional[dict]:
    """Workers on the nodes of a joined cluster import this source tree (a shared file system)."""
    if address is None:
        return None
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [source] + [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def _resume_point(config, report: Progress) -> Optional[str]:
    """The checkpoint to resume from (None: a fresh run, whose earlier checkpoints are
    deleted when ``overwrite``). UsageError when none verifies."""
    if config.resume:
        found = checkpoint.newest_good(config.output_dir, report.note)
        if found is None:
            raise UsageError(f"resume: no checkpoint in {checkpoint.directory_of(config.output_dir)} verifies "
                             "(each one skipped is named above); run without --resume to start again")
        report.note(f"resuming from {found}")
        return found
    earlier = checkpoint.candidates(config.output_dir)
    if earlier and config.overwrite:
        shutil.rmtree(checkpoint.directory_of(config.output_dir))
        report.note(f"overwrite: deleted {len(earlier)} checkpoint(s) of an earlier run in "
                    f"{checkpoint.directory_of(config.output_dir)}")
    return None


class _StopOnInterrupt:
    """Within it, the first Ctrl-C (SIGINT) asks the loop to stop after the current step
    (``requested``), a second one stops at once (KeyboardInterrupt). Main thread only."""

    def __init__(self, note):
        self.note, self.requested, self._previous = note, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.note("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again: stop now, without one)")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@dataclass
class _Session:
    """One run's workers and what they work on; its methods are the driver loop's parts."""
    config: object
    plan: CommPlan
    layout: Layout
    data: Dataset
    sampler: StepSampler
    actors: Actors
    report: Progress
    teachers: list = field(default_factory=list)
    students: list = field(default_factory=list)
    metrics: Optional[MetricsLog] = None
    saved_step: Optional[int] = None
    teacher_pretrain_loss: float = float("nan")
    slots: list = field(default_factory=list)  # placement group slots in a joined cluster
    nodes: dict = field(default_factory=dict)  # worker name -> the id of its Ray node
    held_out_chunks: Optional[list] = None  # held-out rows in chunks (object refs)
    held_out_topk: Optional[list] = None  # the teacher's top-k of each chunk (object refs), computed once
    teacher_memory: list = field(default_factory=list)  # calls answering each teacher's peak memory

    def get(self, calls: list[Call], when: str) -> list:
        return self.actors.get(calls, when)

    def each(self, workers: list[str], method: str, *args) -> list[Call]:
        return [self.actors.call(worker, method, *args) for worker in workers]

    def start_workers(self, device: str) -> None:
        """Teacher and student actors, up and answering; workers.json (name → pid, GPU, Ray node);
        the placement check; the NCCL pair handshake; the training rows."""
        from .cache_run import CacheTeacherWorker
        from .student import StudentWorker
        from .teacher import TeacherWorker

        config, layout, vocab = self.config, self.layout, self.data.vocab
        teacher_slots, student_slots = self.place(device)
        host, port = "127.0.0.1", None
        if student_slots:  # the process group meets on student-0's node
            import ray

            from .cluster import free_port

            endpoint = ray.remote(lambda: (ray.util.get_node_ip_address(), free_port()))
            host, port = ray.get(endpoint.options(**student_slots[0].actor_options(num_cpus=0)).remote())
        teacher_worlds, student_worlds = worlds(layout.transfer, config.teacher_workers, config.student_workers,
                                                device, sharded=config.student_strategy == "fsdp2", host=host,
                                                port=port)
        arguments = dict(teacher=lambda rank: (config, vocab, layout.transfer, teacher_worlds[rank]),
                         student=lambda rank: (config, vocab, rank, config.student_workers, student_worlds[rank],
                                               layout.transfer))
        teacher_class = CacheTeacherWorker if config.teacher_cache else TeacherWorker
        # actors take no CPU slot: the driver decides placement, and more actors than cores must start
        if layout.placement == "fused":  # a pair's teacher is built first: its student seeds the process last
            names = self.actors.start_fused([("teacher", teacher_class), ("student", StudentWorker)],
                                            config.student_workers, dict(num_cpus=0, num_gpus=layout.gpus_per_student),
                                            lambda role, rank: arguments[role](rank),
                                            (lambda rank: student_slots[rank].actor_options()) if student_slots
                                            else None)
            self.teachers, self.students = names["teacher"], names["student"]
        else:
            self.teachers = self.actors.start("teacher", teacher_class, config.teacher_workers,
                                              dict(num_cpus=0, num_gpus=layout.gpus_per_teacher), arguments["teacher"],
                                              (lambda rank: teacher_slots[rank].actor_options()) if teacher_slots
                                              else None)
            self.students = self.actors.start("student", StudentWorker, config.student_workers,
                                              dict(num_cpus=0, num_gpus=layout.gpus_per_student), arguments["student"],
                                              (lambda rank: student_slots[rank].actor_options()) if student_slots
                                              else None)
        workers = self.teachers + self.students
        with self.report.phase(f"starting {len(workers)} workers"):
            pids = self.get(self.each(workers, "pid"), "during setup")
            gpus = self.get(self.each(workers, "gpu"), "during setup")
            self.nodes = dict(zip(workers, self.get(self.each(workers, "node"), "during setup")))
        with open(os.path.join(config.output_dir, "workers.json"), "w") as handle:
            json.dump({name: dict(pid=pid, gpu=gpu, node=self.nodes[name])
                       for name, pid, gpu in zip(workers, pids, gpus)}, handle, indent=1)
        if device == "cuda":
            check_placement(layout, gpus[:len(self.teachers)], gpus[len(self.teachers):])
        if layout.transfer == "nccl":  # both sides of every pair at once: see transfer.Nccl
            pairs = sorted({(self.plan.teacher_of(m), self.plan.student_of(m)) for m in range(config.micro_batches)})
            first_teacher_rank = len(self.students)  # teachers follow the students in the process group
            calls = [self.actors.call(t, "connect", [s for tt, s in pairs if tt == index])
                     for index, t in enumerate(self.teachers)]
            calls += [self.actors.call(s, "connect", [first_teacher_rank + t for t, ss in pairs if ss == index])
                      for index, s in enumerate(self.students)]
            self.get(calls, "during setup")
        import ray

        data = self.data
        rows = [ray.put(part) for part in (data.train_tokens, data.train_labels, data.train_positions,
                                           data.train_documents)]
        self.get(self.each(workers, "set_rows", *rows), "during setup")

    def place(self, device: str) -> tuple[list, list]:
        """In a joined cluster (``ray_address``): placement group slots per node for the
        teacher and the student workers (`cluster.place_slots`; a colocated teacher and
        student share a one-GPU slot, a fused pair's one actor takes it; students take
        consecutive slots, so FSDP's ranks share nodes); ([], []) for a local Ray."""
        config, layout = self.config, self.layout
        if config.ray_address is None:
            return [], []
        from .cluster import place_slots

        if layout.placement == "fused":
            self.slots = place_slots(config.student_workers, {"GPU": 1} if device == "cuda" else {"CPU": 1})
            return self.slots, self.slots
        if device == "cuda" and layout.placement == "colocated":
            slots = place_slots(config.student_workers, {"GPU": 1})
            self.slots = slots
            return [slots[rank % len(slots)] for rank in range(config.teacher_workers)], slots
        bundle = {"GPU": 1} if device == "cuda" else {"CPU": 1}
        self.slots = place_slots(config.student_workers + config.teacher_workers, bundle)
        return self.slots[config.student_workers:], self.slots[:config.student_workers]

    def restore(self, directory: str) -> int:
        """Loads the checkpoint into every student; the metrics keep the rows up to its step.
        Returns the first step to train."""
        step = self.get(self.each(self.students, "load", directory), f"while loading {directory}")[0][0]
        self.metrics = MetricsLog(self._metrics_path(), resumed_step=step, tensorboard=self.config.tensorboard)
        self.saved_step = step
        return step + 1

    def pretrain_teachers(self) -> None:
        """A teacher built from a config pretrains (teacher-0, in chunks, with a bar), then the
        others get its weights: every teacher worker scores with the same ones."""
        config, first = self.config, self.teachers[0]
        total = 0 if config.teacher_path or config.teacher_cache else config.teacher_pretrain_steps
        if total:
            chunk = -(-total // PRETRAIN_UPDATES)
            with self.report.bar("teacher pretraining", total, "step") as bar:
                for done in range(0, total, chunk):
                    steps = min(chunk, total - done)
                    self.teacher_pretrain_loss = self.get([self.actors.call(first, "pretrain", steps)],
                                                          "during teacher pretraining")[0]
                    bar.update(steps)
                    bar.set_postfix(loss=f"{self.teacher_pretrain_loss:.3f}", refresh=False)
        self.get(self.each(self.teachers, "finish_pretraining"), "during setup")
        if total and len(self.teachers) > 1:
            import ray

            state = ray.put(self.get([self.actors.call(first, "state_dict")], "during setup")[0])
            self.get(self.each(self.teachers[1:], "load_state_dict", state), "during setup")

    def submit(self, step: int) -> tuple[list, list[Call]]:
        """The step's micro-batches (training row indices, ``[B]`` each), each scored by the
        teacher worker the plan gives it, and the teacher's replies (calls)."""
        picks = self.sampler.picks(step)
        return picks, [self.actors.call(self.teachers[self.plan.teacher_of(m)], "score_rows", pick, step,
                                        self.plan.student_of(m)) for m, pick in enumerate(picks)]

    def train(self, step: int, picks: list, scored: list[Call], ce_weight: Optional[float] = None) -> dict:
        """One student step over the micro-batches ``picks`` and the teacher's replies
        ``scored`` (both from `submit`); the step's metrics. ``ce_weight``: None, the option's."""
        labels = self.data.train_labels
        num_tokens = max(1, sum(int((labels[pick] != IGNORE_INDEX).sum()) for pick in picks))
        return self.train_with("train_step_rows", step, picks, scored, num_tokens, ce_weight)

    def train_with(self, method: str, step: int, batches: list, scored: list[Call], num_tokens: int,
                   ce_weight: Optional[float]) -> dict:
        """One student step: each student's ``method(step, its micro-batches of batches, their
        teacher replies, num_tokens, ce_weight)``; the step's metrics."""
        plan = self.plan
        calls = [self.actors.call(s, method, step, [batches[m] for m in plan.micro_batches_of_student(rank)],
                                  [scored[m].ref for m in plan.micro_batches_of_student(rank)], num_tokens, ce_weight)
                 for rank, s in enumerate(self.students)]
        called = time.perf_counter()
        parts = self.get(calls, f"at step {step}")
        call_seconds = time.perf_counter() - called
        # actor calls run in order: after this step's scoring. The teachers' memory comes from the
        # previous step's release, done by now, so the next step's scoring (overlap) is not waited on
        earlier, self.teacher_memory = self.teacher_memory, self.each(self.teachers, "release", step)
        teacher_memory = self.get(earlier, f"at step {step}")
        total = {key: sum(part[key] for part in parts) for key in parts[0]
                 if key not in ("lr", "worker_seconds", "grad_norm", "memory")}
        memory = {f"{name}_{key}": value for name, part in zip(self.teachers + self.students,
                                                               teacher_memory + [part["memory"] for part in parts])
                  for key, value in part.items()}
        rows = max(total["rows"], 1)
        return dict(loss=total["loss"], kd=total["kd_sum"] / rows, ce=total["ce_sum"] / rows,
                    teacher_tail_mass=1.0 - total["teacher_mass_sum"] / rows, tokens=num_tokens,
                    teacher_seconds=total["teacher_seconds"], wait_seconds=max(p["wait_seconds"] for p in parts),
                    transfer_seconds=max(p["transfer_seconds"] for p in parts),
                    student_seconds=max(p["student_seconds"] for p in parts),
                    dispatch_seconds=call_seconds - max(p["worker_seconds"] for p in parts), lr=parts[0]["lr"],
                    grad_norm=parts[0]["grad_norm"], **memory)

    def save(self, step: int) -> str:
        """The checkpoint of ``step`` (written once: a second save of the same step is skipped)."""
        directory = checkpoint.path_of(self.config.output_dir, step)
        if self.saved_step != step:
            metadata = self.checkpoint_metadata()
            # replicas hold equal state: rank 0 writes it; FSDP2 ranks each write their shards
            savers = self.students if self.sharded else self.students[:1]
            self.get(self.each(savers, "save", directory, step, metadata), f"while saving step {step}")
            self.saved_step = step
        return directory

    @property
    def sharded(self) -> bool:
        return self.config.student_strategy == "fsdp2"

    def held_out(self) -> list:
        """The held-out rows in chunks of `HELD_OUT_ROWS_PER_CALL` (object refs of ``(tokens,
        labels, positions or None, documents or None)``), put in the object store once."""
        if self.held_out_chunks is None:
            import ray

            data = self.data
            parts = (data.held_tokens, data.held_labels, data.held_positions, data.held_documents)
            self.held_out_chunks = [ray.put(tuple(None if part is None else part[s:s + HELD_OUT_ROWS_PER_CALL]
                                                  for part in parts))
                                    for s in range(0, len(data.held_tokens), HELD_OUT_ROWS_PER_CALL)]
        return self.held_out_chunks

    def evaluate(self) -> dict:
        """Held-out CE and KD of the student (`StudentWorker.evaluate` on every student rank);
        the teacher's top-k of the held-out rows is computed once (teacher-0) and kept."""
        if self.held_out_topk is None:
            self.held_out_topk = [self.actors.call(self.teachers[0], "topk_of_chunk", chunk).ref
                                  for chunk in self.held_out()]
        return self.get(self.each(self.students, "evaluate", self.held_out(), self.held_out_topk),
                        "during held-out evaluation")[0]

    def export(self) -> str:
        """The final student with ``save_pretrained`` (and the tokenizer) in output_dir/final."""
        directory = os.path.join(self.config.output_dir, "final")
        exporters = self.students if self.sharded else self.students[:1]
        self.get(self.each(exporters, "export", directory), "while exporting the student")
        if self.data.tokenizer is not None:
            self.data.tokenizer.save_pretrained(directory)
        return directory

    def checkpoint_metadata(self) -> dict:
        """What the driver writes into a checkpoint's manifest: the data order, the run segment."""
        return dict(sampler=self.sampler.state_dict(), segment=self.metrics.segment)

    def _metrics_path(self) -> str:
        return os.path.join(self.config.output_dir, "metrics.jsonl")

    def train_loop(self, start_step: int) -> int:
        """Steps with the teacher one step ahead (``overlap``), metrics, checkpoints; the last
        step trained. Ctrl-C: Interrupted after the current step and its checkpoint."""
        config = self.config
        if self.metrics is None:
            self.metrics = MetricsLog(self._metrics_path(), tensorboard=config.tensorboard)
        last_step = start_step - 1
        self.teacher_memory = self.each(self.teachers, "memory")
        with self.report.bar("distill", config.steps, "step", initial=start_step) as bar, \
                _StopOnInterrupt(self.report.note) as stop:
            pending = self.submit(start_step) if start_step < config.steps else None
            for step in range(start_step, config.steps):
                started = time.perf_counter()
                submitted, pending = pending, None
                if config.overlap and step + 1 < config.steps:
                    pending = self.submit(step + 1)  # the teacher scores the next step while the student trains
                result = self.train(step, *submitted)
                if pending is None and step + 1 < config.steps:
                    pending = self.submit(step + 1)
                last_step = step
                if self.finish_step(step, result, started, bar, stop):
                    break
        self.metrics.close()
        return last_step

    def finish_step(self, step: int, result: dict, started: float, bar, stop: _StopOnInterrupt) -> bool:
        """After a step trained: its metrics row (``result`` and the step's timing), the bar, the
        checkpoint when due; Interrupted on Ctrl-C; whether the loop stops (``stop_after``)."""
        config = self.config
        step_seconds = time.perf_counter() - started
        result.update(step=step, step_seconds=step_seconds, tokens_per_s=result["tokens"] / step_seconds)
        if config.eval_every and should_evaluate(step + 1, config.eval_every, config.steps):
            result.update(self.evaluate())  # after the step's timing: evaluation is not training time
        self.metrics.write(result)
        bar.update(1)
        bar.set_postfix(loss=f"{result['loss']:.3f}", kd=f"{result['kd']:.3f}", ce=f"{result['ce']:.3f}",
                        refresh=False)
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            self.save(step)
        if stop.requested:
            raise Interrupted(step, self.save(step))
        return config.stop_after is not None and step >= config.stop_after

    def held_out_ce(self) -> tuple[float, float]:
        """(teacher, student) held-out CE in nats per token, chunks of rows (`held_out`: packed
        rows with their document mask) scored by teacher-0 and student-0 at once; a sharded
        student's is its fused CE (`evaluate`)."""
        rows, chunks = len(self.data.held_tokens), self.held_out()
        sides = (self.teachers[0],) if self.sharded else (self.teachers[0], self.students[0])
        calls = [self.actors.call(worker, "held_out_sums", chunk) for worker in sides for chunk in chunks]
        sums = [[0.0, 0], [0.0, 0]]
        with self.report.bar("held-out CE", rows * len(sides), "row") as bar:
            for index, (total, count) in self.actors.wait_each(calls, "during held-out evaluation"):
                side, chunk = divmod(index, len(chunks))
                sums[side][0] += total
                sums[side][1] += count
                bar.update(min(HELD_OUT_ROWS_PER_CALL, rows - chunk * HELD_OUT_ROWS_PER_CALL))
        teacher, student = (total / max(count, 1) for total, count in sums)
        return teacher, self.evaluate()["held_out_ce"] if self.sharded else student

    def summary(self, last_step: int, return_parameters: bool) -> dict:
        saved = self.save(last_step)
        teacher_ce, student_ce = self.held_out_ce()
        data = self.data
        summary = dict(
            last_step=last_step, vocab=data.vocab, teacher_pretrain_loss=self.teacher_pretrain_loss,
            teacher_held_out_ce=teacher_ce, student_held_out_ce=student_ce, train_rows=len(data.train_tokens),
            held_out_rows=len(data.held_tokens), metrics=self._metrics_path(), checkpoint=saved,
            segment=self.metrics.segment, placement=self.layout.placement, transfer=self.layout.transfer,
            nodes=self.nodes, steps=self.config.steps)
        workers = self.teachers + self.students
        summary["memory"] = dict(zip(workers, self.get(self.each(workers, "memory"), "while reading memory")))
        if self.config.export:
            summary["export"] = self.export()
        if return_parameters:
            summary["student_parameters"] = self.get(self.each(self.students, "parameters_vector"),
                                                     "while collecting parameters")
        return summary
