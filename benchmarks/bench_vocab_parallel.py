"""Vocab parallel: the student loss (forward + backward, and forward alone) and the teacher
top-k with the lm_head split over W GPUs (``group=``) against one GPU holding it whole, at
8192 × 4096 × 151,936, k = 64, temperature 2.

Rows (protocol "blocks"): provider "TP=1" (the floor) and "TP=W, per GPU", each with its peak
memory beyond the inputs; the TP=W row also records the bytes the collectives delivered to
rank 0 in one call (``bytes``) and the budget N·(8·k·W + 64) (``bound``). The student's bytes
include the backward's all-reduce of dX (N·H·2), which every column-parallel output layer does.
Default: ~1 minute on two H200s.

usage: torchrun --nproc_per_node 2 benchmarks/bench_vocab_parallel.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import (TIMING_COLUMNS, Shape, add_results_arguments, append_rows, environment, lm_head,  # noqa: E402
                     llm_like_hidden, peak_extra_gib, print_table, result_row, shape_fields, time_ms)

BENCHMARK = "bench_vocab_parallel"
SHAPE = Shape("Qwen-like, vocab parallel", 8192, 4096, 151_936)
K, TEMPERATURE = 64, 2.0


class DeliveredBytes:
    """Counts the bytes that ``dist.all_gather`` and ``dist.all_reduce`` deliver to this rank
    while open (an all_gather delivers W tensors, an all_reduce one)."""

    def __enter__(self):
        self.total = 0
        self.saved = dist.all_gather, dist.all_reduce

        def all_gather(outputs, tensor, *args, **kwargs):
            self.total += sum(t.numel() * t.element_size() for t in outputs)
            return self.saved[0](outputs, tensor, *args, **kwargs)

        def all_reduce(tensor, *args, **kwargs):
            self.total += tensor.numel() * tensor.element_size()
            return self.saved[1](tensor, *args, **kwargs)

        dist.all_gather, dist.all_reduce = all_gather, all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_gather, dist.all_reduce = self.saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_arguments(parser, BENCHMARK)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("bench_vocab_parallel: start it with torchrun --nproc_per_node 2 (one process a GPU)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    n, h, v = SHAPE.n, SHAPE.h, SHAPE.v
    weight = lm_head(v, h)  # the same tensors on every rank
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    teacher_weight = lm_head(v, h, seed=3)
    teacher_hidden, _, _ = llm_like_hidden(n, h, teacher_weight, seed=3)
    labels = torch.randint(0, v, (n,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    shard = slice(rank * (v // world), (rank + 1) * (v // world))
    teacher = kd.teacher_topk(teacher_hidden, teacher_weight, K, temperature=TEMPERATURE)
    group = dist.group.WORLD
    options = dict(temperature=TEMPERATURE, ce_weight=0.5, check_values=False)

    def student(weight_part, group_arg):
        def run():
            x, w = hidden.detach().requires_grad_(), weight_part.detach().requires_grad_()
            kd.topk_divergence(x, w, teacher, labels, group=group_arg, **options).backward()
        return run

    def student_forward(weight_part, group_arg):
        def run():
            with torch.no_grad():
                kd.topk_divergence(hidden, weight_part, teacher, labels, group=group_arg, **options)
        return run

    def teacher_side(weight_part, group_arg):
        return lambda: kd.teacher_topk(teacher_hidden, weight_part, K, temperature=TEMPERATURE, group=group_arg)

    env = environment(args.commit)
    rows = []
    for what, one, split in (("student fwd+bwd", student(weight, None), student(weight[shard], group)),
                             ("student fwd", student_forward(weight, None), student_forward(weight[shard], group)),
                             ("teacher top-k", teacher_side(teacher_weight, None),
                              teacher_side(teacher_weight[shard], group))):
        where = shape_fields(SHAPE, k=K, dtype="bfloat16", what=what, world=world)
        dist.barrier()
        one_ms, one_peak = time_ms(one)[0], peak_extra_gib(one)
        dist.barrier()
        split_ms, split_peak = time_ms(split)[0], peak_extra_gib(split)
        with DeliveredBytes() as delivered:
            split()
        torch.cuda.synchronize()
        rows.append(result_row(env, BENCHMARK, where, "TP=1", "blocks", one_ms, "TP=1", 1.0, one_peak))
        rows.append(result_row(env, BENCHMARK, where, f"TP={world}, per GPU", "blocks", split_ms, "TP=1",
                               split_ms / one_ms, split_peak, bytes=delivered.total, bound=n * (K * 8 * world + 64)))
    if rank == 0:
        print(f"environment: {env}; student entropy {entropy:.2f} nats")
        append_rows(args.results, rows)
        print()
        print_table(rows, {"what": lambda row: row["shape"]["what"], **TIMING_COLUMNS, "bytes to rank 0": "bytes",
                           "N·(8kW+64)": "bound"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
