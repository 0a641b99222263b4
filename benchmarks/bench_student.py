"""Student: top-k forward KL + CE through the lm_head, forward and backward (gradients to the
hidden states and the lm_head weight), beside the three bare matmuls (the floor) and the
alternatives a user has, on one GPU.

Providers (ratios to the floor of the same run; protocol "blocks"):
  floor: 3 bf16 matmuls            logits, dX and dW, bf16 out, nothing else
  ours                             kd.topk_divergence(..., ce_weight=1.0)
  ours, lean=True                  the same within ~256 MiB of extra memory
  eager torch                      float32 logits, top-k forward KL (renormalized) + CE
  torch.compile                    the same, compiled
  Liger fused linear CE            CE only (skipped when liger_kernel is not importable)
  Liger fused linear JSD           JSD against a dense teacher, its matmul included
  Cut Cross-Entropy                CE only (skipped when cut_cross_entropy is not importable)
Rows record the forward + backward ms (``ms``) and the forward alone (``forward_ms``); memory is
the peak beyond the inputs and the gradients every provider returns. Ours also records its bf16
loss and gradients' relative errors against the float64 reference (backend="torch") on 2048 rows.
Inputs are LLM-like: hidden states scaled so the student's and the teacher's mean entropy is
3 nats; 5 % of the labels ignored. Default: S1 (8192 × 2048 × 151,936) at k = 64 and 1024,
~3 minutes on one H200.

usage: python benchmarks/bench_student.py [--shapes s1] [--k 64,1024] [--divergences forward_kl,jsd]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import (STUDENT_SHAPES, TIMING_COLUMNS, add_results_arguments, append_rows, environment,  # noqa: E402
                     int_list, lm_head, llm_like_hidden, peak_extra_gib, pick, print_table, result_row, shape_fields,
                     time_ms)

BENCHMARK = "bench_student"
FLOOR = "floor: 3 bf16 matmuls"
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skewed_forward_kl", "skewed_reverse_kl", "adaptive_kl", "tvd")


def eager_kd_ce(hidden, weight, teacher_logprobs, teacher_indices, labels):
    """What a user writes without us: float32 logits, renormalized top-k forward KL + CE."""
    logits = (hidden @ weight.T).float()
    student = torch.log_softmax(logits.gather(1, teacher_indices.long()), -1)
    teacher = torch.log_softmax(teacher_logprobs, -1)
    kd_rows = (teacher.exp() * (teacher - student)).sum(-1)
    ce_rows = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
    counted = labels != -100
    return ((kd_rows + ce_rows) * counted).sum() / counted.sum().clamp(min=1)


compiled_kd_ce = torch.compile(eager_kd_ce)


def optional_baselines(labels, teacher_dense):
    """({name: loss fn(hidden, weight)} of the libraries that import, {name: why skipped})."""
    found, skipped = {}, {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy, liger_fused_linear_jsd

        found["Liger fused linear CE (CE only)"] = lambda x, w: liger_fused_linear_cross_entropy(x, w, labels)
        found["Liger fused linear JSD (dense teacher)"] = lambda x, w: liger_fused_linear_jsd(
            x, w, *teacher_dense, labels, jsd_beta=0.5)
    except Exception as error:  # noqa: BLE001 - any import failure: the baseline is skipped and says why
        skipped["Liger"] = repr(error)
    try:
        from cut_cross_entropy import linear_cross_entropy

        found["Cut Cross-Entropy (CE only)"] = lambda x, w: linear_cross_entropy(x, w, labels)
    except Exception as error:  # noqa: BLE001
        skipped["Cut Cross-Entropy"] = repr(error)
    return found, skipped


def providers(teacher, labels, teacher_dense, divergences):
    """({name: fn(hidden, weight)} that runs forward, and backward when hidden requires grad;
    {name: why skipped})."""
    def backward_if_asked(loss_fn):
        def run(hidden, weight):
            loss = loss_fn(hidden, weight)
            if hidden.requires_grad:
                loss.backward()
        return run

    def ours(divergence="forward_kl", **options):
        return backward_if_asked(lambda x, w: kd.topk_divergence(x, w, teacher, labels, divergence=divergence,
                                                                 ce_weight=1.0, check_values=False, **options))

    def floor(hidden, weight):
        logits = hidden.detach() @ weight.detach().T
        if hidden.requires_grad:
            hidden.grad = logits @ weight.detach()
            weight.grad = logits.T @ hidden.detach()

    table = {FLOOR: floor, "ours": ours(), "ours, lean=True": ours(lean=True)}
    table.update({f"ours ({divergence})": ours(divergence) for divergence in divergences if divergence != "forward_kl"})
    table["eager torch"] = backward_if_asked(lambda x, w: eager_kd_ce(x, w, teacher.logprobs, teacher.indices, labels))
    table["torch.compile"] = backward_if_asked(
        lambda x, w: compiled_kd_ce(x, w, teacher.logprobs, teacher.indices, labels))
    found, skipped = optional_baselines(labels, teacher_dense)
    table.update({name: backward_if_asked(fn) for name, fn in found.items()})
    return table, skipped


def timed_call(fn, hidden_pool, weight, with_grad):
    """(call, setup): each call on fresh leaves, the pool's hidden states in turn."""
    counter = [0]

    def setup():
        counter[0] += 1
        hidden = hidden_pool[counter[0] % len(hidden_pool)].detach().clone().requires_grad_(with_grad)
        weight.grad = None
        weight.requires_grad_(with_grad)
        return hidden, weight

    def call(hidden, w):
        with torch.set_grad_enabled(with_grad):
            fn(hidden, w)

    return call, setup


