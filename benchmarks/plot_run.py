"""Draws a distillation run's curves from its metrics.jsonl into a PNG.

usage: python benchmarks/plot_run.py RUN_DIR_OR_METRICS_JSONL [-o OUT.png] [--keys loss,kd,...]

One panel a metric against the step: by default loss, kd, ce, held_out_ce, held_out_kd,
grad_norm, tokens_per_s, lr and teacher_tail_mass, those the log holds (held-out values are
drawn at the steps they were measured). Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import math
import os
import sys

DEFAULT_KEYS = ("loss", "kd", "ce", "held_out_ce", "held_out_kd", "grad_norm", "tokens_per_s", "lr",
                "teacher_tail_mass")


def read_rows(path: str) -> list:
    """The JSON objects of a metrics.jsonl (a run directory: its metrics.jsonl)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def series(rows: list, key: str) -> tuple:
    """(steps, values) of the rows that hold a finite number for ``key``."""
    points = [(row["step"], row[key]) for row in rows
              if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
    return tuple(zip(*points)) if points else ((), ())


def plot(rows: list, keys: list, output: str, title: str) -> list:
    """Writes the PNG; returns the keys drawn."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_run.py needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [key for key in keys if series(rows, key)[0]]
    if not drawn:
        raise SystemExit(f"none of the keys {keys} has values in the log (keys there: "
                         f"{sorted({name for row in rows for name in row})})")
    columns = min(3, len(drawn))
    lines = -(-len(drawn) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.5 * columns, 3.2 * lines), squeeze=False)
    for axis, key in zip(axes.flat, drawn):
        steps, values = series(rows, key)
        axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        axis.set_title(key)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(drawn):]:
        axis.axis("off")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return drawn


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory (with metrics.jsonl) or a metrics.jsonl")
    parser.add_argument("-o", "--output", help="the PNG (default: curves.png next to the log)")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated metrics to draw")
    args = parser.parse_args(argv)
    rows = read_rows(args.run)
    if not rows or any("step" not in row for row in rows):
        raise SystemExit(f"{args.run}: expected JSON lines with a 'step' key")
    directory = args.run if os.path.isdir(args.run) else os.path.dirname(os.path.abspath(args.run))
    output = args.output or os.path.join(directory, "curves.png")
    drawn = plot(rows, [key for key in args.keys.split(",") if key], output, os.path.basename(directory))
    print(f"{output}: {', '.join(drawn)} over {len(rows)} steps")


if __name__ == "__main__":
    sys.exit(main())
