"""Teacher side: hidden → top-k log-probs and ids at temperature 2, providers side by side.

Providers: the bare lm_head matmul (the floor), ours from hidden (the default schedule for
16-bit inputs: a Triton matmul whose epilogue also leaves each row's tile statistics and each
group's maximum, its column and second largest, no logits stored, at k <= 64 ("maxima
schedule"), or the float32 logits and group maxima, then ~k groups read per row, past it
("epilogue schedule"); each forced at any k it takes; "cuBLAS schedule": cuBLAS fp32 chunks +
the CUDA top-k kernel (cuda backend) or the Triton threshold select (triton backend); triton
fused: the top-k in the epilogue of a Triton matmul, no logits, with a sweep of its tiles under
--fused-sweep; lean: the maxima schedule to k = 256, tiles past it), eager
PyTorch (matmul, log_softmax, topk), torch.compile of it, torch.topk alone on logits in
memory, and ours from bf16 logits in memory (GB/s against a measured device copy, which
counts its read and its write).
Teacher hidden states are scaled so the mean entropy at temperature 1 is ~3 nats.

usage: python benchmarks/bench_teacher_topk.py [--out results.json]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import (environment, llm_like_hidden, peak_extra_gib, time_after_idle_ms,  # noqa: E402
                     time_interleaved_ms, time_ms, time_sustained_ms, with_attributes, with_env, write_json)
from kd_kernels.ops import topk_from_groups  # noqa: E402
from kd_kernels.teacher_chunked import teacher_topk_tiled  # noqa: E402
from shapes import TEACHER_SHAPES  # noqa: E402

TEMPERATURE = 2.0
# tiles of the fused Triton kernel to try (KD_KERNELS_FUSED_TOPK: rows, columns, hidden step, warps, stages)
FUSED_SWEEP = ("64,128,64,8,4", "64,128,128,8,3", "128,128,64,8,3", "64,256,64,8,3")


def eager_teacher(hidden, weight, k):
    logprobs = torch.log_softmax((hidden @ weight.T).float() / TEMPERATURE, -1)
    return logprobs.topk(k, dim=-1)


_compiled_teacher = torch.compile(eager_teacher)
# (backend, schedule forced by KD_KERNELS_TEACHER_SCHEDULE, label suffix, teacher_topk options)
FORCED_SCHEDULES = [("cuda", "epilogue", "", {}), ("cuda", "maxima", "", {}), ("cuda", "appended", "", {}),
                    ("triton", "appended", "", {}), ("cuda", "cuBLAS", "", {}), ("triton", "cuBLAS", "", {})]


# timed again by --after-idle (each call after 200 ms idle) and --sustained (1 s blocks), the floor first
RETIMED = ("floor: lm_head matmul", "ours from hidden (cuda)", "ours from hidden (cuda, ping-pong top-2 matmul)",
              "ours from hidden (triton)", "ours from hidden, lean (cuda)")


def _print_ratios(rows, key, protocol, title):
    """The ``ratio_<protocol>`` column of ``rows`` beside its ``ms_<protocol>`` (median ms a call)."""
    print(f"\n{title}")
    print(f"| provider | k | ms, {protocol} | × matmul, {protocol} |")
    print("| --- | --- | --- | --- |")
    ms_key = key.replace("ratio_", "ms_")
    for row in rows:
        if key in row:
            print(f"| {row['provider']} | {row['k']} | {row[ms_key]:.2f} | {row[key]:.3f} |")


def bench_shape(name, n, h, v, ks, only=None, fused_sweep=False, interleave=False, after_idle=False,
                sustained=False):
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, scale = llm_like_hidden(n, h, weight)
    logits_bf16 = hidden @ weight.T
    logits_fp32 = logits_bf16.float()
    copy_ms = time_ms(lambda: logits_bf16.clone())[0]
    copy_gbs = 2 * logits_bf16.numel() * 2 / copy_ms / 1e6
    print(f"\n## {name}: N={n} H={h} V={v}; teacher entropy at τ=1 {entropy:.2f} nats (hidden × {scale:.2f}); "
          f"device copy {copy_gbs:.0f} GB/s")
    flops = 2 * n * h * v
    rows = []
    for k in ks:
        providers = {
            "floor: lm_head matmul": lambda: hidden @ weight.T,
            "ours from hidden (cuda)": lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                               backend="cuda"),
            # the maxima schedule's matmul as the opt-in Hopper ping-pong kernel (NOTES e38)
            "ours from hidden (cuda, ping-pong top-2 matmul)": lambda: with_env(
                "KD_KERNELS_TOP2_MATMUL", "pingpong",
                lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE, backend="cuda")),
            # past RANK_MAX_K (a sort orders the candidates): the candidates gathered by the Triton
            # selection and sorted by the extension, as before GATHER_IN_CUDA
            "ours from hidden (cuda, candidates gathered in Triton)": lambda: with_attributes(
                topk_from_groups, dict(GATHER_IN_CUDA=False),
                lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE, backend="cuda")),
            "ours from hidden (triton)": lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                                 backend="triton"),
            **{f"ours from hidden ({backend}, {schedule} schedule{label})": (
                lambda backend=backend, schedule=schedule, options=options: with_env(
                    "KD_KERNELS_TEACHER_SCHEDULE", schedule.lower(),
                    lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE, backend=backend, **options)))
               for backend, schedule, label, options in FORCED_SCHEDULES},
            "ours from hidden (triton fused)": lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                                       backend="triton", fused=True),
            **{f"ours from hidden (triton fused {tiles})": (lambda tiles=tiles: with_env(
                "KD_KERNELS_FUSED_TOPK", tiles, lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                                        backend="triton", fused=True)))
               for tiles in (FUSED_SWEEP if fused_sweep else ())},
            # lean=True: the maxima schedule at k <= 256 on 16-bit inputs, the tiled one past it
            "ours from hidden, lean (cuda)": lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                                     backend="cuda", lean=True),
            "ours from hidden, lean tiled schedule (cuda)": lambda: teacher_topk_tiled(hidden, weight, k, TEMPERATURE,
                                                                                      v, select="cuda"),
            "eager torch": lambda: eager_teacher(hidden, weight, k),
            "torch.compile": lambda: _compiled_teacher(hidden, weight, k),
            "torch.topk alone (fp32 logits in memory)": lambda: logits_fp32.topk(k, dim=-1),
            "torch.topk alone (bf16 logits in memory)": lambda: logits_bf16.topk(k, dim=-1),
            "ours from bf16 logits (cuda)": lambda: kd.teacher_topk_from_logits(
                logits_bf16, k=k, temperature=TEMPERATURE, backend="cuda"),
            "ours from bf16 logits (cuda, cp.async pass 1 forced)": lambda: with_env(
                "KD_KERNELS_TOPK_PIPELINE", "1",
                lambda: kd.teacher_topk_from_logits(logits_bf16, k=k, temperature=TEMPERATURE, backend="cuda")),
            "ours from bf16 logits (cuda, register pass 1 forced)": lambda: with_env(
                "KD_KERNELS_TOPK_PIPELINE", "0",
                lambda: kd.teacher_topk_from_logits(logits_bf16, k=k, temperature=TEMPERATURE, backend="cuda")),
            "ours from bf16 logits (triton)": lambda: kd.teacher_topk_from_logits(
                logits_bf16, k=k, temperature=TEMPERATURE, backend="triton"),
            "ours from fp32 logits (cuda)": lambda: kd.teacher_topk_from_logits(
                logits_fp32, k=k, temperature=TEMPERATURE, backend="cuda"),
        }
        for label, fn in providers.items():
            if only and not label.startswith("floor") and not any(part in label for part in only):
                continue
            if "gathered in Triton" in label and k <= topk_from_groups.RANK_MAX_K:
                continue  # the same path as the default there
            try:
                median, low, high = time_ms(fn, warmup=2, repeats=7)
                memory = peak_extra_gib(fn, keep_bytes=n * k * 8 + n * 4)  # beyond the top-k itself
            except Exception as error:  # noqa: BLE001
                print(f"{label} k={k}: failed: {error!r}")
                continue
            row = dict(provider=label, k=k, ms=median, p20=low, p80=high, peak_extra_gib=memory)
            if "logits" in label:
                row["gbs"] = logits_bf16.numel() * (4 if "fp32" in label else 2) / median / 1e6
                row["of_copy"] = row["gbs"] / copy_gbs
            else:
                row["tflops"] = flops / median / 1e9
            rows.append(row)
            torch.cuda.empty_cache()
        if interleave:  # the from-hidden providers again, each repetition timing them in turn after the floor
            timed = [row["provider"] for row in rows if row["k"] == k and "logits" not in row["provider"]
                     and "torch" not in row["provider"]]
            in_turn, ratios = time_interleaved_ms({label: (providers[label], None) for label in timed})
            for row in rows:
                if row["k"] == k and row["provider"] in ratios:
                    row["ms_in_turn"] = in_turn[row["provider"]][0]
                    row["ratio_in_turn"] = ratios[row["provider"]]
        retimed = [label for label in RETIMED if any(row["k"] == k and row["provider"] == label for row in rows)]
        if after_idle:  # each call after 200 ms idle (every call at boost clock)
            idle = {label: time_after_idle_ms(providers[label]) for label in retimed}
            for row in rows:
                if row["k"] == k and row["provider"] in idle:
                    row["ms_after_idle"] = idle[row["provider"]]
                    row["ratio_after_idle"] = idle[row["provider"]] / idle[RETIMED[0]]
        if sustained:  # each in blocks of ~1 s back to back at the power limit, in turn
            steady, ratios = time_sustained_ms({label: providers[label] for label in retimed})
            for row in rows:
                if row["k"] == k and row["provider"] in ratios:
                    row["ms_sustained"] = steady[row["provider"]]
                    row["ratio_sustained"] = ratios[row["provider"]]
    floor = {r["k"]: r["ms"] for r in rows if r["provider"].startswith("floor")}
    print("| provider | k | ms (p20–p80) | × matmul | TFLOP/s or GB/s | peak extra GiB beyond the top-k |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        rate = (f"{row['tflops']:.0f} TFLOP/s" if "tflops" in row
                else f"{row['gbs']:.0f} GB/s = {100 * row['of_copy']:.0f} % of copy")
        print(f"| {row['provider']} | {row['k']} | {row['ms']:.2f} ({row['p20']:.2f}–{row['p80']:.2f}) | "
              f"{row['ms'] / floor[row['k']]:.3f} | {rate} | {row['peak_extra_gib']:.3f} |")
    if after_idle:
        _print_ratios(rows, "ratio_after_idle", "after idle",
                      "Each call after 200 ms idle (both at boost clock; median of 10):")
    if sustained:
        _print_ratios(rows, "ratio_sustained", "sustained",
                      "Sustained (each call back to back for 1 s after 1 s untimed, the calls in turn, 3 rounds; "
                      "median of the per-round ratio):")
    if interleave:
        _print_ratios(rows, "ratio_in_turn", "in turn",
                      "Timed in turn (each repetition: the floor, then every provider; median of the per-repetition "
                      "ratio):")
    return dict(shape=name, n=n, h=h, v=v, entropy=entropy, copy_gbs=copy_gbs, rows=rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--k", default="8,64,1024")
    parser.add_argument("--shapes", default="all",
                        help="comma-separated parts of shape names (case-insensitive: qwen, llama), or all")
    parser.add_argument("--providers", default="", help="comma-separated parts of provider names (default: all)")
    parser.add_argument("--fused-sweep", action="store_true", help="also time the fused kernel's tile sweep")
    parser.add_argument("--after-idle", action="store_true",
                        help="also time the floor and the default paths each after 200 ms idle")
    parser.add_argument("--sustained", action="store_true",
                        help="also time the floor and the default paths in blocks of 1 s back to back, in turn")
    parser.add_argument("--interleave", action="store_true",
                        help="also time the from-hidden providers in turn with the floor (ratios per repetition)")
    args = parser.parse_args()
    shapes = [shape for shape in TEACHER_SHAPES if args.shapes == "all"
              or any(part.lower() in shape[0].lower() for part in args.shapes.split(","))]
    if not shapes:
        parser.error(f"--shapes: expected all or parts of {[shape[0] for shape in TEACHER_SHAPES]}, "
                     f"got {args.shapes!r}")
    env = environment()
    print(f"environment: {env}")
    ks = [int(k) for k in args.k.split(",")]
    only = [part for part in args.providers.split(",") if part]
    results = [bench_shape(name, n, h, v, ks, only, args.fused_sweep, args.interleave, args.after_idle,
                           args.sustained)
               for name, n, h, v in shapes]
    if args.out:
        write_json(args.out, dict(environment=env, results=results))


if __name__ == "__main__":
    main()
