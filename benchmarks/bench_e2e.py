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
    args = parser.parse_args()
    if args.onpolicy:
        env = environment(args.commit)
        rows = onpolicy_rows(args, env)
        print(f"environment: {env}")
        append_rows(args.results, rows)
        print()
        print_table(rows, {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                           "teacher reverse KL of samples": "teacher_reverse_kl",
                           "teacher held-out CE": "teacher_held_out_ce"})
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
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                       "teacher held-out CE": "teacher_held_out_ce", "train CE first": "train_ce_first",
                       "last": "train_ce_last", "tokens/s": "tokens_per_s"})
    if measured["distilled"]["held_out_ce"] >= floor:
        sys.exit("distillation did not beat CE alone")


if __name__ == "__main__":
    main()
