"""Resume that never lies: atomic, verified checkpoints and the newest good one; metrics
that hold each step once across resumes; the data order a checkpoint was written with;
Ctrl-C that leaves a resumable run; a killed teacher named as the worker that died."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import python_path
from orchestration import checkpoint
from orchestration.config import Config
from orchestration.errors import UsageError
from orchestration.metrics_log import MetricsLog, read_rows
from orchestration.packing import DataPosition
from orchestration.sampler import EpochSampler, StepSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _text_file(text):
    def write(path):
        with open(path, "w") as handle:
            handle.write(text)
    return write


# ---- checkpoints --------------------------------------------------------------------------

def test_a_checkpoint_verifies_until_a_byte_changes(tmp_path):
    output_dir = str(tmp_path)
    written = checkpoint.write(checkpoint.path_of(output_dir, 7), 7, {"a.bin": _text_file("abc")}, dict(x=1))
    assert written == os.path.join(output_dir, "checkpoints", "step_0000007")
    assert sorted(os.listdir(written)) == ["a.bin", "manifest.json"]
    assert checkpoint.verify(written) is None
    manifest = checkpoint.read_manifest(written)
    assert (manifest["step"], manifest["metadata"], manifest["files"]["a.bin"]["bytes"]) == (7, dict(x=1), 3)
    with open(os.path.join(written, "a.bin"), "w") as handle:
        handle.write("abd")  # same size, other bytes
    assert checkpoint.verify(written) == "a.bin does not match its sha256"
    os.remove(os.path.join(written, "manifest.json"))
    assert checkpoint.verify(written) == "no manifest"


def test_the_newest_good_checkpoint_skips_and_names_bad_ones(tmp_path):
    output_dir = str(tmp_path)
    for step in (2, 5, 9):
        checkpoint.write(checkpoint.path_of(output_dir, step), step, {"s.pt": _text_file(f"state {step}")}, {})
    os.makedirs(checkpoint.path_of(output_dir, 12) + ".tmp")  # a save killed before its rename: not a candidate
    os.makedirs(checkpoint.path_of(output_dir, 11))  # renamed by hand without a manifest
    with open(os.path.join(checkpoint.path_of(output_dir, 9), "s.pt"), "a") as handle:
        handle.write("!")
    assert [os.path.basename(c) for c in checkpoint.candidates(output_dir)] == [
        "step_0000011", "step_0000009", "step_0000005", "step_0000002"]
    skipped = []
    assert checkpoint.newest_good(output_dir, skipped.append) == checkpoint.path_of(output_dir, 5)
    assert skipped == [f"skipped checkpoint {checkpoint.path_of(output_dir, 11)}: no manifest",
                       f"skipped checkpoint {checkpoint.path_of(output_dir, 9)}: s.pt has 8 bytes, the manifest "
                       "says 7"]
    # a new save of a step replaces the old directory and its leftovers
    checkpoint.write(checkpoint.path_of(output_dir, 9), 9, {"s.pt": _text_file("again")}, {})
    assert checkpoint.newest_good(output_dir) == checkpoint.path_of(output_dir, 11 - 2)
    assert checkpoint.newest_good(str(tmp_path / "nothing")) is None


def test_metrics_keep_each_step_once_and_mark_the_segments(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path)
    for step in range(5):
        log.write(dict(step=step, loss=float(step)))
    log.close()
    with open(path, "a") as handle:
        handle.write('{"step": 5, "lo')  # a row cut short by a kill
    log = MetricsLog(path, resumed_step=2)  # resumed from the checkpoint of step 2
    for step in range(3, 7):
        log.write(dict(step=step, loss=10.0 + step))
    log.close()
    rows = read_rows(path)
    assert [(row["step"], row["segment"]) for row in rows] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert rows[3]["loss"] == 13.0
    assert MetricsLog(path, resumed_step=4).segment == 2
    assert [row["step"] for row in read_rows(path)] == [0, 1, 2, 3, 4]
    assert MetricsLog(path).segment == 0 and read_rows(path) == []  # a fresh run starts an empty file


def test_the_data_order_is_a_function_of_seed_and_step_and_is_checked_on_resume():
    sampler = StepSampler(seed=3, num_rows=100, micro_batches=2, rows_per_micro_batch=4)
    again = StepSampler(seed=3, num_rows=100, micro_batches=2, rows_per_micro_batch=4)
    assert all((a == b).all() for a, b in zip(sampler.picks(17), again.picks(17)))
    assert not all((a == b).all() for a, b in zip(sampler.picks(17), sampler.picks(18)))
    assert sampler.mismatch(again.state_dict()) is None
    other = StepSampler(seed=4, num_rows=90, micro_batches=2, rows_per_micro_batch=4).state_dict()
    assert sampler.mismatch(other) == "seed 4 there, 3 here; num_rows 90 there, 100 here"


def test_epochs_visit_every_row_once_a_pass_and_the_steps_cover_the_passes():
    sampler = EpochSampler(seed=3, num_rows=10, micro_batches=2, rows_per_micro_batch=2)  # 4 rows a step
    assert sampler.steps_for(1) == 3 and sampler.steps_for(2) == 5 and sampler.steps_for(4) == 10
    stream = torch.cat([torch.cat(sampler.picks(step)) for step in range(sampler.steps_for(3))])  # 12 steps, 48 rows
    for start in (0, 10, 20):  # each pass a permutation, and each pass in its own order
        assert sorted(stream[start:start + 10].tolist()) == list(range(10))
    assert not torch.equal(stream[0:10], stream[10:20])
    assert sampler.position(5) == DataPosition(2, 0) and sampler.position(7) == DataPosition(2, 8)
    again = EpochSampler(seed=3, num_rows=10, micro_batches=2, rows_per_micro_batch=2)
    assert torch.equal(torch.cat(again.picks(7)), stream[28:32])  # a resumed run reads the step where it stopped
    assert sampler.mismatch(StepSampler(3, 10, 2, 2).state_dict()) == "kind 'seed_and_step' there, 'epochs' here"
    with pytest.raises(UsageError, match=r"^epochs: expected an integer >= 0, got -1$"):
        Config(epochs=-1)


# ---- Ctrl-C, resume, a killed teacher (one run of orchestrate.py each) --------------------------

TINY = ["--set", "device=cpu", "--set", "max_corpus_bytes=60000", "--set", "tokenizer_vocab=300", "--set",
        "row_tokens=32", "--set", "rows_per_micro_batch=4", "--set", "teacher_hidden=32", "--set", "teacher_layers=1",
        "--set", "teacher_pretrain_steps=3", "--set", "student_hidden=16", "--set", "student_layers=1", "--set",
        "heads=2", "--set", "k=8", "--set", "warmup_steps=2", "--set", "steps=400", "--set", "checkpoint_every=0"]


def _start(arguments: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "orchestrate.py", *arguments], cwd=ROOT, stdout=log, stderr=log,
                            env=dict(os.environ, PYTHONPATH=python_path(ROOT)), start_new_session=True)


def _wait_for_rows(path: str, count: int, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while len(read_rows(path)) < count:
        assert process.poll() is None, f"orchestrate.py exited with {process.returncode} before step {count - 1}"
        assert time.monotonic() < deadline, f"no step {count - 1} within {timeout} s"
        time.sleep(0.05)


def _finish(process: subprocess.Popen, log_path: str) -> tuple[int, list[str]]:
    try:
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    with open(log_path) as handle:
        return process.returncode, handle.read().splitlines()


@pytest.mark.slow
def test_ctrl_c_leaves_a_resumable_run_and_a_killed_teacher_is_named(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) after the first logged
    step: exit 130, a checkpoint of the last step, the resume command. That command resumes
    (metrics keep each step once, the new rows in segment 1); then SIGKILL of the teacher's
    process stops the run with one line naming teacher-0, the step and the checkpoint.
    Two runs of the driver, about 40 s on 2 cores."""
    output_dir = str(tmp_path / "run")
    metrics = os.path.join(output_dir, "metrics.jsonl")
    arguments = TINY + ["--set", f"output_dir={output_dir}"]
    log_path = str(tmp_path / "first.log")
    with open(log_path, "w") as log:
        first = _start(arguments, log)
        _wait_for_rows(metrics, 1, first)
        os.killpg(first.pid, signal.SIGINT)
        code, lines = _finish(first, log_path)
    assert code == 130, lines
    assert not any("Traceback" in line for line in lines), lines
    last = lines[-1]
    assert last.startswith("orchestrate.py: interrupted after step "), last
    stopped = int(last.split("after step ")[1].split(";")[0])
    assert f"checkpoint {checkpoint.path_of(output_dir, stopped)}; resume with: python orchestrate.py " in last
    assert last.endswith(" --resume")
    assert checkpoint.newest_good(output_dir) == checkpoint.path_of(output_dir, stopped)
    assert [row["step"] for row in read_rows(metrics)] == list(range(stopped + 1))

    command = last.split("resume with: python ")[1].split()[1:]
    assert command == arguments + ["--resume"]
    log_path = str(tmp_path / "second.log")
    with open(log_path, "w") as log:
        second = _start(command, log)
        _wait_for_rows(metrics, stopped + 3, second)
        with open(os.path.join(output_dir, "workers.json")) as handle:
            workers = json.load(handle)
        assert sorted(workers) == ["student-0", "teacher-0"]
        os.kill(workers["teacher-0"]["pid"], signal.SIGKILL)
        code, lines = _finish(second, log_path)
    assert code == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    error = lines[-1]
    assert error.startswith("orchestrate.py: error: worker teacher-0 died at step "), error
    assert f"; last good checkpoint: {checkpoint.path_of(output_dir, stopped)}; resume with: python orchestrate.py" \
        in error
    rows = read_rows(metrics)
    steps = [row["step"] for row in rows]
    assert steps == list(range(len(rows))) and len(rows) >= stopped + 3  # each step once, none missing
    assert [row["segment"] for row in rows] == [0] * (stopped + 1) + [1] * (len(rows) - stopped - 1)
    died_at = int(error.split("died at step ")[1].split(";")[0])
    assert died_at >= len(rows)  # the step in flight when the teacher died, after the last logged one
