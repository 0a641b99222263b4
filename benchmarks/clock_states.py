"""How the timing protocol moves the student's ratio to the floor at S1: the card's SM clock
and power while each call runs back to back (the benchmark's protocol), and the same calls
timed in turn in either order, or each after an idle pause.

The three bare matmuls run at the card's power limit and its clock falls; our step mixes
memory-bound passes with its matmuls. This script shows by how much that changes the ratio.

usage: python benchmarks/clock_states.py
"""
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_topk_divergence import providers, student_problem, timed_call  # noqa: E402
from harness import elapsed_ms, environment  # noqa: E402

N, H, V, K = 8192, 2048, 151_936, 64


def timed(call, setup):
    return elapsed_ms(call, setup())


def clock_log():
    """nvidia-smi sampling SM clock and power every 20 ms into a file (path, process)."""
    path = os.path.join(tempfile.mkdtemp(), "clocks.csv")
    process = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                "--format=csv,noheader,nounits", "-lms", "20"], stdout=open(path, "w"))
    return path, process


def samples_between(path, begin, end):
    clocks, power = [], []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
        except (ValueError, IndexError):
            continue
        if begin <= stamp <= end:
            clocks.append(float(parts[1]))
            power.append(float(parts[2]))
    return (statistics.mean(clocks), statistics.mean(power), len(clocks)) if clocks else (float("nan"),) * 2 + (0,)


def main():
    print(f"environment: {environment()}")
    problem = student_problem(N, H, V, K)
    weight, pool = problem.weight, problem.hidden_pool
    table, _ = providers(problem.teacher, problem.labels, problem.teacher_dense)
    calls = {"floor": timed_call(table["floor: 3 bf16 matmuls"], pool, weight, True),
             "ours fast": timed_call(table["ours fast (forward_kl + CE)"], pool, weight, True)}
    for call, setup in calls.values():
        for _ in range(3):
            timed(call, setup)
    path, process = clock_log()
    time.sleep(0.5)
    try:
        results = {}
        for name, (call, setup) in calls.items():  # A: back to back, the benchmark's protocol
            begin = datetime.datetime.now()
            times = [timed(call, setup) for _ in range(40)]
            clock, power, count = samples_between(path, begin, datetime.datetime.now())
            results[f"A back to back: {name}"] = (statistics.median(times), clock, power, count)
            time.sleep(0.5)
        for order in (("floor", "ours fast"), ("ours fast", "floor")):  # B, C: in turn
            times = {name: [] for name in order}
            for _ in range(20):
                for name in order:
                    times[name].append(timed(*calls[name]))
            for name in order:
                results[f"in turn, {' then '.join(order)}: {name}"] = (statistics.median(times[name]),) + (
                    float("nan"), float("nan"), 0)
            time.sleep(0.5)
        times = {name: [] for name in calls}
        for _ in range(12):  # D: each call after an idle pause
            for name in calls:
                time.sleep(0.2)
                times[name].append(timed(*calls[name]))
        for name in calls:
            results[f"after 200 ms idle: {name}"] = (statistics.median(times[name]), float("nan"), float("nan"), 0)
    finally:
        process.terminate()
    print("| protocol: call | median ms | mean SM MHz | mean W | samples |")
    print("| --- | --- | --- | --- | --- |")
    for label, (ms, clock, power, count) in results.items():
        print(f"| {label} | {ms:.2f} | {clock:.0f} | {power:.0f} | {count} |")
    for prefix in ("A back to back", "in turn, floor then ours fast", "in turn, ours fast then floor",
                   "after 200 ms idle"):
        print(f"{prefix}: ours / floor = {results[prefix + ': ours fast'][0] / results[prefix + ': floor'][0]:.3f}")


if __name__ == "__main__":
    main()
