"""Held-out CE and KD, the monitoring values, the metrics log with TensorBoard, and
benchmarks/plot_run.py."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import kd_kernels as kd
from helpers_hf import VOCAB, tiny_causal_lm
from orchestration.distillation import DistillationStudent
from orchestration.metrics_log import MetricsLog
from orchestration.metrics import (Throughput, held_out_losses, memory_mib, should_evaluate,
                                   teacher_tail_mass)
from orchestration.packing import PackedRows, attention_mask, from_lists

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_held_out_ce_and_kd_equal_the_full_logits_computation():
    documents = from_lists([[3 + (7 * d + t) % 80 for t in range(5 + d)] for d in range(6)])
    rows = PackedRows(documents, 12, eos_id=1, pad_id=0, shuffle=False)
    batches = [rows.batch([(0, 0), (0, 1)]), rows.batch([(0, 2), (0, 3)])]
    generator = torch.Generator().manual_seed(0)
    teachers = [kd.teacher_topk_from_logits(torch.randn(24, VOCAB, generator=generator) * 2, 6) for _ in batches]
    model = tiny_causal_lm("llama", attention="eager")
    student = DistillationStudent(model, vocab_size=VOCAB, ce_weight=1.0).train()
    masks = [attention_mask(batch.document_ids, "eager") for batch in batches]
    result = held_out_losses(student, batches, teachers, attention_masks=masks)
    assert student.training  # restored

    ce_sum = kd_sum = tokens = 0.0
    with torch.no_grad():
        for batch, teacher, mask in zip(batches, teachers, masks):
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                           attention_mask=mask).logits.reshape(-1, model.config.vocab_size)[:, :VOCAB].double()
            labels = batch.labels.reshape(-1)
            ce_sum += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            per_row = kd.topk_divergence_from_logits(logits, teacher, labels, reduction="none")
            kd_sum += per_row.sum().item()
            tokens += (labels != -100).sum().item()
    assert result["held_out_tokens"] == tokens == sum(batch.num_tokens for batch in batches)
    assert result["held_out_ce"] == pytest.approx(ce_sum / tokens, rel=1e-5)
    assert result["held_out_kd"] == pytest.approx(kd_sum / tokens, rel=1e-5)
    with pytest.raises(ValueError, match="one of each per batch"):
        held_out_losses(student, batches, teachers[:1])


def test_monitoring_values():
    assert [step for step in range(1, 11) if should_evaluate(step, 4, 10)] == [4, 8, 10]
    assert [step for step in range(1, 11) if should_evaluate(step, 0, 10)] == [10]
    with pytest.raises(ValueError, match="every"):
        should_evaluate(1, -1, 10)
    top = kd.teacher_topk_from_logits(torch.randn(5, 40), 4)
    metrics = {"teacher_mass_sum": (1 - top.tail_mass).sum(), "rows": torch.tensor(5.0)}
    assert teacher_tail_mass(metrics) == pytest.approx(top.tail_mass.mean().item(), rel=1e-6)
    stats = memory_mib(torch.device("cpu"))
    assert set(stats) == {"peak_rss_mib"} and 10 < stats["peak_rss_mib"] < 1e6
    throughput = Throughput()
    assert throughput.tick(1000) > 0


def test_metrics_log_writes_jsonl_and_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")  # optional: pip install tensorboard
    log = MetricsLog(str(tmp_path / "metrics.jsonl"), tensorboard=True)
    for step in range(3):
        log.write({"step": step, "loss": 2.0 - step / 10, "lr": 1e-3, "note": "text", "held_out_ce": None})
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [row["loss"] for row in rows] == [2.0, 1.9, 1.8]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr"]
    assert [round(event.value, 5) for event in events.Scalars("loss")] == [2.0, 1.9, 1.8]
    with pytest.raises(ValueError, match="int 'step' key"):
        MetricsLog(str(tmp_path / "metrics.jsonl")).write({"loss": 1.0})


def test_metrics_log_without_tensorboard_warns_once_and_writes_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        log = MetricsLog(str(tmp_path / "metrics.jsonl"), tensorboard=True)
    log.write({"step": 0, "loss": 1.0})
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_plot_run_draws_a_png_from_a_metrics_log(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # optional: pip install matplotlib
    with open(tmp_path / "metrics.jsonl", "w") as handle:
        for step in range(12):
            row = {"step": step, "loss": 3 - step / 10, "kd": 1 - step / 20, "ce": 2 - step / 12, "lr": 1e-3,
                   "tokens_per_s": 1000 + step}
            if step % 4 == 3:
                row["held_out_ce"] = 2.5 - step / 20
            handle.write(json.dumps(row) + "\n")
    plot_run = _plot_run_module()
    plot_run.main([str(tmp_path), "-o", str(tmp_path / "run.png")])
    assert "loss, kd, ce, held_out_ce, tokens_per_s, lr over 12 steps" in capsys.readouterr().out
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "run.png").stat().st_size > 10_000
    with pytest.raises(SystemExit) as exited:
        plot_run.main(["--help"])
    assert exited.value.code == 0 and "metrics.jsonl" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"none of the keys \['nothing'\]"):
        plot_run.main([str(tmp_path), "--keys", "nothing"])


def _plot_run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", os.path.join(ROOT, "benchmarks", "plot_run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
