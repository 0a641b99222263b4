"""The driver at scale on CPU (gloo): local Hugging Face checkpoints in and out with FSDP2
students, pre-tokenized packed data, epochs, and joining a Ray cluster (FSDP2 on two ranks,
trained and resumed: test_orchestration.py)."""
import json

import pytest
import torch

from helpers import stopped_copy
from helpers_hf import LM_HEAD_ROWS, VOCAB, save_checkpoint, tiny_tokenizer
from orchestration.errors import UsageError
from test_orchestration import _tiny as tiny_config


SCALE = dict(max_corpus_bytes=40_000, row_tokens=16, rows_per_micro_batch=2, teacher_pretrain_steps=2,
             student_layers=2, steps=4, warmup_steps=1, checkpoint_every=2, student_strategy="fsdp2")


def _tiny(tmp_path, name, **overrides):
    return tiny_config(tmp_path, name, **{**SCALE, **overrides})


def _documents(path, count=30, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with open(path, "w") as handle:
        for _ in range(count):
            length = int(torch.randint(3, 12, (), generator=generator))
            handle.write(json.dumps({"input_ids": torch.randint(3, VOCAB, (length,), generator=generator).tolist()})
                         + "\n")
    return str(path)


@pytest.mark.slow  # two driver runs of 7 steps
def test_epochs_set_the_steps_and_a_resume_across_an_epoch_boundary_is_exact(ray_cluster, tmp_path):
    from orchestration.driver import run

    data = _documents(tmp_path / "docs.jsonl")
    # 4 rows a step (2 micro-batches of 2) over the ~13 packed training rows: passes end inside steps
    epochs = dict(data_path=data, epochs=2, steps=1, student_strategy="replica", checkpoint_every=2,
                  placement="fused")
    whole = run(_tiny(tmp_path, "whole", **epochs), progress=False, return_parameters=True)
    assert whole["steps"] == -(-2 * whole["train_rows"] // 4) == whole["last_step"] + 1
    assert whole["train_rows"] % 4  # the first pass ends inside a step
    stopped_copy(tmp_path / "whole", tmp_path / "resumed", 1)  # as if stopped after step 1, in the first pass
    resumed = run(_tiny(tmp_path, "resumed", resume=True, **epochs), progress=False, return_parameters=True)
    assert resumed["last_step"] == whole["last_step"]
    assert torch.equal(resumed["student_parameters"][0], whole["student_parameters"][0])


def test_hf_checkpoints_and_pre_tokenized_data_train_and_export(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from orchestration.driver import run

    teacher = save_checkpoint(tmp_path / "teacher", "qwen2", seed=0)
    student = save_checkpoint(tmp_path / "student", "qwen2", seed=1)
    data = _documents(tmp_path / "docs.jsonl")
    config = _tiny(tmp_path, "hf", teacher_path=teacher, student_path=student, data_path=data, export=True,
                   placement="fused", teacher_workers=2, student_workers=2, steps=3)
    summary = run(config, progress=False, return_parameters=True)
    assert summary["vocab"] == VOCAB and summary["train_rows"] > 0
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    exported = AutoModelForCausalLM.from_pretrained(summary["export"], local_files_only=True)
    assert exported.get_output_embeddings().weight.shape[0] == LM_HEAD_ROWS
    vector = torch.cat([p.detach().reshape(-1) for p in exported.parameters()])
    assert torch.equal(vector, summary["student_parameters"][0])
    assert (tmp_path / "hf" / "final" / "tokenizer.json").exists()


def test_a_student_tokenizer_that_differs_is_refused_before_any_work(tmp_path):
    from orchestration.driver import run

    teacher = save_checkpoint(tmp_path / "teacher")
    student = save_checkpoint(tmp_path / "student", tokenizer=tiny_tokenizer(swap=("w3", "w4")))
    with pytest.raises(UsageError) as caught:
        run(_tiny(tmp_path, "mismatch", teacher_path=teacher, student_path=student), progress=False)
    assert len(caught.value.lines) == 1 and "vocabularies differ" in caught.value.lines[0]
    assert not (tmp_path / "mismatch").exists()  # refused before the output directory or any worker


def test_bench_e2e_throughput_runs_tiny_on_the_cpu(ray_cluster, tmp_path):
    import sys

    sys.path.insert(0, "benchmarks")
    from bench_e2e_throughput import FLOOR, main

    results = tmp_path / "rows.jsonl"
    rows = main(["--tiny", "--strategies", "fsdp2", "--placements", "fused", "--output-dir", str(tmp_path / "bench"),
                 "--results", str(results)])
    assert [row["provider"] for row in rows] == [FLOOR, "single process, kd_kernels", f"{FLOOR}, packed",
                                                 "single process, kd_kernels, packed", "driver fused (fsdp2)"]
    assert all(row["tokens_per_s"] > 0 and row["peak_mib"] > 0 for row in rows)
    assert all(rows[-1][f"{part}_ms"] > 0 for part in ("teacher", "student"))  # the step's parts are recorded
    assert len(results.read_text().splitlines()) == 5


def test_address_joins_a_cluster_through_ray_address(monkeypatch, tmp_path):
    import orchestrate
    import orchestration.driver

    seen = []

    def fake_run(config):
        seen.append(config.ray_address)
        raise UsageError(["stopped by the test"])

    monkeypatch.setattr(orchestration.driver, "run", fake_run)
    assert orchestrate.main(["--address", "10.0.0.5:6379", "--set", f"output_dir={tmp_path}"]) == 2
    assert seen == ["10.0.0.5:6379"]
