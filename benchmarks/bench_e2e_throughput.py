"""Throughput of the Ray driver on GPUs against one process doing the same work in PyTorch.

Providers (protocol "median step": the median over the steps after 5 of warm-up):
  single process, full-logits KD (PyTorch)   the floor: the same teacher and student in one
      process, teacher forward, KL over the whole vocab at the temperature + CE, student step
  colocated                 teacher and student workers on one GPU, top-k through CUDA IPC,
                            the teacher scoring step i + 1 while the student trains step i
  colocated, no overlap     the same, one after the other
  disaggregated             a GPU each, top-k through NCCL (when two GPUs are there)
Rows: ``ms`` a step, ``tokens_per_s``, and for the driver the mean seconds a step spends in
the teacher, waiting for it, in the transfer, in the student and in Ray's dispatch;
``teacher_hidden`` = 1 − wait / teacher time, the share of the teacher's time the student did
not wait for. All at the driver's GPU default sizes. Default: 40 steps, ~4 minutes on one H200.

usage: python benchmarks/bench_e2e_throughput.py [--steps 40] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import add_results_arguments, append_rows, environment, print_table, result_row  # noqa: E402
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402
from orchestration.models import build_model  # noqa: E402

BENCHMARK = "bench_e2e_throughput"
FLOOR = "single process, full-logits KD (PyTorch)"
WARMUP = 5
PARTS = ("teacher_seconds", "wait_seconds", "transfer_seconds", "student_seconds", "dispatch_seconds")


def driver_measurement(name, steps, output_dir, extra, *overrides) -> dict:
    # throughput does not depend on how much text the tokenizer and rows come from: 4 MB is quicker
    config = load_config(None, [f"output_dir={output_dir}/{name}", f"steps={steps}", "teacher_pretrain_steps=20",
                                "checkpoint_every=0", "max_corpus_bytes=4000000", "overwrite=true", *extra, *overrides])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle][WARMUP:]
    mean = {key: statistics.mean(r[key] for r in records) for key in PARTS}
    return dict(provider=name, ms=1e3 * statistics.median(r["tokens"] / r["tokens_per_s"] for r in records),
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in records), placement=summary["placement"],
                transfer=summary["transfer"],
                teacher_hidden=min(max(1.0 - mean["wait_seconds"] / max(mean["teacher_seconds"], 1e-9), 0.0), 1.0),
                **mean)


def baseline_measurement(steps, extra) -> dict:
    """One process: teacher forward, full logits, KL + CE, student backward and step."""
    config = load_config(None, ["device=cuda", *extra])
    vocab = config.tokenizer_vocab
    teacher = build_model(None, config.teacher_hidden, config.teacher_layers, config, vocab, 0).cuda().eval()
    student = build_model(None, config.student_hidden, config.student_layers, config, vocab, 1).cuda()
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr)
    rows = config.rows_per_micro_batch * config.micro_batches
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        tokens = torch.randint(0, vocab, (rows, config.row_tokens), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            teacher_logits = teacher(input_ids=tokens).logits[..., :vocab].float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            student_logits = student(input_ids=tokens).logits[..., :vocab].float()
        teacher_logprobs = torch.log_softmax(teacher_logits / config.temperature, -1)
        student_logprobs = torch.log_softmax(student_logits / config.temperature, -1)
        kl = (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1).mean()
        ce = F.cross_entropy(student_logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss = config.kd_weight * kl + config.ce_weight * ce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    step_seconds = statistics.median(times)
    return dict(provider=FLOOR, ms=1e3 * step_seconds, tokens_per_s=rows * config.row_tokens / step_seconds,
                placement="one GPU", transfer="none", peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps a layout (the first 5 are warm-up)")
    parser.add_argument("--output-dir", default="runs/bench_e2e_throughput", help="the driver's runs go here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a driver option for every run (python orchestrate.py --help lists them)")
    add_results_arguments(parser, BENCHMARK)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps: expected more than the {WARMUP} warm-up steps, got {args.steps}")
    if not torch.cuda.is_available():
        sys.exit("bench_e2e_throughput: needs a CUDA device")
    env = environment(args.commit)
    config = load_config(None, ["device=cuda", *args.set])
    shape = dict(name="driver, GPU default", tokens_per_step=config.row_tokens * config.rows_per_micro_batch
                 * config.micro_batches, vocab=config.tokenizer_vocab, k=config.k,
                 teacher=f"{config.teacher_layers} x {config.teacher_hidden}",
                 student=f"{config.student_layers} x {config.student_hidden}", gpus=torch.cuda.device_count())
    measurements = [baseline_measurement(args.steps, args.set),
                    driver_measurement("colocated", args.steps, args.output_dir, args.set, "placement=colocated"),
                    driver_measurement("colocated, no overlap", args.steps, args.output_dir, args.set,
                                       "placement=colocated", "overlap=false")]
    if torch.cuda.device_count() >= 2:
        measurements.append(driver_measurement("disaggregated", args.steps, args.output_dir, args.set,
                                               "placement=disaggregated"))
    floor_ms = measurements[0]["ms"]
    rows = []
    for m in measurements:
        provider, ms = m.pop("provider"), m.pop("ms")
        rows.append(result_row(env, BENCHMARK, shape, provider, "median step", ms, FLOOR, ms / floor_ms, None, **m))
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, {"layout": "provider", "transfer": "transfer", "tokens/s": "tokens_per_s", "step ms": "ms",
                       "× floor (time)": "ratio", **{part.replace("_seconds", " s"): part for part in PARTS},
                       "teacher hidden": "teacher_hidden"})


if __name__ == "__main__":
    main()
