"""The on-policy / GKD driver (orchestration/onpolicy.py) end to end on CPU, the weights pushed
into the rollouts' shared memory or broadcast over gloo: lmbda 0 trains exactly as
mode=off_policy, a resume mid-round equals an uninterrupted run (samples, GKD choices, weight
versions, parameters), a dead rollout worker is named, the CLI prints the teacher's reverse KL.
The parts (weight sync, rollout worker, schedule, chat data) have their own tests."""
import json
import math
import os
import re
import threading
import time

import pytest
import torch

from orchestration.config import Config
from orchestration.gkd import GkdSchedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")




TINY = dict(device="cpu", max_corpus_bytes=60_000, tokenizer_vocab=300, row_tokens=64, rows_per_micro_batch=2,
            micro_batches=2, teacher_hidden=32, teacher_layers=1, teacher_pretrain_steps=3, student_hidden=16,
            student_layers=1, heads=2, steps=6, k=8, warmup_steps=2, checkpoint_every=0, max_new_tokens=6,
            max_prompt_tokens=58)


@pytest.mark.parametrize("options, message", [
    (dict(mode="gkd", lmbda=1.5), r"^lmbda: expected a probability in \[0, 1\], got 1.5$"),
    (dict(mode="on_policy", top_p=1.5), r"^top_p: expected a value in \(0, 1\], got 1.5$"),
    (dict(mode="gkd", max_prompt_tokens=100), r"^max_prompt_tokens \+ max_new_tokens: expected at most row_tokens "
                                              r"\(128, the built models' positions\), got 148$"),
    (dict(mode="gkd", max_staleness=2), r"^max_staleness: expected one of 0, 1, got 2$"),
])
def test_bad_on_policy_options_are_refused_before_any_work(options, message):
    from orchestration.errors import UsageError

    with pytest.raises(UsageError) as raised:
        Config(**options)
    assert len(raised.value.lines) == 1 and re.match(message, raised.value.lines[0]), raised.value.lines
    Config(**dict(options, mode="off_policy", lmbda=0.5, top_p=1.0, max_staleness=0))  # the length rule: on-policy only


def _tiny(tmp_path, name, **overrides):
    return Config(**dict(TINY, output_dir=str(tmp_path / name), **overrides))


def _rows(summary):
    from orchestration.metrics_log import read_rows

    return read_rows(summary["metrics"])


@pytest.mark.slow
def test_lmbda_zero_trains_exactly_as_off_policy(ray_cluster, tmp_path):
    """Every GKD round off-policy: the dataset steps are the off-policy driver's steps, with
    sft_alpha as their CE weight, so the losses match step by step and the weights bit for bit.
    Two tiny driver runs (the off-policy one fused: one process), about 40 s on 2 cores."""
    from orchestration.driver import run

    off = run(_tiny(tmp_path, "off", ce_weight=0.25, placement="fused"), progress=False, return_parameters=True)
    gkd = run(_tiny(tmp_path, "gkd", mode="gkd", lmbda=0.0, sft_alpha=0.25, ce_weight=0.9), progress=False,
              return_parameters=True)
    assert [row["loss"] for row in _rows(gkd)] == [row["loss"] for row in _rows(off)]
    assert not any(row["on_policy"] for row in _rows(gkd))
    assert torch.equal(gkd["student_parameters"][0], off["student_parameters"][0])
    assert gkd["weight_version"] == 6  # only the final evaluation synced the rollouts


@pytest.mark.slow
def test_a_gkd_run_resumed_mid_round_equals_an_uninterrupted_one(ray_cluster, tmp_path, monkeypatch):
    """Rounds of two steps, one round of staleness: resumed from the checkpoint of step 2 (the
    first step of round 1, saved with round 2 generating; the run's later checkpoints removed, as
    a stop there leaves it), the resume trains step 3 on the kept samples of round 1 and round 2
    on the samples generated before the checkpoint, as the uninterrupted run does. Also the
    end-to-end checks of a GKD run (finite losses, weight versions, sync metrics). Two tiny
    driver runs: the first pushes the weights into the rollout's shared memory, the resumed one
    broadcasts them over gloo (bit-equal results: both transports are exact copies)."""
    from helpers import stopped_copy
    from orchestration.driver import run
    from orchestration.onpolicy import OnPolicySession

    options = dict(mode="gkd", lmbda=0.5, steps_per_generation=2, max_staleness=1, seed=2, checkpoint_every=3)
    schedule = GkdSchedule("gkd", 0.5, 0.0, 2, 1, 2)
    on_policy = [schedule.plan(step).on_policy for step in range(6)]
    assert on_policy[2:6] == [True] * 4 and not all(on_policy)  # the seed exercises both kinds of steps

    whole = run(_tiny(tmp_path, "whole", **options), progress=False, return_parameters=True)
    rows = _rows(whole)
    assert [row["on_policy"] for row in rows] == on_policy
    assert all(math.isfinite(row["loss"]) and row["loss"] > 0 for row in rows)
    generated = [row for row in rows if row["on_policy"]]
    # round r + 1 is generated on the weights at the start of round r: one round stale at most
    assert [row["weight_version"] for row in generated] == [2, 2, 2, 2]
    assert [row["staleness"] for row in generated] == [0, 1, 2, 3]
    assert all(row["sample_weight_versions"] == [2] * 4 for row in generated)
    synced = [row for row in rows if "sync_bytes" in row]
    assert synced and all(row["sync_buckets"] >= 1 and row["sync_bytes"] > 0 and row["sync_gb_per_s"] > 0
                          for row in synced)
    assert whole["weight_version"] == 6 and whole["weight_sync"] == "shared_memory"
    assert all(row["sync_buckets"] == 1 and "sync_lock_wait_seconds" in row for row in synced)
    assert math.isfinite(whole["teacher_reverse_kl"]) and whole["teacher_reverse_kl"] >= 0

    stopped_copy(tmp_path / "whole", tmp_path / "resumed", 2)
    # the resumed run broadcasts over a gloo weight group, as rollouts on another node take the weights
    monkeypatch.setattr(OnPolicySession, "weight_transport", lambda self, device, gpus, nodes: "gloo")
    resumed = run(_tiny(tmp_path, "resumed", resume=True, **options), progress=False, return_parameters=True)
    assert resumed["weight_sync"] == "gloo"
    again = _rows(resumed)
    assert [row["step"] for row in again] == list(range(6))
    for key in ("loss", "on_policy", "tokens"):
        assert [row[key] for row in again] == [row[key] for row in rows], key
    assert [row.get("weight_version") for row in again] == [row.get("weight_version") for row in rows]
    assert torch.equal(resumed["student_parameters"][0], whole["student_parameters"][0])
    assert resumed["teacher_reverse_kl"] == whole["teacher_reverse_kl"]


