"""The teacher benchmark's JSON (bench_teacher_topk.py --out) as the RESULTS.md tables: one per
shape, a column per k; ratios (×) to the bare matmul in blocks (default paths: also sustained,
after idle and in turn, "—" where the run did not time that protocol), peak extra GiB, and the
from-logits kernels' share of the measured copy bandwidth.

usage: python benchmarks/teacher_results_table.py results/bench_teacher_topk_<sha>.json
"""
from __future__ import annotations

import argparse
import json

# (provider in the JSON, its label in RESULTS.md)
PROVIDERS = [
    ("floor: lm_head matmul", "floor: lm_head matmul (bf16 out), in blocks (p20–p80); sustained; after idle"),
    ("ours from hidden (cuda)", "**ours from hidden (cuda)**: blocks / sustained / after idle / in turn, of rate, GiB"),
    ("ours from hidden (triton)", "ours from hidden (triton, no extension)"),
    ("ours from hidden, lean (cuda)", "ours, `lean=True` (cuda)"),
    ("ours from hidden (cuda, maxima schedule)", "ours, the maxima schedule forced (cuda; blocks / in turn, GiB)"),
    ("ours from hidden (cuda, appended schedule)", "ours, the appended schedule forced (cuda)"),
    ("ours from hidden (cuda, epilogue schedule)", "ours, the epilogue schedule forced (cuda: a chunk's float32 logits)"),
    ("ours from hidden (cuda, cuBLAS schedule)", "ours, the cuBLAS schedule forced (cuda)"),
    ("ours from hidden (triton, appended schedule)", "ours, the appended schedule forced (triton)"),
    ("ours from hidden, lean tiled schedule (cuda)", "ours, the lean tiled schedule forced"),
    ("ours from hidden (triton fused)", "ours, `fused=True` (triton)"),
    ("eager torch", "eager torch (logits, log_softmax, topk), GiB"),
    ("torch.compile", "`torch.compile` of the same, GiB"),
    ("torch.topk alone (bf16 logits in memory)", "`torch.topk` alone on bf16 logits in memory"),
    ("ours from bf16 logits (cuda)", "**ours from bf16 logits (cuda)**"),
    ("ours from bf16 logits (triton)", "ours from bf16 logits (triton)"),
    ("ours from fp32 logits (cuda)", "ours from fp32 logits (cuda)"),
]
ALL_PROTOCOLS = ("ours from hidden (cuda)", "ours from hidden (triton)", "ours from hidden, lean (cuda)")
BASELINE = "torch.topk alone (bf16 logits in memory)"


def find(shape: dict, provider: str, k: int):
    return next((row for row in shape["rows"] if row["provider"] == provider and row["k"] == k), None)


def _number(row: dict, key: str, spec: str = ".3f") -> str:
    return format(row[key], spec) if key in row else "—"


def cell(shape: dict, provider: str, k: int) -> str:
    row, floor = find(shape, provider, k), find(shape, "floor: lm_head matmul", k)
    if row is None:
        return "—"
    if provider == floor["provider"]:
        return (f"{row['ms']:.2f} ms ({row['p20']:.2f}–{row['p80']:.2f}); {_number(row, 'ms_sustained', '.2f')}; "
                f"{_number(row, 'ms_after_idle', '.2f')}")
    ratio = row["ms"] / floor["ms"]
    if provider in ALL_PROTOCOLS:
        default = provider == ALL_PROTOCOLS[0]
        bold = "**" if default else ""
        rate = f", {100 * floor['ms'] / row['ms']:.0f} %" if default else ""
        return (f"{bold}{ratio:.3f} / {_number(row, 'ratio_sustained')} / {_number(row, 'ratio_after_idle')}{bold} / "
                f"{_number(row, 'ratio_in_turn')}{rate}, {row['peak_extra_gib']:.3f}")
    if "logits" in provider:
        copy = f"{row['ms']:.2f} ms, {100 * row['of_copy']:.0f} % of copy"
        if provider == BASELINE or "cuda" not in provider or "bf16" not in provider:
            return copy
        return f"{copy} ({find(shape, BASELINE, k)['ms'] / row['ms']:.1f}× `torch.topk`)"
    if provider in ("eager torch", "torch.compile"):
        return f"{ratio:.3f}×, {row['peak_extra_gib']:.2f}"
    return f"{ratio:.3f} / {_number(row, 'ratio_in_turn')}, {row['peak_extra_gib']:.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json")
    results = json.load(open(parser.parse_args().json))["results"]
    for shape in results:
        ks = sorted({row["k"] for row in shape["rows"]})
        print(f"\n{shape['shape']}: {shape['n']} × {shape['h']} × {shape['v']:,}\n")
        print("| provider | " + " | ".join(f"k = {k}" for k in ks) + " |")
        print("| --- |" + " --- |" * len(ks))
        for provider, label in PROVIDERS:
            print(f"| {label} | " + " | ".join(cell(shape, provider, k) for k in ks) + " |")


if __name__ == "__main__":
    main()
