"""placement=fused: each teacher / student pair in one Ray actor, top-k handed over in
process. It trains exactly as the two-actor placement does, resumes, names its workers,
and refuses the combinations it cannot run."""

import pytest
import torch

import kd_kernels as kd
from helpers import check_one_process_a_pair
from orchestration.errors import UsageError
from test_orchestration import _tiny

FEW = dict(steps=4, checkpoint_every=2)


def test_in_process_transfer_hands_the_topk_over_in_bf16_and_release_drops_leftovers():
    from orchestration.transfer import _IN_PROCESS, transfer_for

    logprobs = torch.log_softmax(torch.randn(6, 40), -1).topk(5).values
    top = kd.TopK(logprobs, torch.randint(0, 40, (6, 5), dtype=torch.int32), torch.randn(6), 2.0)
    teacher, student = transfer_for("in_process"), transfer_for("in_process")
    first, second = teacher.send(top, step=3, student_rank=0), teacher.send(top, step=3, student_rank=0)
    back = student.receive(first, torch.device("cpu"))
    assert torch.equal(back.logprobs, logprobs.to(torch.bfloat16)) and back.indices is top.indices
    assert back.lse is top.lse and back.temperature == 2.0
    with pytest.raises(KeyError, match="was not sent in this process"):
        student.receive(first, torch.device("cpu"))  # popped: received once
    teacher.release(2)
    assert second in _IN_PROCESS  # a later step's top-k stays
    teacher.release(3)
    assert second not in _IN_PROCESS


def test_a_fused_pair_builds_a_micro_batchs_attention_mask_once_and_shares_it():
    from orchestration import workers
    from orchestration.fused import FusedWorker

    built = []
    real = workers.layout_of

    def counted(*args):
        built.append(args[-1])
        return real(*args)

    rows = torch.randint(3, 50, (6, 8))
    documents = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]).repeat(6, 1)
    positions = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]).repeat(6, 1)
    pair = FusedWorker([("teacher", workers.Worker, ()), ("student", workers.Worker, ())])
    for role in ("teacher", "student"):
        pair.call(role, "set_rows", rows, rows, positions, documents)
    cpu, pick, other = torch.device("cpu"), torch.tensor([4, 1]), torch.tensor([1, 4])
    workers.layout_of, saved = counted, workers.layout_of
    try:
        first = pair.call("teacher", "row_layout", pick, cpu, "sdpa")
        second = pair.call("student", "row_layout", pick, cpu, "sdpa")
        assert len(built) == 1 and second[1] is first[1] and second[0] is first[0]
        pair.call("student", "row_layout", pick, cpu, "sdpa")  # dropped at its second use: built again
        pair.call("student", "row_layout", other, cpu, "sdpa")  # another pick, another mask
        pair.call("student", "row_layout", pick, cpu, "eager")  # another implementation
        assert built == ["sdpa", "sdpa", "sdpa", "eager"]
        pair.call("teacher", "row_layout", other, cpu, "sdpa", False)  # unshared: built, not kept
        pair.call("student", "row_layout", other, cpu, "sdpa")  # the kept one
        assert len(built) == 5
        pair.call("teacher", "set_rows", rows, rows, positions, documents)  # new rows: nothing kept
        pair.call("student", "row_layout", pick, cpu, "eager")
        assert len(built) == 6
    finally:
        workers.layout_of = saved
    expected = real(positions[pick], documents[pick], cpu, "sdpa")
    assert torch.equal(first[0], expected[0]) and torch.equal(first[1], expected[1])
    assert bool(first[1][0, 0, 4, 3]) and not bool(first[1][0, 0, 3, 2])  # block-diagonal causal

    layouts = workers.SharedLayouts(capacity=2)
    for index in range(3):
        layouts.get(torch.tensor([index]), cpu, "sdpa", lambda index=index: index)
    assert layouts.get(torch.tensor([0]), cpu, "sdpa", lambda: "again") == "again"  # the oldest went first
    assert layouts.get(torch.tensor([2]), cpu, "sdpa", lambda: "again") == 2
    with pytest.raises(ValueError, match="capacity: expected >= 1, got 0"):
        workers.SharedLayouts(capacity=0)


