"""The Ray driver's parts: config, comm plan, label shifting and packing, object-store
transfer, checkpoint / resume equality, and a dead worker (CPU, tiny sizes)."""
import math

import numpy as np
import pytest
import torch

import kd_kernels as kd
from orchestration.comm_plan import CommPlan
from orchestration.config import Config, help_text, load_config
from orchestration.data import (IGNORE_INDEX, Document, encode, encode_all, pack, shifted_labels, stdlib_sources,
                                train_tokenizer)

ray = pytest.importorskip("ray")


# ---- config ---------------------------------------------------------------------------

def test_config_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nk: 16\n")
    config = load_config(str(path), ["output_dir=runs/x", "lr=0.01", "overlap=false", "k=8"])
    assert (config.steps, config.k, config.output_dir, config.lr, config.overlap) == (7, 8, "runs/x", 0.01, False)
    assert Config().steps == load_config(None, ["device=cpu"]).steps
    with pytest.raises(ValueError, match="unknown"):
        path.write_text("stepz: 1\n")
        load_config(str(path))
    with pytest.raises(ValueError, match="steps"):
        load_config(None, ["steps=many"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["nokey"])
    optional = load_config(None, ["teacher_lr=1e-3", "stop_after=5", "teacher_path=null"])  # typed by annotation
    assert (optional.teacher_lr, optional.stop_after, optional.teacher_path) == (1e-3, 5, None)
    assert isinstance(optional.teacher_lr, float)
    with pytest.raises(ValueError, match="teacher_lr"):
        load_config(None, ["teacher_lr=fast"])
    assert all(f"  {name} (" in help_text() for name in ("steps", "output_dir", "transfer", "k"))


def test_the_attention_option_builds_that_attention():
    from orchestration.workers import build_model

    for attention in ("eager", "sdpa"):
        model = build_model(None, 32, 1, Config(heads=4, attention=attention), 100, seed=0)
        assert model.config._attn_implementation == attention
    with pytest.raises(ValueError, match="attention: expected sdpa or eager, got 'flash'"):
        Config(attention="flash")


def test_gpu_defaults_apply_on_cuda_only_where_not_set(monkeypatch):
    from orchestration.config import GPU_DEFAULTS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = load_config(None, ["steps=5"])
    assert on_gpu.steps == 5  # set explicitly: kept
    assert (on_gpu.teacher_hidden, on_gpu.row_tokens) == (GPU_DEFAULTS["teacher_hidden"], GPU_DEFAULTS["row_tokens"])
    on_cpu = load_config(None, ["device=cpu"])
    assert (on_cpu.teacher_hidden, on_cpu.row_tokens) == (Config().teacher_hidden, Config().row_tokens)


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
                                                               (2, 4, 6, "num_micro_batches"), (0, 1, 1, "teacher")])
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
    batched = encode_all(records, tokenizer, template)
    single = [encode(record, tokenizer, template) for record in records]
    assert [(d.tokens, d.trained) for d in batched] == [(d.tokens, d.trained) for d in single]
    assert all(len(d.tokens) > 3 for d in batched)


def test_stdlib_corpus_reads_the_top_level_first_and_no_installed_packages():
    import os
    import sysconfig

    paths = stdlib_sources()
    root = sysconfig.get_paths()["stdlib"]
    depth = [os.path.relpath(path, root).count(os.sep) for path in paths]
    assert depth == sorted(depth, key=lambda d: d > 0) and depth[0] == 0 and depth[-1] > 0
    assert not any("site-packages" in path for path in paths)


# ---- transfer through the object store -----------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_object_store_transfer_round_trip(ray_cluster):
    from orchestration.transfer import TopKSender, receive_topk

    logprobs = torch.log_softmax(torch.randn(6, 40), -1).topk(5).values
    logprobs[0, -1] = -math.inf
    top = kd.TopK(logprobs, torch.randint(0, 40, (6, 5), dtype=torch.int32), torch.randn(6), 2.0)
    ref = ray.put(TopKSender("object_store").send(top, step=0, student_rank=0))
    fetched = ray.get(ref)
    assert isinstance(fetched[1], np.ndarray) and not fetched[1].flags.writeable  # shared memory, read in place
    back = receive_topk(fetched, torch.device("cpu"))
    assert torch.equal(back.indices, top.indices) and torch.equal(back.logprobs, top.logprobs.to(torch.bfloat16))
    assert back.temperature == 2.0


