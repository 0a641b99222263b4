"""Student loss forward + backward (grads to hidden and lm_head weight), providers side by side.

Providers: ours (fast default chunk, lean chunk), the three bare bf16 matmuls (the floor),
eager PyTorch top-k forward KL + CE on materialized logits, torch.compile of it, Liger
fused linear CE and fused linear JSD (dense teacher), Cut Cross-Entropy (CE only).
Inputs are LLM-like (mean student entropy calibrated to ~3 nats, printed).

usage: python benchmarks/bench_topk_divergence.py [--shapes S1,...] [--ours-only] [--out results.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import (environment, environment_variable, llm_like_hidden, peak_extra_gib,  # noqa: E402
                     time_interleaved_ms, time_ms, write_json)
from shapes import STUDENT_SHAPES  # noqa: E402


def teacher_topk_dense(n, h, v, k, seed=1):
    """A random teacher with LLM-like entropy; its top-k by plain torch (not timed)."""
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight, seed=seed)
    logprobs = torch.log_softmax((hidden @ weight.T).float(), -1)
    values, indices = logprobs.topk(k, dim=-1)
    del logprobs
    return kd.TopK(values, indices.to(torch.int32), temperature=1.0), hidden, weight, entropy


def eager_kd_ce(hidden, weight, teacher_logprobs, teacher_indices, labels):
    """What a user writes without us: materialized fp32 logits, renormalized top-k forward KL + CE."""
    logits = (hidden @ weight.T).float()
    student_at_ids = torch.log_softmax(logits.gather(1, teacher_indices.long()), -1)
    teacher_p = torch.softmax(teacher_logprobs, -1)
    kd_rows = (teacher_p * (torch.log_softmax(teacher_logprobs, -1) - student_at_ids)).sum(-1)
    ce_rows = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
    counted = (labels != -100)
    return ((kd_rows + ce_rows) * counted).sum() / counted.sum().clamp(min=1)


_compiled_eager = torch.compile(eager_kd_ce)


def student_passes(passes):
    """``KD_KERNELS_STUDENT_PASSES`` set to ``passes`` (None: left as it is) inside the block."""
    return environment_variable("KD_KERNELS_STUDENT_PASSES", passes)


def providers(teacher, labels, teacher_dense):
    def ours(passes=None, **options):
        def run(hidden, weight):
            with student_passes(passes):
                loss = kd.topk_divergence(hidden, weight, teacher, labels, ce_weight=1.0, check_values=False,
                                          backend="triton", **options)
                if hidden.requires_grad:
                    loss.backward()
        return run

    def floor(hidden, weight):
        logits = hidden.detach() @ weight.detach().T
        if hidden.requires_grad:
            hidden.grad = logits @ weight.detach()
            weight.grad = logits.T @ hidden.detach()

    def eager(fn):
        def run(hidden, weight):
            loss = fn(hidden, weight, teacher.logprobs, teacher.indices, labels)
            if hidden.requires_grad:
                loss.backward()
        return run

    table = {"floor: 3 bf16 matmuls": floor, "ours fast (forward_kl + CE)": ours(),
             "ours lean (lean=True)": ours(lean=True), "eager torch (top-k FKL + CE)": eager(eager_kd_ce),
             "torch.compile (top-k FKL + CE)": eager(_compiled_eager)}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy, liger_fused_linear_jsd

        def liger_ce(hidden, weight):
            loss = liger_fused_linear_cross_entropy(hidden, weight, labels)
            if hidden.requires_grad:
                loss.backward()

        def liger_jsd(hidden, weight):
            teacher_hidden, teacher_weight = teacher_dense
            loss = liger_fused_linear_jsd(hidden, weight, teacher_hidden, teacher_weight, labels, jsd_beta=0.5)
            if hidden.requires_grad:
                loss.backward()
        table["Liger fused linear CE (CE only)"] = liger_ce
        table["Liger fused linear JSD (dense teacher)"] = liger_jsd
    except Exception as error:  # noqa: BLE001 - a missing baseline is reported, not fatal
        print(f"Liger unavailable: {error!r}")
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(hidden, weight):
            loss = linear_cross_entropy(hidden, weight, labels)
            if hidden.requires_grad:
                loss.backward()
        table["Cut Cross-Entropy (CE only)"] = cce
    except Exception as error:  # noqa: BLE001
        print(f"CCE unavailable: {error!r}")
    return table, ours


def timed_call(fn, hidden_pool, weight, with_grad):
    """(call, setup) for the harness: each call on fresh leaves (the pool's hidden states in turn)."""
    counter = [0]

    def setup():
        counter[0] += 1
        hidden = hidden_pool[counter[0] % len(hidden_pool)].detach().clone().requires_grad_(with_grad)
        weight.grad = None
        weight.requires_grad_(with_grad)
        return hidden, weight

    def call(hidden, w):
        if with_grad:
            fn(hidden, w)
        else:
            with torch.no_grad():
                fn(hidden, w)

    return call, setup


def measure(fn, hidden_pool, weight, n, h, v, with_grad):
    call, setup = timed_call(fn, hidden_pool, weight, with_grad)
    median, low, high = time_ms(call, setup)
    keep = (n * h + v * h) * 2 if with_grad else 0
    memory = peak_extra_gib(call, setup, keep_bytes=keep)
    return median, low, high, memory


@dataclasses.dataclass
class StudentProblem:
    """The benchmark's inputs: a bf16 lm_head, two LLM-like hidden-state sets (and the student's
    entropy and hidden scale), the teacher's top-k (its dense hidden and weight for Liger, its
    entropy), labels with 5 % ignored."""
    weight: torch.Tensor
    hidden_pool: list
    entropy: float
    scale: float
    teacher: kd.TopK
    teacher_dense: tuple
    teacher_entropy: float
    labels: torch.Tensor


def student_problem(n, h, v, k) -> StudentProblem:
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, scale = llm_like_hidden(n, h, weight)
    hidden_pool = [hidden, llm_like_hidden(n, h, weight, seed=7)[0]]
    teacher, teacher_hidden, teacher_weight, teacher_entropy = teacher_topk_dense(n, h, v, k)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[torch.rand(n, device="cuda") < 0.05] = -100
    return StudentProblem(weight, hidden_pool, entropy, scale, teacher, (teacher_hidden, teacher_weight),
                          teacher_entropy, labels)


def bench_shape(name, n, h, v, k, extra_variants, only_ours=False, interleaved=0):
    problem = student_problem(n, h, v, k)
    weight, hidden_pool, teacher, labels = problem.weight, problem.hidden_pool, problem.teacher, problem.labels
    hidden, entropy, teacher_entropy = hidden_pool[0], problem.entropy, problem.teacher_entropy
    table, ours = providers(teacher, labels, problem.teacher_dense)
    if only_ours:
        table = {label: fn for label, fn in table.items() if label.startswith(("floor", "ours"))}
    print(f"\n## {name}: N={n} H={h} V={v} k={k}; student entropy {entropy:.2f} nats (hidden × {problem.scale:.2f}), "
          f"teacher {teacher_entropy:.2f}")
    flops = 6 * n * h * v
    rows = []
    for label, fn in list(table.items()) + [(f"ours {variant}", ours(**options)) for variant, options in extra_variants]:
        try:
            fwd = measure(fn, hidden_pool, weight, n, h, v, with_grad=False)
            full = measure(fn, hidden_pool, weight, n, h, v, with_grad=True)
        except Exception as error:  # noqa: BLE001
            print(f"{label}: failed: {error!r}")
            torch.cuda.empty_cache()
            continue
        rows.append(dict(provider=label, fwd_ms=fwd[0], fwd_bwd_ms=full[0], fwd_bwd_p20=full[1], fwd_bwd_p80=full[2],
                         peak_extra_gib=full[3], tflops=flops / full[0] / 1e9))
        torch.cuda.empty_cache()
    floor_ms = rows[0]["fwd_bwd_ms"]
    print("| provider | fwd ms | fwd+bwd ms (p20–p80) | × floor | TFLOP/s (6NHV) | peak extra GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        row["x_floor"] = row["fwd_bwd_ms"] / floor_ms
        print(f"| {row['provider']} | {row['fwd_ms']:.1f} | {row['fwd_bwd_ms']:.1f} ({row['fwd_bwd_p20']:.1f}–"
              f"{row['fwd_bwd_p80']:.1f}) | {row['x_floor']:.2f} | {row['tflops']:.0f} | {row['peak_extra_gib']:.3f} |")
    interleaved_rows = None
    if interleaved:
        calls = {label: timed_call(table[label], hidden_pool, weight, True)
                 for label in ("floor: 3 bf16 matmuls", "ours fast (forward_kl + CE)", "ours lean (lean=True)")}
        summary, ratios = time_interleaved_ms(calls, warmup=3, repeats=interleaved)
        print(f"interleaved fwd+bwd ({interleaved} repetitions, each call in turn):")
        print("| provider | ms (p20–p80) | × floor (median of per-repetition ratios) |")
        print("| --- | --- | --- |")
        for label, (median, low, high) in summary.items():
            print(f"| {label} | {median:.2f} ({low:.2f}–{high:.2f}) | {ratios[label]:.3f} |")
        interleaved_rows = {label: dict(ms=summary[label], x_floor=ratios[label]) for label in calls}
    # our bf16 loss and gradients against float64 on the first 2048 rows
    head = (hidden[:2048], weight, kd.TopK(teacher.logprobs[:2048], teacher.indices[:2048], None, 1.0), labels[:2048])
    accuracy = bf16_accuracy(*head)
    print(f"bf16 accuracy vs float64 reference (2048 rows): {accuracy}")
    for variant, options in extra_variants:
        if not {"chunk_rows", "passes"} & options.keys():
            continue
        ours = {name: value for name, value in options.items() if name != "passes"}
        if "chunk_rows" in ours:  # as many chunks on 2048 rows as on the n rows: as many bf16 dW additions
            ours["chunk_rows"] = max(1, ours["chunk_rows"] * 2048 // n)
        with student_passes(options.get("passes")):
            accuracy[variant] = bf16_accuracy(*head, **ours)
        print(f"bf16 accuracy, {variant} ({ours or 'defaults'} on 2048 rows): {accuracy[variant]}")
    return dict(shape=name, n=n, h=h, v=v, k=k, entropy=entropy, teacher_entropy=teacher_entropy, rows=rows,
                interleaved=interleaved_rows, accuracy=accuracy)


def bf16_accuracy(hidden, weight, teacher, labels, **ours):
    """Relative errors of our bf16 loss and gradients against the float64 reference; ``ours``:
    extra options of our call (e.g. chunk_rows, to count bf16 dW accumulation over chunks)."""
    leaves = [hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    options = dict(ce_weight=1.0, check_values=False)
    got = kd.topk_divergence(*leaves, teacher, labels, backend="triton", **options, **ours)
    expected = kd.topk_divergence(*leaves64, teacher, labels, backend="torch", **options)
    got.backward()
    expected.backward()

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    return dict(loss=error(got, expected), d_hidden=error(leaves[0].grad, leaves64[0].grad),
                d_weight=error(leaves[1].grad, leaves64[1].grad))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="all", help="comma-separated shape names prefixes, or all")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--ours-only", action="store_true", help="only ours and the floor (same run), no baselines")
    parser.add_argument("--ks", default="64,1024", help="k values at S1 (other shapes: k = 64)")
    parser.add_argument("--variants", default="", help="comma-separated parts of the S1 variants' names (default: all)")
    parser.add_argument("--interleaved", type=int, default=0, metavar="REPEATS",
                        help="also time the floor, ours fast and ours lean in turn within each repetition")
    args = parser.parse_args()
    env = environment()
    print(f"environment: {env}")
    results = []
    for name, n, h, v in STUDENT_SHAPES:
        if args.shapes != "all" and not any(name.startswith(prefix) for prefix in args.shapes.split(",")):
            continue
        extra = []
        if name.startswith("S1"):
            extra = [(f"{div} {sup}", dict(divergence=div, support=sup)) for div, sup in (
                ("forward_kl", "tail"), ("reverse_kl", "renormalized"), ("jsd", "renormalized"), ("jsd", "tail"),
                ("skewed_forward_kl", "renormalized"), ("adaptive_kl", "renormalized"), ("tvd", "tail"))]
            extra += [(f"fast, chunk_rows={rows}", dict(chunk_rows=rows)) for rows in (256, 384, 512)]
            extra += [("fast, two passes", dict(passes="two")), ("lean, two passes", dict(lean=True, passes="two"))]
        if args.variants:
            extra = [(label, options) for label, options in extra
                     if any(part in label for part in args.variants.split(","))]
        ks = [int(k) for k in args.ks.split(",")] if name.startswith("S1") else [64]
        if 64 in ks:
            results.append(bench_shape(name, n, h, v, 64, extra, only_ours=args.ours_only,
                                       interleaved=args.interleaved if name.startswith("S1") else 0))
        if 1024 in ks:
            results.append(bench_shape(name + " k=1024", n, h, v, 1024,
                                       [("adaptive_kl renormalized", dict(divergence="adaptive_kl"))], only_ours=True))
    if args.out:
        write_json(args.out, dict(environment=env, results=results))


if __name__ == "__main__":
    main()