def bf16_errors(hidden, weight, teacher, labels) -> dict:
    """Relative errors (2-norm) of our bf16 loss and gradients against the float64 reference."""
    leaves = [hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    options = dict(ce_weight=1.0, check_values=False)
    got = kd.topk_divergence(*leaves, teacher, labels, **options)
    expected = kd.topk_divergence(*leaves64, teacher, labels, backend="torch", **options)
    got.backward()
    expected.backward()

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    return dict(loss_rel_error=error(got, expected), d_hidden_rel_error=error(leaves[0].grad, leaves64[0].grad),
                d_weight_rel_error=error(leaves[1].grad, leaves64[1].grad))


def bench_shape(shape, k, divergences, env):
    weight = lm_head(shape.v, shape.h)
    hidden, entropy, _ = llm_like_hidden(shape.n, shape.h, weight)
    hidden_pool = [hidden, llm_like_hidden(shape.n, shape.h, weight, seed=7)[0]]
    teacher_weight = lm_head(shape.v, shape.h, seed=1)
    teacher_hidden, teacher_entropy, _ = llm_like_hidden(shape.n, shape.h, teacher_weight, seed=1)
    values, indices = torch.log_softmax((teacher_hidden @ teacher_weight.T).float(), -1).topk(k, dim=-1)
    teacher = kd.TopK(values, indices.to(torch.int32), temperature=1.0)
    generator = torch.Generator(device="cuda").manual_seed(2)
    labels = torch.randint(0, shape.v, (shape.n,), device="cuda", generator=generator)
    labels[torch.rand(shape.n, device="cuda", generator=generator) < 0.05] = -100
    print(f"\n## {shape.name}: N={shape.n} H={shape.h} V={shape.v} k={k}; student entropy {entropy:.2f} nats, "
          f"teacher {teacher_entropy:.2f}", flush=True)
    table, skipped = providers(teacher, labels, (teacher_hidden, teacher_weight), divergences)
    for name, reason in skipped.items():
        print(f"{name} skipped: {reason}")
    where = shape_fields(shape, k=k, dtype="bfloat16", entropy=round(entropy, 3))
    keep = (shape.n * shape.h + shape.v * shape.h) * 2  # dX and dW, which every provider returns
    measured = {}
    for name, fn in table.items():
        forward = time_ms(*timed_call(fn, hidden_pool, weight, with_grad=False))[0]
        call, setup = timed_call(fn, hidden_pool, weight, with_grad=True)
        median, low, high = time_ms(call, setup)
        measured[name] = dict(ms=median, p20=low, p80=high, forward_ms=forward,
                              peak=peak_extra_gib(call, setup, keep_bytes=keep))
        torch.cuda.empty_cache()
    head = slice(0, 2048)
    errors = bf16_errors(hidden[head], weight, kd.TopK(teacher.logprobs[head], teacher.indices[head],
                                                       temperature=1.0), labels[head])
    print(f"ours, bf16 against float64 on 2048 rows: {errors}")
    floor_ms = measured[FLOOR]["ms"]
    return [result_row(env, BENCHMARK, where, name, "blocks", m["ms"], FLOOR, m["ms"] / floor_ms, m["peak"],
                       p20=m["p20"], p80=m["p80"], forward_ms=m["forward_ms"], **(errors if name == "ours" else {}))
            for name, m in measured.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="s1", help=f"all or a comma-separated list of {', '.join(STUDENT_SHAPES)} "
                                                       "(default s1)")
    parser.add_argument("--k", type=int_list, default=[64, 1024], help="comma-separated k (default 64,1024)")
    parser.add_argument("--divergences", default="forward_kl",
                        help=f"ours with each of these too (comma-separated: {', '.join(DIVERGENCES)}); "
                             "the baselines compute forward KL")
    add_results_arguments(parser, BENCHMARK)
    args = parser.parse_args()
    shapes = pick(STUDENT_SHAPES, args.shapes, parser, "--shapes")
    divergences = [part for part in args.divergences.split(",") if part]
    if not divergences or set(divergences) - set(DIVERGENCES):
        parser.error(f"--divergences: expected a comma-separated list of {', '.join(DIVERGENCES)}, "
                     f"got {args.divergences!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_student: needs a CUDA device")
    env = environment(args.commit)
    print(f"environment: {env}")
    rows = [row for shape in shapes for k in args.k for row in bench_shape(shape, k, divergences, env)]
    append_rows(args.results, rows)
    print()
    print_table(rows, {**TIMING_COLUMNS, "forward ms": "forward_ms"})


if __name__ == "__main__":
    main()
