"""Distill a teacher LM into a student end to end: Ray teacher and student workers, the
teacher's top-k from kd_kernels.teacher_topk sent through the object store as one packed
buffer per micro-batch, the student trained with kd_kernels.topk_divergence, teacher
scoring of step i + 1 overlapped with student training of step i, metrics, checkpoints.

With no arguments it runs an embedded default on whatever the machine has: a byte-level
BPE tokenizer trained on the Python standard library's sources, a small Llama teacher
pretrained briefly on them, and a smaller student distilled from it (a few minutes on
2 CPU cores).

usage: python orchestrate.py [CONFIG.yaml] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os

from orchestration.config import help_text, load_config
from orchestration.driver import run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, epilog=help_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a YAML file of options (see below)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option, e.g. --set output_dir=runs/x (repeatable)")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    summary = run(config)
    result = dict(summary)
    with open(os.path.join(config.output_dir, "summary.json"), "w") as handle:
        json.dump(dict(config=vars(config), **result), handle, indent=2)
    print(f"data: {result['train_rows']} training rows and {result['held_out_rows']} held out, "
          f"{config.row_tokens} tokens each")
    print(f"held-out CE (nats/token): teacher {result['teacher_held_out_ce']:.4f}, "
          f"student {result['student_held_out_ce']:.4f} after {result['last_step'] + 1} steps")
    print(f"results in {config.output_dir}: metrics.jsonl, summary.json, checkpoints/, tokenizer/")
    return result


if __name__ == "__main__":
    main()
