"""The Ray driver's parts: comm plan, label shifting and packing, object-store transfer,
layouts, exact resume (past a corrupt checkpoint), a dead worker, several workers and the
process-group transfer (CPU, tiny sizes). Options: test_driver_config.py; checkpoints,
metrics, Ctrl-C and a killed teacher: test_driver_resume.py."""
import json
import math
import os

import numpy as np
import pytest
import torch

import kd_kernels as kd
from orchestration.comm_plan import CommPlan
from orchestration.config import Config
from orchestration.data import (IGNORE_INDEX, Document, encode, encode_all, encoded, pack, shifted_labels,
                                stdlib_sources, train_tokenizer)

ray = pytest.importorskip("ray")


# ---- comm plan ---------------------------------------------------------------------------

@pytest.mark.parametrize("teachers, students", [(1, 1), (1, 4), (4, 1), (2, 4), (4, 2)])
def test_comm_plan_maps_integer_ratios_both_ways(teachers, students):
    plan = CommPlan(teachers, students, num_micro_batches=8)
    routes = plan.routes()
    assert [r.micro_batch for r in routes] == list(range(8))
    for rank in range(teachers):
        assert len(plan.micro_batches_of_teacher(rank)) == 8 // teachers
    for rank in range(students):
        assert len(plan.micro_batches_of_student(rank)) == 8 // students
    # contiguous: a teacher's micro-batches go to as few students as the ratio allows
    for rank in range(teachers):
        targets = {plan.student_of(m) for m in plan.micro_batches_of_teacher(rank)}
        assert len(targets) == max(1, students // teachers)


@pytest.mark.parametrize("teachers, students, micro, match", [(2, 3, 6, "divide"), (3, 2, 6, "divide"),
                                                               (2, 4, 6, "micro_batches"), (0, 1, 1, "teacher")])
def test_comm_plan_refuses_non_divisible_layouts(teachers, students, micro, match):
    with pytest.raises(ValueError, match=match):
        CommPlan(teachers, students, micro)


# ---- labels and packing -------------------------------------------------------------------

class _Characters:
    """A stand-in tokenizer: one id per character."""

    def encode(self, text):
        return [ord(c) for c in text]


def test_labels_are_shifted_once_and_kd_ce_score_the_same_positions():
    document = Document([10, 11, 12, 13], [True] * 4)
    assert shifted_labels(document) == [11, 12, 13, IGNORE_INDEX]
    rows = list(pack([document, Document([20, 21, 22], [True] * 3)], row_tokens=5, pad_id=0))
    tokens, labels = rows[0]
    assert tokens.tolist() == [10, 11, 12, 13, 20]
    # the last token of a document predicts nothing: no label crosses a document boundary
    assert labels.tolist() == [11, 12, 13, IGNORE_INDEX, 21]
    tokens, labels = rows[1]
    assert tokens.tolist() == [21, 22, 0, 0, 0] and labels.tolist() == [22, IGNORE_INDEX] + [IGNORE_INDEX] * 3
    # labels[t] is the token at t + 1 wherever it is trained: the row the loss scores for KD and CE
    for tokens, labels in rows:
        trained = labels != IGNORE_INDEX
        assert torch.equal(labels[:-1][trained[:-1]], tokens[1:][trained[:-1]])


def test_chat_template_masks_the_prompt():
    record = {"prompt": "ab", "response": "cd"}
    document = encode(record, _Characters(), "Q:{prompt} A:{response}")
    labels = shifted_labels(document)
    text = "Q:ab A:cd"
    first_response = text.index("cd")
    assert all(label == IGNORE_INDEX for label in labels[:first_response - 1])
    assert labels[first_response - 1] == ord("c") and labels[first_response] == ord("d")
    assert labels[-1] == IGNORE_INDEX


def test_batched_encoding_equals_one_record_at_a_time(tmp_path):
    records = [{"text": "def f(x):\n    return x + 1\n"}, {"prompt": "Q: two plus two", "response": " four"},
               {"text": "class A:\n    pass\n" * 3}, {"prompt": "say", "response": " hi"}]
    tokenizer = train_tokenizer(records * 4, 300, str(tmp_path / "tokenizer"))
    template = "<{prompt}> {response}"
    single = [encode(record, tokenizer, template) for record in records]
    done = []
    for batched in (encode_all(records, tokenizer, template),
                    list(encoded(records, tokenizer, template, done=done.append, batch_characters=30))):
        assert [(d.tokens, d.trained) for d in batched] == [(d.tokens, d.trained) for d in single]
        assert all(len(d.tokens) > 3 for d in batched)
    assert len(done) > 1 and sum(done) == sum(len(r.get("text", "")) + len(r.get("prompt", "") + r.get("response", ""))
                                               for r in records)


def test_stdlib_corpus_reads_the_top_level_first_and_no_installed_packages():
    import os
    import sysconfig

    paths = stdlib_sources()
    root = sysconfig.get_paths()["stdlib"]
    depth = [os.path.relpath(path, root).count(os.sep) for path in paths]
    assert depth == sorted(depth, key=lambda d: d > 0) and depth[0] == 0 and depth[-1] > 0
    assert not any("site-packages" in path for path in paths)


# ---- transfer through the object store -----------------------------------------------------

def test_object_store_transfer_round_trip(ray_cluster):
    from orchestration.transfer import TRANSFERS, ObjectStore, transfer_for

    logprobs = torch.log_softmax(torch.randn(6, 40), -1).topk(5).values
    logprobs[0, -1] = -math.inf
    top = kd.TopK(logprobs, torch.randint(0, 40, (6, 5), dtype=torch.int32), torch.randn(6), 2.0)
    sender, receiver = transfer_for("object_store"), transfer_for("object_store")
    assert isinstance(sender, ObjectStore) and set(TRANSFERS) == {"object_store", "cuda_ipc", "nccl", "in_process"}
    fetched = ray.get(ray.put(sender.send(top, step=0, student_rank=0)))
    assert isinstance(fetched, np.ndarray) and not fetched.flags.writeable  # shared memory, read in place
    back = receiver.receive(fetched, torch.device("cpu"))
    assert torch.equal(back.indices, top.indices) and torch.equal(back.logprobs, top.logprobs.to(torch.bfloat16))
    assert back.temperature == 2.0
    with pytest.raises(ValueError, match="transfer: expected one of 'object_store', 'cuda_ipc', 'nccl', "
                                         "'in_process', got 'tcp'"):
        transfer_for("tcp")


# ---- runs ---------------------------------------------------------------------------------

def _tiny(tmp_path, name, **overrides):
    values = dict(output_dir=str(tmp_path / name), device="cpu", max_corpus_bytes=60_000, tokenizer_vocab=300,
                  row_tokens=32, rows_per_micro_batch=4, micro_batches=2, teacher_hidden=32, teacher_layers=1,
                  teacher_pretrain_steps=3, student_hidden=16, student_layers=1, heads=2, steps=6, k=8,
                  warmup_steps=2, checkpoint_every=3)
    values.update(overrides)
    return Config(**values)


def test_a_dead_worker_is_named_and_a_resume_past_a_corrupt_checkpoint_equals_an_uninterrupted_run(
        ray_cluster, tmp_path, capsys):
    """The student's process exits at step 4 (checkpoints of steps 1 and 3): the run stops naming
    both workers of the fused pair's process and the last checkpoint (one worker of its own
    process: the Ctrl-C test's killed teacher). That checkpoint truncated as a kill during a
    plain write would leave it, and a staging directory left by a kill during a save: the resume
    names the corrupt one, restores step 1, and ends equal to an uninterrupted run, with each
    step once in metrics.jsonl. Fused runs: one process a run."""
    from orchestration import checkpoint
    from orchestration.driver import run
    from orchestration.errors import WorkerDied
    from orchestration.metrics_log import read_rows

    whole = run(_tiny(tmp_path, "whole", placement="fused"), progress=False, return_parameters=True)
    expected = whole["student_parameters"][0]
    with pytest.raises(WorkerDied, match=r"^workers teacher-0, student-0 died at step 4; last good checkpoint: "
                                         r".*step_0000003$"):
        run(_tiny(tmp_path, "resumed", placement="fused", fail_student_at_step=4, checkpoint_every=2), progress=False)
    output_dir = str(tmp_path / "resumed")
    newest = checkpoint.path_of(output_dir, 3)
    assert checkpoint.candidates(output_dir) == [newest, checkpoint.path_of(output_dir, 1)]
    state = os.path.join(newest, "student.pt")
    with open(state, "r+b") as handle:
        handle.truncate(os.path.getsize(state) // 2)
    os.makedirs(checkpoint.path_of(output_dir, 4) + ".tmp")  # a save killed before its rename
    capsys.readouterr()
    resumed = run(_tiny(tmp_path, "resumed", placement="fused", resume=True), progress=False, return_parameters=True)
    notes = capsys.readouterr().err
    assert f"skipped checkpoint {newest}: student.pt has" in notes
    assert f"resuming from {checkpoint.path_of(output_dir, 1)}" in notes
    assert resumed["last_step"] == 5 and resumed["segment"] == 1
    assert torch.equal(resumed["student_parameters"][0], expected)
    rows = read_rows(resumed["metrics"])
    assert [row["step"] for row in rows] == list(range(6))  # steps 2 and 3 of the first run were dropped
    assert [row["segment"] for row in rows] == [0, 0, 1, 1, 1, 1]
    by_step = {row["step"]: row["loss"] for row in read_rows(whole["metrics"])}
    assert [row["loss"] for row in rows] == [by_step[step] for step in range(6)]
    assert checkpoint.newest_good(output_dir) == checkpoint.path_of(output_dir, 5)


def test_a_failed_call_names_the_worker_that_died_not_the_one_waiting_on_it(ray_cluster):
    """A student waiting on a teacher's reply fails first when the teacher's process is
    killed; the message names the teacher. A worker that raises is named with its error."""
    import signal
    import time

    from orchestration.actors import Actors
    from orchestration.errors import WorkerDied, WorkerFailed

    class Toy:  # defined here: Ray sends the class itself to the workers
        def ping(self):
            return True

        def pid(self):
            return os.getpid()

        def fail(self):
            raise ValueError("boom\nsecond line")

        def sleep(self, seconds):
            time.sleep(seconds)

        def wait_for(self, refs):
            return ray.get(refs[0])

    actors = Actors(ray, lambda: "runs/x/checkpoints/step_0000004")
    try:
        actors.start("teacher", Toy, 1, dict(num_cpus=0), lambda rank: ())
        actors.start("student", Toy, 2, dict(num_cpus=0), lambda rank: ())
        with pytest.raises(WorkerFailed, match=r"^worker teacher-0 failed at step 3: ValueError: boom$"):
            actors.get([actors.call("student-1", "pid"), actors.call("teacher-0", "fail")], "at step 3")
        pid = actors.get([actors.call("teacher-0", "pid")], "during setup")[0]
        waiting = actors.call("student-0", "wait_for", [actors.call("teacher-0", "sleep", 60).ref])
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match=r"^worker teacher-0 died at step 7; last good checkpoint: "
                                             r"runs/x/checkpoints/step_0000004$"):
            actors.get([waiting], "at step 7")
    finally:
        actors.kill_all()


def test_two_teacher_and_two_student_workers_apart_fused_sharded_and_resumed_train_alike(ray_cluster, tmp_path,
                                                                                        monkeypatch):
    """Two teacher and two student workers (two layers each student): replicas apart (colocated,
    the object store); FSDP2 students in two fused pairs (the GPU default placement, one process
    a pair), equal to the replicas and to one fused pair (one worker) on the same global batch
    up to float32 sums in another order; the two pairs stopped after step 1 (stop_after) and resumed
    from the sharded checkpoint, equal to their uninterrupted run; over the process-group
    transfer, one teacher sending to two replicas equal to the replicas and two teachers sending
    to one student equal to the one pair (the teachers' count does not change what they send).
    Also the metrics a run logs."""
    from orchestration import driver
    from orchestration.placement import Layout
    from helpers import check_one_process_a_pair

    layout = dict(teacher_workers=2, student_workers=2, micro_batches=2, student_layers=2, steps=4,
                  checkpoint_every=2)
    whole = driver.run(_tiny(tmp_path, "apart", eval_every=2, **layout), progress=False, return_parameters=True)
    vectors = whole["student_parameters"]
    assert whole["placement"] == "colocated" and len(vectors) == 2
    assert torch.equal(vectors[0], vectors[1]), "data-parallel replicas differ"
    rows = [json.loads(line) for line in open(whole["metrics"])]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["grad_norm"] > 0 and row["lr"] > 0 and 0 <= row["teacher_tail_mass"] <= 1 and
               row["student-1_peak_rss_mib"] > 0 and row["teacher-1_peak_rss_mib"] > 0 for row in rows)
    assert [("held_out_ce" in row, "held_out_kd" in row) for row in rows] == [(False, False), (True, True)] * 2
    assert rows[-1]["held_out_ce"] == pytest.approx(whole["student_held_out_ce"], rel=1e-6)

    sharded = dict(layout, placement="fused", student_strategy="fsdp2")
    fused = driver.run(_tiny(tmp_path, "fused", **sharded), progress=False, return_parameters=True)
    assert fused["placement"] == "fused" and len(fused["student_parameters"]) == 2
    assert torch.equal(*fused["student_parameters"])  # gathered on each rank
    torch.testing.assert_close(fused["student_parameters"][0], vectors[0], rtol=1e-5, atol=1e-6)
    check_one_process_a_pair(tmp_path / "fused", 2)
    # the same global batch on one worker (a fused pair, trains as one apart: test_driver_fused.py)
    one = driver.run(_tiny(tmp_path, "one", **dict(layout, placement="fused", teacher_workers=1, student_workers=1)),
                     progress=False, return_parameters=True)
    torch.testing.assert_close(fused["student_parameters"][0], one["student_parameters"][0], rtol=1e-5, atol=1e-6)
    stopped = driver.run(_tiny(tmp_path, "resumed", stop_after=1, **sharded), progress=False)
    assert stopped["last_step"] == 1
    resumed = driver.run(_tiny(tmp_path, "resumed", resume=True, **sharded), progress=False, return_parameters=True)
    assert resumed["last_step"] == 3
    for vector in resumed["student_parameters"]:
        assert torch.equal(vector, fused["student_parameters"][0]), "the resumed run differs from the uninterrupted one"

    # the NCCL transfer's protocol (one process group of teachers and students, a pair handshake,
    # isend / recv in micro-batch order, a gradient subgroup of the students), run with gloo
    monkeypatch.setattr(driver, "resolve_layout", lambda *args, **options: Layout("disaggregated", "nccl", 0.0, 0.0))
    for teachers, students, expected in ((1, 2, vectors[0]), (2, 1, one["student_parameters"][0])):
        by_group = driver.run(_tiny(tmp_path, f"group_{teachers}{students}", **dict(
            layout, teacher_workers=teachers, student_workers=students, checkpoint_every=0)), progress=False,
            return_parameters=True)
        assert by_group["transfer"] == "nccl" and len(by_group["student_parameters"]) == students
        for vector in by_group["student_parameters"]:
            assert torch.equal(vector, expected), f"{teachers} -> {students} over the process group differs"


def test_gpu_layouts_the_machine_cannot_honour_are_refused():
    from orchestration.placement import resolve_layout

    with pytest.raises(ValueError, match="one GPU per worker"):
        resolve_layout("disaggregated", "auto", "cuda", 1, 1, 1)
    with pytest.raises(ValueError, match="nccl cannot connect two workers on one GPU"):
        resolve_layout("colocated", "nccl", "cuda", 1, 1, 1)
    with pytest.raises(ValueError, match="needs CUDA devices"):
        resolve_layout("auto", "cuda_ipc", "cpu", 0, 1, 1)
    assert resolve_layout("auto", "auto", "cuda", 2, 1, 1).transfer == "cuda_ipc"  # colocated first
    assert resolve_layout("auto", "auto", "cuda", 3, 1, 2).transfer == "nccl"  # 1 teacher, 2 students: a GPU each
    assert resolve_layout("disaggregated", "auto", "cuda", 2, 1, 1).transfer == "nccl"
    assert resolve_layout("auto", "auto", "cuda", 1, 1, 1).transfer == "cuda_ipc"
