"""Teacher: bf16 hidden states -> top-k log-probs and ids at temperature 2, beside the bare
lm_head matmul (the floor) and PyTorch, on one GPU.

Providers at each shape and k (ratios to the floor of the same run and protocol):
  floor: lm_head matmul        hidden @ weight.T, bf16 out
  ours (cuda)                  kd.teacher_topk(..., backend="cuda") (skipped without the extension)
  ours (triton)                backend="triton": no compiled extension
  ours, lean=True              lean=True on the backend auto picks
  eager torch                  matmul, float32 log_softmax, topk
  torch.compile                the same, compiled
and from bf16 logits already in memory (ratios to a device copy of them):
  device copy (bf16 logits)    logits.clone(): one read and one write
  torch.topk (bf16 logits)     torch.topk alone
  ours from bf16 logits (...)  kd.teacher_topk_from_logits, cuda and triton backends

Protocols: "blocks" for every provider; "sustained" (the one the targets are judged by) for
the floor and ours from hidden states. Memory: peak beyond the inputs and the N·k top-k.
Hidden states are scaled so the teacher's mean entropy at temperature 1 is 3 nats.
Sampling rows: kd.teacher_sample (n = 16 by default, seed 1) against the floor, the top-k
(k = 64, triton) beside it, both protocols.
Default: both shapes at k = 8, 64, 1024 and n = 16, ~7 minutes on one H200.

usage: python benchmarks/bench_teacher.py [--shapes qwen,llama] [--k 8,64,1024] [--samples 16] [--sampling-only]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import (TEACHER_SHAPES, TIMING_COLUMNS, add_results_arguments, append_rows, environment,  # noqa: E402
                     int_list, lm_head, llm_like_hidden, peak_extra_gib, pick, print_table, result_row, shape_fields,
                     time_ms, time_sustained_ms)

BENCHMARK = "bench_teacher"
TEMPERATURE = 2.0
FLOOR = "floor: lm_head matmul"
COPY = "device copy (bf16 logits)"


def eager_teacher(hidden, weight, k):
    return torch.log_softmax((hidden @ weight.T).float() / TEMPERATURE, -1).topk(k, dim=-1)


compiled_teacher = torch.compile(eager_teacher)


def cuda_backend_reason() -> str | None:
    """None where the CUDA extension runs, else why not."""
    status = kd.available_backends()["cuda"]
    return None if status.startswith("available") else status.split(";")[0]


def providers(hidden, weight, logits, k):
    """(from hidden {name: fn}, from logits {name: fn}, {name: why skipped})."""
    cuda_missing = cuda_backend_reason()
    if cuda_missing is None and k > 1024:
        cuda_missing = "the CUDA top-k takes k <= 1024"
    skipped = {} if cuda_missing is None else {"ours (cuda)": cuda_missing,
                                               "ours from bf16 logits (cuda)": cuda_missing}
    lean_backend = "triton" if cuda_missing else "cuda"

    def ours(backend, **options):
        return lambda: kd.teacher_topk(hidden, weight, k, temperature=TEMPERATURE, backend=backend, **options)

    def from_logits(backend):
        return lambda: kd.teacher_topk_from_logits(logits, k, temperature=TEMPERATURE, backend=backend)

    from_hidden = {FLOOR: lambda: hidden @ weight.T, "ours (cuda)": ours("cuda"), "ours (triton)": ours("triton"),
                   f"ours, lean=True ({lean_backend})": ours(lean_backend, lean=True),
                   "eager torch": lambda: eager_teacher(hidden, weight, k),
                   "torch.compile": lambda: compiled_teacher(hidden, weight, k)}
    in_memory = {COPY: lambda: logits.clone(), "torch.topk (bf16 logits)": lambda: logits.topk(k, dim=-1),
                 "ours from bf16 logits (cuda)": from_logits("cuda"),
                 "ours from bf16 logits (triton)": from_logits("triton")}
    return ({name: fn for name, fn in from_hidden.items() if name not in skipped},
            {name: fn for name, fn in in_memory.items() if name not in skipped}, skipped)


def bench_shape(shape, ks, env):
    weight = lm_head(shape.v, shape.h)
    hidden, entropy, _ = llm_like_hidden(shape.n, shape.h, weight)
    logits = hidden @ weight.T
    print(f"\n## {shape.name}: N={shape.n} H={shape.h} V={shape.v}; teacher entropy at τ=1 {entropy:.2f} nats",
          flush=True)
    rows, told = [], set()
    for k in ks:
        from_hidden, in_memory, skipped = providers(hidden, weight, logits, k)
        for name, reason in skipped.items():
            if (name, reason) not in told:
                print(f"{name} skipped: {reason}")
                told.add((name, reason))
        where = shape_fields(shape, k=k, dtype="bfloat16", temperature=TEMPERATURE, entropy=round(entropy, 3))
        keep = shape.n * k * 8 + shape.n * 4  # the top-k every provider returns
        for group, floor in ((from_hidden, FLOOR), (in_memory, COPY)):
            blocks = {}
            for name, fn in group.items():
                median, low, high = time_ms(fn, warmup=2, repeats=7)
                blocks[name] = dict(ms=median, p20=low, p80=high, peak=peak_extra_gib(fn, keep_bytes=keep))
                torch.cuda.empty_cache()
            for name, timing in blocks.items():
                extra = {}
                if group is in_memory and name != COPY:  # bytes read against the copy's read + write
                    extra["of_copy_bandwidth"] = blocks[COPY]["ms"] / (2 * timing["ms"])
                rows.append(result_row(env, BENCHMARK, where, name, "blocks", timing["ms"], floor,
                                       timing["ms"] / blocks[floor]["ms"], timing["peak"], p20=timing["p20"],
                                       p80=timing["p80"], **extra))
            if group is from_hidden:
                timed = {name: fn for name, fn in group.items() if name == FLOOR or name.startswith("ours")}
                steady, ratios = time_sustained_ms(timed)
                rows += [result_row(env, BENCHMARK, where, name, "sustained", steady[name], FLOOR, ratios[name],
                                    blocks[name]["peak"]) for name in timed]
        print(f"k={k} done", flush=True)
    return rows


def bench_sampling(shape, sample_counts, env):
    """kd.teacher_sample (n samples a row, seed 1) against the floor, the teacher top-k (k = 64,
    triton) beside it: "blocks" and "sustained" rows, memory beyond the inputs and outputs."""
    weight = lm_head(shape.v, shape.h)
    hidden, entropy, _ = llm_like_hidden(shape.n, shape.h, weight)
    rows = []
    for n in sample_counts:
        where = shape_fields(shape, samples=n, dtype="bfloat16", temperature=TEMPERATURE, entropy=round(entropy, 3))
        group = {FLOOR: lambda: hidden @ weight.T,
                 f"teacher_sample n={n} (triton)": lambda: kd.teacher_sample(hidden, weight, n, seed=1,
                                                                             temperature=TEMPERATURE),
                 "teacher_topk k=64 (triton)": lambda: kd.teacher_topk(hidden, weight, 64, temperature=TEMPERATURE,
                                                                       backend="triton")}
        keep = shape.n * (n * 8 + 12)
        blocks = {}
        for name, fn in group.items():
            median, low, high = time_ms(fn, warmup=2, repeats=7)
            blocks[name] = dict(ms=median, p20=low, p80=high, peak=peak_extra_gib(fn, keep_bytes=keep))
            torch.cuda.empty_cache()
        rows += [result_row(env, BENCHMARK, where, name, "blocks", timing["ms"], FLOOR,
                            timing["ms"] / blocks[FLOOR]["ms"], timing["peak"], p20=timing["p20"], p80=timing["p80"])
                 for name, timing in blocks.items()]
        steady, ratios = time_sustained_ms(group)
        rows += [result_row(env, BENCHMARK, where, name, "sustained", steady[name], FLOOR, ratios[name],
                            blocks[name]["peak"]) for name in group]
        print(f"samples n={n} done", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help=f"all or a comma-separated list of {', '.join(TEACHER_SHAPES)}")
    parser.add_argument("--k", type=int_list, default=[8, 64, 1024], help="comma-separated k (default 8,64,1024)")
    sampling = parser.add_argument_group("sampling (kd.teacher_sample against the floor and the top-k)")
    sampling.add_argument("--samples", type=int_list, default=[16],
                          help="comma-separated samples a row (default 16; rows after the top-k's)")
    sampling.add_argument("--sampling-only", action="store_true", help="only the sampling rows")
    add_results_arguments(parser, BENCHMARK)
    args = parser.parse_args()
    shapes = pick(TEACHER_SHAPES, args.shapes, parser, "--shapes")
    if not torch.cuda.is_available():
        sys.exit("bench_teacher: needs a CUDA device")
    env = environment(args.commit)
    print(f"environment: {env}\nbackends: {kd.available_backends()}")
    rows = [] if args.sampling_only else [row for shape in shapes for row in bench_shape(shape, args.k, env)]
    rows += [row for shape in shapes for row in bench_sampling(shape, args.samples, env)]
    append_rows(args.results, rows)
    print()
    print_table(rows, TIMING_COLUMNS)


if __name__ == "__main__":
    main()
