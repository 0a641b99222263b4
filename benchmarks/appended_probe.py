"""The appended schedule's rows redone and peak memory (issue #4's 64 MiB), on random and on
LLM-like hidden states at 8192 × 4096 × 151,936, k = 256 and 1024; per chunk, the key counts
(mean, min, max) and the rows with fewer than k keys or more than the slots.

usage: python benchmarks/appended_probe.py   (one GPU)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels.teacher_chunked as chunked  # noqa: E402
from harness import llm_like_hidden  # noqa: E402
from kd_kernels.ops import topk_from_appended  # noqa: E402

REDONE, COUNTS = [], []


def _spy_redo(original):
    def redo(overflow, *args, **kwargs):
        rows = original(overflow, *args, **kwargs)
        REDONE.append(int(rows.numel()))
        return rows
    return redo


def _spy_rank(original):
    def rank(keys, counts, k, order):
        c = counts.float()
        COUNTS.append((round(c.mean().item(), 1), int(c.min()), int(c.max()), int((counts < k).sum()),
                       int((counts > keys.shape[1]).sum())))
        return original(keys, counts, k, order)
    return rank


def main():
    chunked._redo_rows = _spy_redo(chunked._redo_rows)
    topk_from_appended.rank_appended = _spy_rank(topk_from_appended.rank_appended)
    generator = torch.Generator(device="cuda").manual_seed(1)
    weight = (torch.randn(151_936, 4096, device="cuda", generator=generator) * 0.02).bfloat16()
    inputs = {"random × 0.8": (torch.randn(8192, 4096, device="cuda", generator=generator) * 0.8).bfloat16(),
              "LLM-like": llm_like_hidden(8192, 4096, weight)[0]}
    for name, hidden in inputs.items():
        for k in (256, 1024):
            chunked.teacher_topk_appended(hidden[:256], weight, k, 2.0, 151_936, select="cuda")
            torch.cuda.synchronize()
            REDONE.clear()
            COUNTS.clear()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            top = chunked.teacher_topk_appended(hidden, weight, k, 2.0, 151_936, select="cuda")
            torch.cuda.synchronize()
            outputs = top.logprobs.nbytes + top.indices.nbytes + top.lse.nbytes
            extra = torch.cuda.max_memory_allocated() - before - outputs
            print(f"{name}, k = {k}: rows redone {sum(REDONE)}, {extra / 2**20:.1f} MiB beyond the outputs")
            for counts in COUNTS:
                print("    keys a row (mean, min, max), rows under k, rows over the slots:", counts)


if __name__ == "__main__":
    main()
