"""Teacher from hidden: can the CUDA selection hide behind the next chunk's matmul?

Measures, at 8192 × 4096 × 151,936 (LLM-like hidden states, τ = 2), in one run:
- the bf16 lm_head matmul (the floor) and the float32-output one, whole and per chunk, with
  cuBLAS's SM carveout at several values (does the carveout take effect, and what it costs);
- the selection alone on one float32 chunk with the whole GPU or a few blocks (its bandwidth
  per SM when the rest of the GPU is busy elsewhere);
- `teacher_topk` (cuda) against `teacher_topk_overlapped` for several SM counts and chunk
  sizes, with their outputs compared for equality (same kernels: must be bit-identical);
- a kernel table of the plain path at each k (where its time over the matmul goes).

usage: python benchmarks/teacher_overlap.py [--ks 8,64] [--sms 4,8,16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import environment, llm_like_hidden, peak_extra_gib, time_ms  # noqa: E402
from kd_kernels import teacher_chunked as chunked  # noqa: E402
from kd_kernels.lm_head import lm_head_logits_fp32  # noqa: E402
from kd_kernels.ops.topk_candidates import topk_candidates  # noqa: E402

TEMPERATURE = 2.0


def with_carveout(sms, fn):
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        return fn()
    finally:
        torch._C._set_sm_carveout_experimental(before)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="8,64")
    parser.add_argument("--sms", default="4,6,8,12,16")
    parser.add_argument("--chunks", default="0,552", help="chunk rows of the overlapped path (0: its default)")
    args = parser.parse_args()
    print(f"environment: {environment()}")
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    print(f"teacher entropy at τ=1: {entropy:.2f} nats")
    rows = []

    def record(label, fn, **extra):
        median, low, high = time_ms(fn, warmup=2, repeats=7)
        rows.append(dict(label=label, ms=median, p20=low, p80=high, **extra))
        print(f"{label}: {median:.3f} ms ({low:.3f}–{high:.3f}) {extra if extra else ''}", flush=True)
        return median

    floor = record("matmul bf16 out", lambda: hidden @ weight.T)
    full = torch.empty(n, v, dtype=torch.float32, device="cuda")
    for sms in (None, 4, 8, 16, 32):
        record(f"matmul fp32 out, carveout {sms}",
               lambda sms=sms: with_carveout(sms, lambda: lm_head_logits_fp32(hidden, weight, full)))
    chunk = chunked.DEFAULT_CHUNK_BYTES // 2 // (4 * v)
    for sms in (None, 8):
        record(f"matmul fp32 out {chunk} rows, carveout {sms}",
               lambda sms=sms: with_carveout(sms, lambda: lm_head_logits_fp32(hidden[:chunk], weight, full[:chunk])))
    lm_head_logits_fp32(hidden, weight, full)
    for blocks in (0, 8, 16, 32, 64):
        record(f"select k=64 alone, {chunk} fp32 rows, blocks {blocks}",
               lambda blocks=blocks: topk_candidates(full[:chunk], 64, TEMPERATURE, v, blocks))
    full = None  # frees the 5 GB buffer before the end-to-end runs
    torch.cuda.empty_cache()

    for k in [int(x) for x in args.ks.split(",")]:
        plain = lambda k=k: chunked.teacher_topk(hidden, weight, k, TEMPERATURE, v, select="cuda")  # noqa: E731
        expected = plain()
        ms = record(f"plain k={k}", plain, x=None)
        rows[-1]["x"] = ms / floor
        rows[-1]["gib"] = peak_extra_gib(plain)
        for chunk_rows in [int(x) for x in args.chunks.split(",")]:
            for sms in [int(x) for x in args.sms.split(",")]:
                overlapped = (lambda k=k, sms=sms, chunk_rows=chunk_rows: chunked.teacher_topk_overlapped(  # noqa: E731
                    hidden, weight, k, TEMPERATURE, v, chunk_rows=chunk_rows or None, select_sms=sms))
                got = overlapped()
                same = torch.equal(got.logprobs, expected.logprobs) and torch.equal(got.indices, expected.indices)
                ms = record(f"overlapped k={k} chunk {chunk_rows or 'default'} sms {sms}", overlapped, same=same)
                rows[-1]["x"] = ms / floor
                rows[-1]["gib"] = peak_extra_gib(overlapped)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            plain()
            torch.cuda.synchronize()
        print(f"## kernels of the plain path, k={k}")
        print(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=6, max_name_column_width=60))

    print("\n| what | ms (p20–p80) | × bf16 matmul | peak extra GiB | equal to plain |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['label']} | {row['ms']:.3f} ({row['p20']:.3f}–{row['p80']:.3f}) | {row['ms'] / floor:.3f} | "
              f"{row.get('gib', float('nan')):.3f} | {row.get('same', '')} |")


if __name__ == "__main__":
    main()
