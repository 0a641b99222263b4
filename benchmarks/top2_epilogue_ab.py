"""The maxima schedule's epilogue matmul before and after a change of its epilogue (NOTES e28),
over the schedule's 1024-row chunks of 8192 × 4096 × 151,936 bf16, against cuBLAS: timed in
blocks, in turn, and each call after 200 ms idle (both at boost clock). ``--before FILE``: the
old ops/lm_head_group_maxima.py (e.g. ``git show 694f651:kd_kernels/ops/lm_head_group_maxima.py``),
loaded beside the current one (the runs of NOTES e28 used 694f651). Then the whole default
call at k = 8 and 64 against the floor under the three protocols.

usage: python benchmarks/top2_epilogue_ab.py --before FILE   (one H200)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import llm_like_hidden, time_after_idle_ms, time_interleaved_ms, time_ms  # noqa: E402
from kd_kernels.ops import lm_head_group_maxima as after_module  # noqa: E402

CHUNK = 1024
TEMPERATURE = 2.0


def load_before(path):
    spec = importlib.util.spec_from_file_location("kd_kernels.ops._epilogue_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def chunked(module, hidden, weight, top2):
    """All rows through ``module``'s EpilogueMatmul in CHUNK-row chunks, no logits stored."""
    v = weight.shape[0]
    matmuls = [module.EpilogueMatmul(hidden[start:start + CHUNK], weight, None, v, TEMPERATURE, None, None, top2)
               for start in range(0, hidden.shape[0], CHUNK)]
    return lambda: [matmul(0, v) for matmul in matmuls]


def check(before, after, hidden, weight):
    """The statistics agree; the top-2 groups differ in layout but hold the same row maxima."""
    v = weight.shape[0]
    old = before.EpilogueMatmul(hidden[:CHUNK], weight, None, v, TEMPERATURE, None, None, True)(0, v)
    new = after_module.EpilogueMatmul(hidden[:CHUNK], weight, None, v, TEMPERATURE, None, None, True)(0, v)
    assert torch.equal(old.tile_max2, new.tile_max2)
    assert torch.allclose(old.tile_sum2, new.tile_sum2, rtol=1e-5)
    assert torch.equal(old.group_max.max(1).values, new.group_max.max(1).values)
    def row_second(summaries):  # the row's second largest element, from either layout
        return torch.cat([summaries.group_max, summaries.group_second], 1).topk(2, dim=1).values[:, 1]

    assert torch.equal(row_second(old), row_second(new))
    single = new.group_second < new.group_max
    print(f"checks passed; groups with one maximum: {single.float().mean().item():.4f}", flush=True)


def protocols(calls, table):
    """Each call in blocks, in turn, after idle -> rows of ``table``."""
    blocks = {name: time_ms(fn)[0] for name, (fn, _) in calls.items()}
    turn, ratios = time_interleaved_ms(calls)
    idle = {name: time_after_idle_ms(fn) for name, (fn, _) in calls.items()}
    first = next(iter(calls))
    for name in calls:
        table.append((name, blocks[name], blocks[name] / blocks[first], turn[name][0], ratios[name], idle[name],
                      idle[name] / idle[first]))
        print(table[-1], flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    args = parser.parse_args()
    before = load_before(args.before)
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    check(before, after_module, hidden, weight)
    table = []
    calls = {"cuBLAS bf16": (lambda: hidden @ weight.T, None),
             "before: statistics only": (chunked(before, hidden, weight, False), None),
             "before: group top-2": (chunked(before, hidden, weight, True), None),
             "after: statistics only": (chunked(after_module, hidden, weight, False), None),
             "after: group top-2": (chunked(after_module, hidden, weight, True), None)}
    protocols(calls, table)
    for k in (8, 64):
        protocols({"floor: lm_head matmul": (lambda: hidden @ weight.T, None),
                   f"after: teacher_topk k={k}": (lambda: kd.teacher_topk(hidden, weight, k=k, temperature=TEMPERATURE,
                                                                          backend="cuda"), None)}, table)
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, {CHUNK}-row chunks, entropy {entropy:.2f} nats")
    print("| call | in blocks ms | × first | in turn ms | × first | after idle ms | × first |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, blocks, block_ratio, turn, turn_ratio, idle, idle_ratio in table:
        print(f"| {name} | {blocks:.3f} | {block_ratio:.3f} | {turn:.3f} | {turn_ratio:.3f} | {idle:.3f} | "
              f"{idle_ratio:.3f} |")


if __name__ == "__main__":
    main()
