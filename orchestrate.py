"""Distill a teacher LM into a student end to end: Ray teacher and student workers, the
teacher's top-k from kd_kernels.teacher_topk sent as one packed buffer per micro-batch, the
student trained with kd_kernels.topk_divergence, teacher scoring of step i + 1 overlapped
with student training of step i, metrics, checkpoints.

With no arguments it runs an embedded default on whatever the machine has: a byte-level
BPE tokenizer trained on the Python standard library's sources, a small Llama teacher
pretrained briefly on them, and a smaller student distilled from it (a few minutes on
2 CPU cores); ``--set mode=gkd`` (or on_policy) distills on the student's own samples of the
standard library's function signatures, scored by the teacher.

Every option is checked before any work; a bad one exits with status 2 and one line per
problem. Ctrl-C stops after the current step with a checkpoint and prints the command that
resumes (status 130); a worker that dies is named (status 1).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback

from orchestration.config import help_text, load_config, options_markdown
from orchestration.errors import Interrupted, UsageError, WorkerDied, WorkerFailed

USAGE_ERROR, WORKER_ERROR, INTERRUPTED = 2, 1, 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrate.py", description=__doc__, epilog=help_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a YAML file of options (see below)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option, e.g. --set output_dir=runs/x (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in output_dir that verifies (= --set resume=true)")
    parser.add_argument("--address", metavar="auto|HOST:PORT",
                        help="join a running Ray cluster instead of starting one (= --set ray_address=...)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("--options-markdown", action="store_true",
                        help="print the options as a Markdown table (for the docs) and exit")
    return parser


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: the same arguments, then --resume."""
    kept = [argument for argument in argv if argument != "--resume"]
    return "python " + shlex.join(["orchestrate.py", *kept, "--resume"])


def _fail(message: str) -> None:
    print(f"orchestrate.py: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Runs orchestrate.py with ``argv`` (default: sys.argv[1:]); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.options_markdown:
        print(options_markdown())
        return 0
    config = None
    try:
        overrides = args.set + ([f"ray_address={args.address}"] if args.address else [])
        config = load_config(args.config, overrides, resume=args.resume)
        from orchestration.driver import run

        summary = run(config)
    except UsageError as error:
        if args.debug:
            traceback.print_exc()
        for line in error.lines:
            _fail(line)
        return USAGE_ERROR
    except Interrupted as error:
        print(f"orchestrate.py: interrupted after step {error.step}; checkpoint {error.checkpoint}; resume with: "
              f"{resume_command(argv)}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        print(f"orchestrate.py: interrupted; {_resume_hint(config, argv, name_checkpoint=True)}", file=sys.stderr)
        return INTERRUPTED
    except (WorkerDied, WorkerFailed) as error:
        if args.debug:
            traceback.print_exc()
        _fail(f"{error}; {_resume_hint(config, argv, name_checkpoint=False)}")
        return WORKER_ERROR
    except Exception as error:  # noqa: BLE001 - one line for the user; --debug shows the traceback
        if args.debug:
            raise
        _fail(f"{error.__class__.__name__}: {error} (--debug shows the traceback)")
        return WORKER_ERROR
    with open(os.path.join(config.output_dir, "summary.json"), "w") as handle:
        json.dump(dict(config=vars(config), **summary), handle, indent=2)
    if config.mode == "cache":
        state = "complete" if summary["complete"] else "incomplete (run again to continue)"
        print(f"teacher cache {summary['cache']}: {summary['train_rows']} training rows, {summary['kind']} "
              f"({summary['entries']} a position, {summary['bytes_per_position']} B), {state}")
        return 0
    print(f"data: {summary['train_rows']} training rows and {summary['held_out_rows']} held out, "
          f"{config.row_tokens} tokens each")
    print(f"held-out CE (nats/token): teacher {summary['teacher_held_out_ce']:.4f}, "
          f"student {summary['student_held_out_ce']:.4f} after {summary['last_step'] + 1} steps")
    if "teacher_reverse_kl" in summary:
        print(f"teacher's reverse KL of student samples (held-out prompts, nats/token): "
              f"{summary['teacher_reverse_kl']:.4f} over {summary['reverse_kl_tokens']} tokens "
              f"({summary['mode']}, weight_version {summary['weight_version']}); over the teacher's top-{config.k} "
              f"and tail bins: {summary['teacher_reverse_kl_top_k']:.4f}")
    print(f"results in {config.output_dir}: metrics.jsonl, summary.json, checkpoints/, tokenizer/")
    return 0


def _resume_hint(config, argv: list[str], name_checkpoint: bool) -> str:
    """The command that continues a stopped run (resume, or start again without a checkpoint)."""
    from orchestration import checkpoint

    found = checkpoint.newest_good(config.output_dir) if config is not None else None
    if found is None:
        return "no checkpoint yet; start again with: python " + shlex.join(["orchestrate.py", *argv])
    if name_checkpoint:
        return f"resume from {found} with: {resume_command(argv)}"
    return f"resume with: {resume_command(argv)}"


if __name__ == "__main__":
    sys.exit(main())
