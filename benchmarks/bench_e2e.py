"""Distillation quality of the Ray driver: at equal steps and data, the student distilled from
the teacher's top-k against the same student trained on CE alone.

Providers (protocol "equal steps"): "distilled" and "CE alone" (the floor: kd_weight = 0, its
teacher not pretrained since it is never read). Rows hold ``held_out_ce`` (nats a token on the
held-out rows), ``ratio`` = held-out CE / CE alone's, the train CE of the first and last steps,
the median ``tokens_per_s`` and ``ms`` a step, and the teacher's held-out CE. Exits 1 when
distillation does not beat CE alone. On a GPU it runs the driver's GPU default (~2 minutes on
one H200); on CPU the small default (~3 minutes on 2 cores).

With ``--onpolicy``, instead: on-policy distillation at equal steps (protocol "equal steps,
on-policy"): off-policy (mode=gkd with lmbda 0, which trains exactly as mode=off_policy, with
sft_alpha = ce_weight), GKD (lmbda 0.5), on-policy (lmbda 1) and CE alone (kd_weight 0,
sft_alpha 1, lmbda 0), every run with a pretrained teacher; rows add ``teacher_reverse_kl``, the
teacher's reverse KL of the student's samples of held-out prompts (nats a token). The driver's
loss options apply to every run: on-policy distillation usually runs reverse_kl or jsd
(``--set divergence=reverse_kl``).

usage: python benchmarks/bench_e2e.py [--set key=value ...]   (the driver's options)
       python benchmarks/bench_e2e.py --quality [--samples 12] [--set ...]   (teacher signals compared)
       python benchmarks/bench_e2e.py --cache-read   (teacher cache read tokens/s against the student loss's)
       python benchmarks/bench_e2e.py --onpolicy [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import add_results_arguments, append_rows, environment, print_table, result_row  # noqa: E402
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402

BENCHMARK = "bench_e2e"
FLOOR = "CE alone"
# CE alone never reads the teacher's top-k (kd_weight = 0): its teacher is left unpretrained
RUNS = (("distilled", []), (FLOOR, ["kd_weight=0", "ce_weight=1", "teacher_pretrain_steps=0"]))


def measure(name, overrides, output_dir) -> dict:
    config = load_config(None, overrides + [f"output_dir={output_dir}/{name.replace(' ', '_')}", "overwrite=true"])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle]
    return dict(held_out_ce=summary["student_held_out_ce"], teacher_held_out_ce=summary["teacher_held_out_ce"],
                train_ce_first=records[0]["ce"], train_ce_last=records[-1]["ce"],
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                ms=1e3 * statistics.median(r["tokens"] / r["tokens_per_s"] for r in records))


def publish(args, env: dict, rows: list[dict], columns: dict) -> None:
    """The environment line, the rows appended to the results file, and their table."""
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, columns)


def quality(args) -> None:
    """The --quality part: the teacher signals at equal steps and data (benchmarks/e2e_quality.py)."""
    from e2e_quality import CE_ONLY, compare

    base = load_config(None, args.set)
    env = environment(args.commit)
    shape = dict(name="signal quality", device=base.device, steps=base.steps, seed=base.seed,
                 tokens_per_step=base.row_tokens * base.rows_per_micro_batch * base.micro_batches,
                 vocab=base.tokenizer_vocab, samples=args.samples)
    measured = compare(base, args.samples, progress=True)
    rows = [result_row(env, "bench_e2e_quality", shape, m.pop("name"), "equal steps", m.pop("ms"), CE_ONLY,
                       m["gain_recovered"], None, **m) for m in measured]
    publish(args, env, rows, {"signal": "provider", "held-out CE": "held_out_ce", "KL to teacher": "kl_to_teacher",
                       "B/token": "bytes_per_token", "gain recovered": "gain_recovered",
                       "per byte": "recovered_per_byte", "ms/step": "ms"})


def cache_read(args) -> None:
    """The --cache-read part: the teacher cache's read rate (tokens/s, decoded) against the fused
    student loss's tokens/s at V = 151,936 (on CUDA; the loss alone bounds a student's rate)."""
    import tempfile

    import torch
    from e2e_quality import cache_read_rate, student_loss_rate

    env = environment(args.commit)
    device = "cuda" if torch.cuda.is_available() else None
    student = student_loss_rate() if device else None
    rows = []
    for encoding, kind, entries in (("lossless", "topk", 64), ("compact", "topk", 64), ("lossless", "samples", 12),
                                    ("compact", "samples", 12)):
        with tempfile.TemporaryDirectory() as directory:
            measured = cache_read_rate(directory, encoding, kind, entries, device=device)
        shape = dict(name="cache read", vocab=151_936, kind=kind, entries=entries, encoding=encoding)
        ratio = measured["tokens_per_s"] / student if student else None
        rows.append(result_row(env, "bench_e2e_cache_read", shape, f"{kind} {entries} {encoding}", "once",
                               measured.pop("ms"), "student loss tokens/s", ratio, None, student_tokens_per_s=student,
                               **measured))
    publish(args, env, rows, {"cache": "provider", "tokens/s": "tokens_per_s", "B/token": "bytes_per_token",
                       "× student": "ratio"})


def onpolicy_rows(args, env: dict) -> list[dict]:
    """The on-policy comparison (module docstring): four runs at equal steps."""
    base = load_config(None, args.set)
    off_policy = ["mode=gkd", "lmbda=0", f"sft_alpha={base.ce_weight}"]
    runs = (("off-policy (lmbda 0)", off_policy), ("GKD (lmbda 0.5)", ["mode=gkd", "lmbda=0.5"]),
            ("on-policy (lmbda 1)", ["mode=on_policy"]),
            (FLOOR, ["mode=gkd", "lmbda=0", "kd_weight=0", "ce_weight=1", "sft_alpha=1"]))
    shape = dict(name="driver default, on-policy", device=base.device, steps=base.steps, seed=base.seed, k=base.k,
                 divergence=base.divergence, samples_per_step=base.rows_per_micro_batch * base.micro_batches,
                 max_new_tokens=base.max_new_tokens, vocab=base.tokenizer_vocab)
    measured = {}
    for name, overrides in runs:
        config = load_config(None, args.set + overrides + [f"output_dir={base.output_dir}/onpolicy_"
                                                           f"{name.split(' ')[0]}", "overwrite=true"])
        summary = run(config, progress=False)
        measured[name] = dict(held_out_ce=summary["student_held_out_ce"],
                              teacher_held_out_ce=summary["teacher_held_out_ce"],
                              teacher_reverse_kl=summary["teacher_reverse_kl"], mode=config.mode, lmbda=config.lmbda)
    floor = measured[FLOOR]["held_out_ce"]
    return [result_row(env, BENCHMARK, shape, name, "equal steps, on-policy", None, FLOOR, m["held_out_ce"] / floor,
                       None, **m) for name, m in measured.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a driver option for both runs (python orchestrate.py --help lists them)")
    parser.add_argument("--onpolicy", action="store_true", help="the on-policy comparison instead (see above)")
    add_results_arguments(parser, BENCHMARK)
    signal_quality = parser.add_argument_group("signal quality (--quality: CE only, full-vocab KD, top-k, sampled; "
                                               "benchmarks/e2e_quality.py)")
    signal_quality.add_argument("--quality", action="store_true",
                                help="compare the teacher signals at equal steps and data instead")
    signal_quality.add_argument("--samples", type=int, default=12, help="teacher samples a token of the sampled "
                                "signal")
    cache = parser.add_argument_group("teacher cache read rate (--cache-read)")
    cache.add_argument("--cache-read", action="store_true", help="time reading a synthetic teacher cache instead")
    args = parser.parse_args()
    if args.cache_read:
        cache_read(args)
        return
    if args.quality:
        quality(args)
        return
    if args.onpolicy:
        env = environment(args.commit)
        publish(args, env, onpolicy_rows(args, env),
                {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                 "teacher reverse KL of samples": "teacher_reverse_kl", "teacher held-out CE": "teacher_held_out_ce"})
        return
    base = load_config(None, args.set)
    env = environment(args.commit)
    shape = dict(name="driver default", device=base.device, steps=base.steps, seed=base.seed, k=base.k,
                 divergence=base.divergence, tokens_per_step=base.row_tokens * base.rows_per_micro_batch
                 * base.micro_batches, vocab=base.tokenizer_vocab)
    measured = {name: measure(name, args.set + weights, base.output_dir) for name, weights in RUNS}
    measured[FLOOR]["teacher_held_out_ce"] = None  # that run's teacher was not trained
    floor = measured[FLOOR]["held_out_ce"]
    rows = [result_row(env, BENCHMARK, shape, name, "equal steps", m.pop("ms"), FLOOR, m["held_out_ce"] / floor,
                       None, **m) for name, m in measured.items()]
    publish(args, env, rows, {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                       "teacher held-out CE": "teacher_held_out_ce", "train CE first": "train_ce_first",
                       "last": "train_ce_last", "tokens/s": "tokens_per_s"})
    if measured["distilled"]["held_out_ce"] >= floor:
        sys.exit("distillation did not beat CE alone")


if __name__ == "__main__":
    main()
