"""Vocab parallel on two GPUs: TP = 2 against TP = 1 for the student loss (fwd + bwd) and
the teacher top-k at 8192 × 4096 × 151,936, k = 64; per-GPU time, bytes communicated per
step (counted at the collectives), peak memory.

    torchrun --nproc_per_node 2 benchmarks/bench_vocab_parallel.py [--out results.json]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from kd_kernels.distributed import CollectiveBytes  # noqa: E402
from harness import environment, llm_like_hidden, time_ms, write_json  # noqa: E402

N, H, V, K = 8192, 4096, 151_936, 64


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)  # the same tensors on every rank
    weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(N, H, weight)
    teacher_weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    teacher_hidden, _, _ = llm_like_hidden(N, H, teacher_weight, seed=3)
    labels = torch.randint(0, V, (N,), device="cuda")
    local = V // world
    shard = slice(rank * local, (rank + 1) * local)
    teacher = kd.teacher_topk(teacher_hidden, teacher_weight, k=K, temperature=2.0)
    group = dist.group.WORLD

    def student(weight_part, group_arg):
        def run():
            x = hidden.detach().requires_grad_()
            w = weight_part.detach().requires_grad_()
            kd.topk_divergence(x, w, teacher, labels, temperature=2.0, ce_weight=0.5, group=group_arg,
                               check_values=False).backward()
        return run

    def student_forward(weight_part, group_arg):
        def run():
            with torch.no_grad():
                kd.topk_divergence(hidden, weight_part, teacher, labels, temperature=2.0, ce_weight=0.5,
                                   group=group_arg, check_values=False)
        return run

    def teacher_side(weight_part, group_arg):
        return lambda: kd.teacher_topk(teacher_hidden, weight_part, k=K, temperature=2.0, group=group_arg)

    rows = []
    for name, tp1, tp2 in (("student fwd+bwd", student(weight, None), student(weight[shard], group)),
                           ("student fwd", student_forward(weight, None), student_forward(weight[shard], group)),
                           ("teacher top-k", teacher_side(teacher_weight, None), teacher_side(teacher_weight[shard],
                                                                                               group))):
        dist.barrier()
        one = time_ms(tp1)[0]
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        two = time_ms(tp2)[0]
        peak = torch.cuda.max_memory_allocated() / 2**30
        with CollectiveBytes() as counter:
            tp2()
        torch.cuda.synchronize()
        rows.append(dict(what=name, tp1_ms=one, tp2_ms=two, ratio=two / one, bytes=counter.total,
                         bound=N * (K * 8 * world + 64), peak_gib=peak))
    if rank == 0:
        print(f"environment: {environment()}; N={N} H={H} V={V} k={K}; student entropy {entropy:.2f} nats")
        print("| what | TP=1 ms | TP=2 ms per GPU | TP=2 / TP=1 | bytes per step (rank 0) | N·(8kW+64) | peak GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['what']} | {row['tp1_ms']:.1f} | {row['tp2_ms']:.1f} | {row['ratio']:.2f} | "
                  f"{row['bytes']:,} | {row['bound']:,} | {row['peak_gib']:.2f} |")
        print("student bytes include the dX all-reduce of the backward (N·H·2 bytes), which every "
              "tensor-parallel output layer does; the statistics alone are the forward row's bytes.")
        if args.out:
            write_json(args.out, dict(environment=environment(), rows=rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