# ---- runs ---------------------------------------------------------------------------------

def _tiny(tmp_path, name, **overrides):
    values = dict(output_dir=str(tmp_path / name), device="cpu", max_corpus_bytes=60_000, tokenizer_vocab=300, row_tokens=32,
                  rows_per_micro_batch=4, micro_batches=2, teacher_hidden=32, teacher_layers=1,
                  teacher_pretrain_steps=3, student_hidden=16, student_layers=1, heads=2, steps=6, k=8,
                  warmup_steps=2, checkpoint_every=3)
    values.update(overrides)
    return Config(**values)


def test_resume_equals_an_uninterrupted_run(ray_cluster, tmp_path):
    from orchestration.driver import run

    whole = run(_tiny(tmp_path, "whole"), progress=False, return_parameters=True)
    expected = whole["student_parameters"][0]
    # kill after step 2 (of 0..5): the checkpoint at step 2 is the last good one, then resume
    first = run(_tiny(tmp_path, "resumed", stop_after=2), progress=False)
    assert first["last_step"] == 2
    resumed = run(_tiny(tmp_path, "resumed", resume=True), progress=False, return_parameters=True)
    assert resumed["last_step"] == 5
    assert torch.equal(resumed["student_parameters"][0], expected)
    lines = open(resumed["metrics"]).read().splitlines()
    assert len(lines) == 6  # steps 0..2, then 3..5 appended


def test_a_dead_worker_stops_the_run_naming_it_and_the_last_checkpoint(ray_cluster, tmp_path):
    from orchestration.driver import WorkerDied, run

    with pytest.raises(WorkerDied, match=r"student-0 died at step 4; last good checkpoint: .*step_0000002\.pt"):
        run(_tiny(tmp_path, "dies", fail_student_at_step=4), progress=False)


def test_two_teacher_and_two_student_workers_resume_exactly(ray_cluster, tmp_path):
    from orchestration.driver import run

    layout = dict(teacher_workers=2, student_workers=2, micro_batches=2, steps=4, checkpoint_every=2)
    whole = run(_tiny(tmp_path, "dp_whole", **layout), progress=False, return_parameters=True)
    vectors = whole["student_parameters"]
    assert torch.equal(vectors[0], vectors[1])  # data-parallel replicas stay identical
    run(_tiny(tmp_path, "dp_resumed", stop_after=1, **layout), progress=False)
    resumed = run(_tiny(tmp_path, "dp_resumed", resume=True, **layout), progress=False, return_parameters=True)
    for vector in resumed["student_parameters"]:
        assert torch.equal(vector, vectors[0])


def test_uneven_worker_layouts_are_refused(ray_cluster, tmp_path):
    from orchestration.driver import run

    with pytest.raises(ValueError, match="divide"):
        run(_tiny(tmp_path, "uneven", teacher_workers=2, student_workers=3, micro_batches=6), progress=False)


def test_gpu_layouts_the_machine_cannot_honour_are_refused():
    from orchestration.transfer import resolve_layout

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


@pytest.mark.parametrize("teachers, students", [(1, 2), (2, 1)])
def test_process_group_transfer_trains_like_the_object_store(ray_cluster, tmp_path, monkeypatch, teachers,
                                                             students):
    """The NCCL transfer's protocol (one process group of teachers and students, a pair
    handshake, isend / recv in micro-batch order, a gradient subgroup of the students), run
    with gloo on CPU: the same training as the object store."""
    from orchestration import driver
    from orchestration.transfer import Layout

    layout = dict(teacher_workers=teachers, student_workers=students, micro_batches=2, steps=4, checkpoint_every=0)
    by_store = driver.run(_tiny(tmp_path, f"store_{teachers}{students}", **layout), progress=False,
                          return_parameters=True)
    monkeypatch.setattr(driver, "resolve_layout", lambda *args: Layout("disaggregated", "nccl", 0.0, 0.0))
    by_group = driver.run(_tiny(tmp_path, f"group_{teachers}{students}", **layout), progress=False,
                          return_parameters=True)
    assert by_group["transfer"] == "nccl"
    for got, expected in zip(by_group["student_parameters"], by_store["student_parameters"]):
        assert torch.equal(got, expected)
