"""Distillation quality and throughput of the Ray driver: at equal steps and data, the
student distilled from the teacher against the same student trained on CE alone.

usage: python benchmarks/bench_e2e.py [--set key=value ...]   (the driver's options)
Prints both held-out CEs, the loss curves' endpoints and tokens/s; fails if distillation
does not beat CE alone.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402


def curve(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    base = load_config(None, args.set)
    results = {}
    # CE alone never reads the teacher's top-k (kd_weight = 0): its teacher is left unpretrained
    for name, weights in (("distilled", []), ("ce_only", ["kd_weight=0", "ce_weight=1", "teacher_pretrain_steps=0"])):
        config = load_config(None, args.set + [f"output_dir={base.output_dir}/{name}"] + weights)
        summary = run(config, progress=False)
        records = curve(summary["metrics"])
        row = results[name] = dict(held_out_ce=summary["student_held_out_ce"],
                                   teacher_held_out_ce=summary["teacher_held_out_ce"],
                                   first_ce=records[0]["ce"], last_ce=records[-1]["ce"],
                                   tokens_per_s=statistics.median(r["tokens_per_s"] for r in records))
        teacher = f" (teacher {row['teacher_held_out_ce']:.4f})" if name == "distilled" else ""
        print(f"{name:>9}: held-out CE {row['held_out_ce']:.4f}{teacher}; train CE {row['first_ce']:.3f} -> "
              f"{row['last_ce']:.3f}; median {row['tokens_per_s']:.0f} tokens/s", flush=True)
    with open(os.path.join(base.output_dir, "bench_e2e.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    assert results["distilled"]["held_out_ce"] < results["ce_only"]["held_out_ce"], "distillation did not help"


if __name__ == "__main__":
    main()
