"""Throughput of the Ray driver on GPUs against a single-process baseline.

Layouts: colocated (teacher and student on one GPU, CUDA IPC), colocated with overlap off,
and disaggregated (a GPU each, NCCL, the teacher scoring step i + 1 while the student
trains step i) when two GPUs are there. Baseline: one process, the same teacher and student,
teacher forward + full-logits KD (KL over the whole vocab at τ) + CE in plain PyTorch.
All at the GPU default sizes (orchestration.config.GPU_DEFAULTS). Reports median tokens/s
over the steps after warm-up and the mean seconds a step spends in teacher / transfer /
student, waiting for the teacher and in Ray's dispatch of the student's call (arguments
and reply); "teacher hidden" = 1 − wait / teacher time: the share of
the teacher's time that the student did not wait for.

usage: python benchmarks/bench_e2e_throughput.py [--steps 40] [--out results.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402
from orchestration.workers import build_model  # noqa: E402

WARMUP = 5


def driver_row(name, steps, output_dir, extra, *overrides):
    # throughput does not depend on how much text the tokenizer and rows come from: 4 MB is quicker
    config = load_config(None, [f"output_dir={output_dir}/{name}", f"steps={steps}", "teacher_pretrain_steps=20",
                                "checkpoint_every=0", "max_corpus_bytes=4000000", *extra, *overrides])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle][WARMUP:]
    mean = {key: statistics.mean(r[key] for r in records) for key in ("teacher_seconds", "wait_seconds",
                                                                      "transfer_seconds", "student_seconds",
                                                                      "dispatch_seconds")}
    step_seconds = statistics.median(r["tokens"] / r["tokens_per_s"] for r in records)
    hidden = 1.0 - mean["wait_seconds"] / max(mean["teacher_seconds"], 1e-9)
    return dict(layout=name, placement=summary["placement"], transfer=summary["transfer"],
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in records), step_seconds=step_seconds,
                teacher_hidden=min(max(hidden, 0.0), 1.0), **mean)


def baseline_row(steps, extra):
    """One process: teacher forward, full logits, KL + CE, student backward and step."""
    config = load_config(None, ["device=cuda", *extra])
    vocab = config.tokenizer_vocab
    teacher = build_model(None, config.teacher_hidden, config.teacher_layers, config, vocab, 0).cuda().eval()
    student = build_model(None, config.student_hidden, config.student_layers, config, vocab, 1).cuda()
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr)
    rows = config.rows_per_micro_batch * config.micro_batches
    times = []
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
    return dict(layout="single process, full-logits KD (PyTorch)", placement="one GPU", transfer="none",
                tokens_per_s=rows * config.row_tokens / step_seconds, step_seconds=step_seconds)


def profile_student_step(extra, steps=6):
    """In this process (no Ray actor): a teacher's top-k and the student worker's train_step,
    under torch.profiler; prints where a step's wall time goes (CPU launch vs GPU kernels)."""
    import ray

    from orchestration.workers import StudentWorker, TeacherWorker

    config = load_config(None, ["device=cuda", "checkpoint_every=0", *extra])
    vocab = config.tokenizer_vocab
    teacher, student = TeacherWorker(config, vocab), StudentWorker(config, vocab)
    rows = config.rows_per_micro_batch
    micro = []
    for _ in range(config.micro_batches):
        tokens = torch.randint(0, vocab, (rows, config.row_tokens))
        micro.append((tokens, torch.roll(tokens, -1, 1)))
    refs = [ray.put(teacher.score(tokens)) for tokens, _ in micro]
    for step in range(2):
        student.train_step(step, micro, refs, rows * config.row_tokens * len(micro))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        start = time.perf_counter()
        for step in range(2, 2 + steps):
            student.train_step(step, micro, refs, rows * config.row_tokens * len(micro))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    events = profiler.key_averages()
    gpu_busy = sum(e.self_device_time_total for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 / steps  # kernels only
    print(f"student step in-process: {wall * 1e3:.1f} ms wall, {gpu_busy * 1e3:.1f} ms of GPU kernels")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/bench_e2e_throughput")
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="driver option for all runs")
    parser.add_argument("--profile", action="store_true", help="also profile one student step in-process")
    args = parser.parse_args()
    extra = args.set
    if args.profile:
        import ray

        ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False, ignore_reinit_error=True)
        profile_student_step(extra)
    rows = [baseline_row(args.steps, extra),
            driver_row("colocated", args.steps, args.output_dir, extra, "placement=colocated"),
            driver_row("colocated, no overlap", args.steps, args.output_dir, extra, "placement=colocated",
                       "overlap=false")]
    if torch.cuda.device_count() >= 2:
        rows.append(driver_row("disaggregated", args.steps, args.output_dir, extra, "placement=disaggregated"))
    print(f"GPU {torch.cuda.get_device_name()} × {torch.cuda.device_count()}; torch {torch.__version__}")
    print("| layout | transfer | tokens/s | step s | teacher s | waited s | transfer s | student s | Ray dispatch s "
          "| teacher hidden |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['layout']} | {row['transfer']} | {row['tokens_per_s']:,.0f} | {row['step_seconds']:.3f} | "
              f"{row.get('teacher_seconds', float('nan')):.3f} | {row.get('wait_seconds', float('nan')):.3f} | "
              f"{row.get('transfer_seconds', float('nan')):.4f} | "
              f"{row.get('student_seconds', float('nan')):.3f} | {row.get('dispatch_seconds', float('nan')):.3f} | "
              f"{100 * row.get('teacher_hidden', 0):.0f} % |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
