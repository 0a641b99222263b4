"""Shared benchmark harness: model shapes, LLM-like inputs, timing protocols, peak memory, and
the results file each benchmark appends to (``benchmarks/results/<benchmark>.jsonl``).

Timing protocols (CUDA events, milliseconds per call):
- ``blocks`` (`time_ms`): a few warm-up calls, then each call timed from a synchronized start;
  the median, with the 20th and 80th percentiles.
- ``sustained`` (`time_sustained_ms`): each call back to back for 1 s untimed, then 1 s timed,
  the calls in turn by block, 3 rounds; the ratio to the first call is the median of the
  per-round ratios. A teacher scoring a dataset runs like this: the card held at its power limit.

A results row (`result_row`) is one measurement: benchmark, date, commit, gpu, torch, triton,
cuda, shape (a dict), provider, protocol, ms, floor (the provider the ratio is taken to),
ratio (to the floor of the same run and protocol), peak_extra_gib (peak memory allocated during
the call beyond what was allocated before it and the outputs every provider returns), and the
benchmark's own fields.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # tokens (rows)
    h: int  # hidden size
    v: int  # vocab (lm_head rows)


STUDENT_SHAPES = {
    "s1": Shape("S1 (Qwen-like student)", 8192, 2048, 151_936),
    "qwen3-0.6b": Shape("Qwen3-0.6B-like student", 16_384, 1024, 151_936),
    "llama3-8b": Shape("Llama-3-8B-like student", 8192, 4096, 128_256),
}
TEACHER_SHAPES = {
    "qwen": Shape("Qwen-like teacher", 8192, 4096, 151_936),
    "llama": Shape("Llama-like teacher", 16_384, 4096, 128_256),
}


def pick(table: dict, names: str, parser: argparse.ArgumentParser, option: str) -> list:
    """The entries of ``table`` named in the comma-separated ``names`` (or every one for "all")."""
    if names == "all":
        return list(table.values())
    chosen = [part.strip().lower() for part in names.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in table]
    if unknown or not chosen:
        parser.error(f"{option}: expected all or a comma-separated list of {', '.join(table)}, got {names!r}")
    return [table[name] for name in chosen]


def int_list(text: str) -> list[int]:
    """"8,64,1024" -> [8, 64, 1024] (argparse type)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def add_results_arguments(parser: argparse.ArgumentParser, benchmark: str) -> None:
    parser.add_argument("--results", default=os.path.join(RESULTS_DIR, f"{benchmark}.jsonl"),
                        help="JSONL file the rows are appended to (default: %(default)s); 'none' writes nothing")
    parser.add_argument("--commit", default=None,
                        help="the commit the rows name (default: git rev-parse --short HEAD of this checkout)")


# ---- inputs --------------------------------------------------------------------------------


def mean_entropy(hidden: torch.Tensor, weight: torch.Tensor, rows: int = 512) -> float:
    logprobs = torch.log_softmax((hidden[:rows] @ weight.T).float(), -1)
    return -(logprobs.exp() * logprobs).sum(-1).mean().item()


def llm_like_hidden(n: int, h: int, weight: torch.Tensor, target_entropy: float = 3.0,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """(hidden ``[N, H]``, its mean entropy, the scale): random hidden states scaled so that
    softmax(hidden @ weight.T) has a mean entropy near ``target_entropy`` nats (a trained LM's
    2-4), never near-uniform logits."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(n, h, device="cuda", generator=generator, dtype=torch.float32)
    low, high = 0.1, 50.0
    for _ in range(25):
        scale = (low * high) ** 0.5
        if mean_entropy((base[:512] * scale).to(dtype), weight) > target_entropy:
            low = scale
        else:
            high = scale
    hidden = (base * scale).to(dtype)
    return hidden, mean_entropy(hidden, weight), scale


def lm_head(v: int, h: int, seed: int = 0) -> torch.Tensor:
    """A bf16 ``[V, H]`` lm_head with N(0, 0.02²) entries."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(v, h, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)


# ---- timing and memory ---------------------------------------------------------------------


def elapsed_ms(fn, args=()) -> float:
    """``fn(*args)`` from a synchronized start, timed by device events, in ms."""
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop)


def time_ms(fn, setup=None, warmup: int = 3, repeats: int = 10) -> tuple[float, float, float]:
    """Protocol "blocks": (median, p20, p80) of ``fn(*setup())`` in ms over ``repeats`` calls after
    ``warmup``; ``setup()`` runs untimed before each call."""
    times = []
    for index in range(warmup + repeats):
        elapsed = elapsed_ms(fn, setup() if setup else ())
        if index >= warmup:
            times.append(elapsed)
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


def time_sustained_ms(calls: dict, seconds: float = 1.0, rounds: int = 3) -> tuple[dict, dict]:
    """Protocol "sustained": ``{name: fn}``, each run back to back for ``seconds`` untimed (to its
    steady power state), then as long again timed, the names in turn, ``rounds`` times ->
    (``{name: median ms a call}``, ``{name: median over the rounds of its ms / the first name's}``)."""
    for fn in calls.values():
        elapsed_ms(fn)  # compiled and allocated before a call sizes its blocks
    per_block = {name: max(3, round(seconds * 1e3 / elapsed_ms(fn))) for name, fn in calls.items()}

    def block(fn, count):
        for _ in range(count):
            fn()

    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            block(fn, per_block[name])
            times[name].append(elapsed_ms(block, (fn, per_block[name])) / per_block[name])
    first = times[next(iter(calls))]
    ratios = {name: statistics.median(t / f for t, f in zip(values, first)) for name, values in times.items()}
    return {name: statistics.median(values) for name, values in times.items()}, ratios


def peak_extra_gib(fn, setup=None, keep_bytes: int = 0) -> float:
    """Peak memory allocated during ``fn(*setup())`` beyond what was allocated before it and
    ``keep_bytes`` (the outputs every provider returns), in GiB."""
    args = setup() if setup else ()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before - keep_bytes) / 2**30


# ---- results -------------------------------------------------------------------------------


def environment(commit: str | None = None) -> dict:
    """GPU (or "cpu"), torch / triton / CUDA versions, today's date and the commit."""
    if not commit:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True).stdout.strip() or "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(date=datetime.date.today().isoformat(), commit=commit,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda)


def result_row(env: dict, benchmark: str, shape: dict, provider: str, protocol: str, ms, floor: str, ratio,
               peak_extra_gib=None, **fields) -> dict:
    return dict(benchmark=benchmark, **env, shape=shape, provider=provider, protocol=protocol, ms=ms, floor=floor,
                ratio=ratio, peak_extra_gib=peak_extra_gib, **fields)


def shape_fields(shape: Shape, **more) -> dict:
    return {**asdict(shape), **more}


def append_rows(path: str, rows: list[dict]) -> None:
    """Appends ``rows`` to the JSONL file ``path`` ('none': nothing)."""
    if path == "none" or not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows appended to {path}")


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def print_table(rows: list[dict], columns: dict) -> None:
    """A markdown table of ``rows``: ``{header: a row's field name, or a function of the row}``."""
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        cells = (get(row) if callable(get) else row.get(get) for get in columns.values())
        print("| " + " | ".join(_cell(value) for value in cells) + " |")


TIMING_COLUMNS = {"shape": lambda row: row["shape"]["name"], "k": lambda row: row["shape"].get("k"),
                  "provider": "provider", "protocol": "protocol", "ms": "ms", "× floor": "ratio",
                  "peak extra GiB": "peak_extra_gib"}