def test_a_dead_rollout_worker_stops_the_run_naming_it(ray_cluster, tmp_path):
    from orchestration.driver import run
    from orchestration.errors import WorkerDied

    config = _tiny(tmp_path, "dies", mode="on_policy", steps=200)
    metrics = os.path.join(config.output_dir, "metrics.jsonl")

    def kill_the_rollout_after_two_steps():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2:
                with open(os.path.join(config.output_dir, "workers.json")) as handle:
                    os.kill(json.load(handle)["rollout-0"]["pid"], 9)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_rollout_after_two_steps, daemon=True)
    killer.start()
    with pytest.raises(WorkerDied) as raised:
        run(config, progress=False)
    killer.join()
    message = str(raised.value)
    assert re.fullmatch(r"worker rollout-0 died at step \d+; last good checkpoint: none", message), message
    assert "\n" not in message


def test_the_cli_runs_on_policy_with_opsd_prompts_and_prints_the_teachers_reverse_kl(ray_cluster, tmp_path, capsys):
    """prompts_path records with a teacher_prompt (OPSD): the teacher scores the student's
    responses under its own, longer prompt."""
    import orchestrate

    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as handle:
        for name, body in (("add", "a + b"), ("sub", "a - b"), ("mul", "a * b"), ("mod", "a % b")):
            prompt = f'def {name}(a, b):\n    """Return {body}."""\n'
            handle.write(json.dumps(dict(prompt=prompt, teacher_prompt=f"# {name}: {body}\n{prompt}")) + "\n")
    settings = [f"{key}={value}" for key, value in dict(TINY, output_dir=str(tmp_path / "cli"), steps=3,
                                                        mode="on_policy", prompts_path=str(prompts)).items()]
    assert orchestrate.main([argument for setting in settings for argument in ("--set", setting)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"teacher's reverse KL of student samples \(held-out prompts, nats/token\): \d+\.\d{4} over "
                     r"\d+ tokens \(on_policy, weight_version 3\); over the teacher's top-8 and tail bins: "
                     r"\d+\.\d{4}\n", out), out
    with open(tmp_path / "cli" / "summary.json") as handle:
        summary = json.load(handle)
    assert summary["weight_version"] == 3
    assert 0 <= summary["teacher_reverse_kl_top_k"] <= summary["teacher_reverse_kl"]  # fewer bins see less


@pytest.mark.slow
def test_the_onpolicy_throughput_bench_runs_tiny_on_the_cpu_row_by_row(ray_cluster, tmp_path):
    """`bench_e2e_throughput.py --onpolicy --tiny`: each chosen row appended when done; the step's
    parts are each measured (none negative) and their sum stays within the step."""
    import sys

    sys.path.insert(0, "benchmarks")
    from bench_e2e_throughput import ONPOLICY_PARTS, main

    results = tmp_path / "rows.jsonl"
    tiny = [f"{key}={value}" for key, value in TINY.items() if key not in ("device", "steps", "checkpoint_every")]
    rows = main(["--onpolicy", "--tiny", "--onpolicy-rows", "generation,default", "--steps", "3", "--warmup", "1",
                 "--output-dir", str(tmp_path / "bench"), "--results", str(results),
                 *[argument for option in tiny for argument in ("--set", option)]])
    assert [row["provider"] for row in rows] == ["plain HF generate", "rollout worker", "bare KV-cached loop (torch)",
                                                 "driver, on_policy"]
    assert all(row["tokens_per_s"] > 0 for row in rows)
    driver = rows[-1]
    assert all(driver[part] >= 0 for part in ONPOLICY_PARTS) and driver["generate_seconds"] > 0
    assert driver["sync_wall_seconds"] > 0 and driver["sync_transport"] == "shared_memory"  # steps 1 and 2 synced
    assert 0 <= driver["rest_seconds"] < driver["step_mean_seconds"]
    assert 0 < driver["loop_seconds"] < driver["run_seconds"] and driver["response_tokens"] > 0
    assert driver["shape"]["setup"] and driver["shape"]["max_new_tokens"] == TINY["max_new_tokens"]
    assert [json.loads(line)["provider"] for line in results.read_text().splitlines()] == [
        row["provider"] for row in rows]