def test_fused_actors_route_calls_by_worker_name_and_name_the_worker_that_raised(ray_cluster):
    import os

    import ray

    from orchestration.actors import Actors
    from orchestration.errors import WorkerFailed

    class Role:  # defined here: Ray sends the class itself to the workers
        def __init__(self, name):
            self.name = name

        def pid(self):
            return self.name, os.getpid()

        def fail(self):
            raise ValueError(f"{self.name} failed")

    actors = Actors(ray, lambda: None)
    try:
        names = actors.start_fused([("teacher", Role), ("student", Role)], 2, dict(num_cpus=0),
                                   lambda role, rank: (f"{role} {rank}",))
        assert names == dict(teacher=["teacher-0", "teacher-1"], student=["student-0", "student-1"])
        assert sorted(actors.handles) == ["teacher-0+student-0", "teacher-1+student-1"]
        answers = actors.get([actors.call(worker, "pid") for worker in ("teacher-1", "student-1", "student-0")],
                             "during setup")
        assert [name for name, _ in answers] == ["teacher 1", "student 1", "student 0"]
        assert answers[0][1] == answers[1][1] != answers[2][1]  # one process a pair
        with pytest.raises(WorkerFailed, match=r"^worker student-1 failed at step 3: ValueError: student 1 failed$"):
            actors.get([actors.call("teacher-0", "pid"), actors.call("student-1", "fail")], "at step 3")
    finally:
        actors.kill_all()


def test_fused_trains_exactly_like_the_two_actor_placement(ray_cluster, tmp_path):
    """One pair on packed documents (its teacher and student share each micro-batch's mask); two
    pairs (FSDP2, resumed), and a fused pair's death: test_orchestration.py."""
    import numpy as np

    from orchestration.driver import run
    from orchestration.packing import from_lists, save_token_documents

    generator = np.random.default_rng(0)
    documents = [generator.integers(3, 300, int(generator.integers(5, 50))) for _ in range(60)]
    layout = dict(micro_batches=2, data_path=save_token_documents(str(tmp_path / "documents.npy"),
                                                                  from_lists(documents)), **FEW)
    apart = run(_tiny(tmp_path, "apart", **layout), progress=False, return_parameters=True)
    fused = run(_tiny(tmp_path, "fused", placement="fused", **layout), progress=False, return_parameters=True)
    assert (fused["placement"], fused["transfer"]) == ("fused", "in_process")
    assert apart["placement"] == "colocated"
    assert torch.equal(fused["student_parameters"][0], apart["student_parameters"][0])
    check_one_process_a_pair(tmp_path / "fused", 1)


@pytest.mark.parametrize("overrides, message", [
    (dict(teacher_workers=1, student_workers=2), "placement: fused holds one teacher and one student worker in each "
                                                 "process: needs teacher_workers == student_workers, got 1 and 2"),
    (dict(transfer="object_store"), "transfer: placement fused hands top-k over inside its process: use in_process "
                                    "(or auto), got 'object_store'"),
    (dict(mode="gkd"), "placement: fused runs mode off_policy"),
    (dict(teacher_cache="/nonexistent"), "placement: fused pairs a live teacher with each student"),
    (dict(mode="cache", teacher_cache="/nonexistent"), "placement: fused pairs a teacher with a student; mode cache"),
    (dict(teacher_workers=2, student_workers=2, micro_batches=3), "micro_batches"),
])
def test_fused_refuses_what_it_cannot_run(tmp_path, overrides, message):
    from orchestration.config import check_machine

    try:  # the rules refuse when the Config is built, the machine's checks before a run starts
        problems = check_machine(vars(_tiny(tmp_path, "refused", placement="fused", **overrides)), set())
    except UsageError as error:
        problems = error.lines
    assert any(line.startswith(message) for line in problems), problems


def test_fused_layouts_on_gpus():
    from orchestration.placement import resolve_layout

    assert resolve_layout("fused", "auto", "cuda", 2, 2, 2) == resolve_layout("fused", "in_process", "cuda", 2, 2, 2)
    assert resolve_layout("fused", "auto", "cuda", 2, 2, 2).gpus_per_student == 1.0
    # auto: fused for off-policy runs from a live teacher (fused_allowed), else colocated
    assert resolve_layout("auto", "auto", "cuda", 2, 2, 2).placement == "colocated"
    assert resolve_layout("auto", "auto", "cuda", 2, 2, 2, fused_allowed=True) == \
        resolve_layout("fused", "auto", "cuda", 2, 2, 2)
    assert resolve_layout("auto", "cuda_ipc", "cuda", 2, 2, 2, fused_allowed=True).placement == "colocated"
    assert resolve_layout("auto", "auto", "cuda", 4, 1, 3, fused_allowed=True).placement == "disaggregated"
    assert resolve_layout("auto", "auto", "cpu", 0, 1, 1, fused_allowed=True).placement == "colocated"
    with pytest.raises(ValueError, match="fused takes one GPU per teacher / student pair: needs student_workers <= "
                                         "GPUs, got 3 and 2 GPUs"):
        resolve_layout("fused", "auto", "cuda", 2, 3, 3)
    with pytest.raises(ValueError, match="transfer: 'in_process' hands top-k over inside one process; it needs "
                                         "placement=fused"):
        resolve_layout("colocated", "in_process", "cuda", 1, 1, 1)
