"""Shared benchmark harness: CUDA-event timing (warm-up, median, quantiles), peak memory,
LLM-like inputs (entropy calibrated to 2–4 nats), environment record."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import subprocess

import torch


@contextlib.contextmanager
def environment_variable(name, value):
    """``os.environ[name]`` set to ``value`` (None: left as it is) inside the block, restored
    after (the kernels read their switches at each launch)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def with_attributes(module, settings, fn):
    """fn() with the ``module`` attributes named in ``settings`` set to its values, restored
    after (launch settings the kernels read at each call)."""
    before = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        return fn()
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def with_env(name, value, fn):
    """fn() with the environment variable ``name`` set to ``value``."""
    with environment_variable(name, value):
        return fn()


def elapsed_ms(fn, args=()):
    """``fn(*args)`` from a synchronized start, timed by device events, in ms."""
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop)


def time_ms(fn, setup=None, warmup=3, repeats=10):
    """Median and (p20, p80) of ``fn()`` in ms over ``repeats`` runs; ``setup()`` runs untimed before each."""
    times = []
    for index in range(warmup + repeats):
        elapsed = elapsed_ms(fn, setup() if setup else ())
        if index >= warmup:
            times.append(elapsed)
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


def time_interleaved_ms(calls, warmup=2, repeats=15):
    """``{name: (fn, setup)}`` timed in turn within each repetition (so drifts of the clocks or
    the power state fall on every call alike) -> ``{name: (median, p20, p80)}`` in ms, plus
    ``{name: median of the per-repetition ratio to the first call}``."""
    times = {name: [] for name in calls}
    for index in range(warmup + repeats):
        for name, (fn, setup) in calls.items():
            elapsed = elapsed_ms(fn, setup() if setup else ())
            if index >= warmup:
                times[name].append(elapsed)
    first = next(iter(calls))
    ratios = {name: statistics.median(t / f for t, f in zip(times[name], times[first])) for name in calls}
    summary = {}
    for name, values in times.items():
        ordered = sorted(values)
        summary[name] = (statistics.median(ordered), ordered[len(ordered) // 5], ordered[(4 * len(ordered)) // 5])
    return summary, ratios


def time_sustained_ms(calls, seconds=1.0, rounds=3):
    """``{name: fn}`` each run back to back for ``seconds`` at a time, after as long again to bring
    the card to that call's steady power state (a teacher forward over a dataset: the H200 then
    sits at its power limit, and ~100-call blocks catch the card between states), the names in
    turn, ``rounds`` times -> ``{name: median ms per call}``, ``{name: median over the rounds of
    its ms per call / the first name's in the same round}``."""
    times = {name: [] for name in calls}
    for fn in calls.values():
        elapsed_ms(fn)  # compiled and allocated before a call is used to size its blocks
    calls_per_block = {name: max(3, round(seconds * 1e3 / elapsed_ms(fn))) for name, fn in calls.items()}

    def block(fn, count):
        for _ in range(count):
            fn()

    for _ in range(rounds):
        for name, fn in calls.items():
            block(fn, calls_per_block[name])  # to the steady state, untimed
            times[name].append(elapsed_ms(block, (fn, calls_per_block[name])) / calls_per_block[name])
    first = next(iter(calls))
    ratios = {name: statistics.median(t / f for t, f in zip(times[name], times[first])) for name in calls}
    return {name: statistics.median(values) for name, values in times.items()}, ratios


def time_after_idle_ms(fn, setup=None, idle_s=0.2, repeats=10):
    """Median of ``fn()`` in ms, each run after ``idle_s`` of host sleep (the card back at its
    boost clock, whatever ran before: the protocol that compares calls at equal clocks)."""
    import time

    elapsed_ms(fn, setup() if setup else ())  # warm-up
    times = []
    for _ in range(repeats):
        time.sleep(idle_s)
        times.append(elapsed_ms(fn, setup() if setup else ()))
    return statistics.median(times)


def kernel_times(call, repeats=5):
    """{kernel name: median over ``repeats`` calls of its summed device time in ms} (torch.profiler:
    steadier than whole-call ratios for A/B of kernels)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    samples = defaultdict(list)
    for _ in range(repeats):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            call()
            torch.cuda.synchronize()
        totals = defaultdict(float)
        for event in profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] += event.device_time_total / 1000
        for name, total in totals.items():
            samples[name].append(total)
    return {name: statistics.median(values) for name, values in samples.items()}


def check_variants_agree(calls, exact=()):
    """Each variant's `TopK` (``calls`` {name: (fn, setup)}) against the first's: bit for bit for
    the names in ``exact``; the others (sums in another order, or rows redone by cuBLAS) with
    log-probs within 1e-4 and ids swapped at under 1e-4 of the entries, printed."""
    first = calls[next(iter(calls))][0]()
    for name, (call, _) in calls.items():
        out = call()
        if name in exact:
            assert torch.equal(out.indices, first.indices) and torch.equal(out.logprobs, first.logprobs), name
            continue
        largest = (out.logprobs - first.logprobs).abs().max().item()
        swapped = (out.indices != first.indices).float().mean().item()
        print(f"{name}: log-probs within {largest:.2e} of the first variant's, ids swapped {swapped:.2e}")
        assert largest < 1e-4 and swapped < 1e-4, name


def print_variant_kernels(calls, floor, parts):
    """A markdown table of variants ``calls`` ({name: (fn, setup)}, the first the reference): per
    variant the device ms of the kernels whose names contain each of ``parts`` ({column: name
    part}, `kernel_times`), then the whole call timed in turn with ``floor`` and against the first."""
    print(f"| variant | {' | '.join(parts)} | whole (in turn) | × first |")
    print("|" + " --- |" * (len(parts) + 3))
    summary, ratios = time_interleaved_ms({"floor": (floor, None), **calls})
    first = summary[next(iter(calls))][0]
    for name, (call, _) in calls.items():
        times = kernel_times(call)
        columns = [sum(ms for kernel, ms in times.items() if part in kernel) for part in parts.values()]
        print(f"| {name} | {' | '.join(f'{ms:.3f}' for ms in columns)} | {summary[name][0]:.2f} "
              f"({ratios[name]:.3f}× the matmul) | {summary[name][0] / first:.3f} |", flush=True)


def print_device_gaps(fn, annotation="call"):
    """Runs ``fn`` once from a synchronized start under torch.profiler and prints where the device
    waited: the call's span (its host start to its last kernel's end), the kernels' busy time,
    the time before the first kernel, the largest gaps between kernels with the kernels around
    them, and the host ops before the first kernel."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function(annotation):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as trace:
        events = json.load(trace)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    marker = next(e for e in events if e.get("name") == annotation and e.get("cat") == "user_annotation")
    start, end = marker["ts"], kernels[-1]["ts"] + kernels[-1]["dur"]
    busy = sum(e["dur"] for e in kernels)
    print(f"{annotation} (host start of the call -> last kernel end): {(end - start) / 1e3:.2f} ms; kernels "
          f"{busy / 1e3:.2f} ms; before the first kernel {(kernels[0]['ts'] - start) / 1e3:.3f} ms; "
          f"{len(kernels)} kernels")
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50]) for a, b in zip(kernels, kernels[1:])]
    print(f"gaps between kernels: {sum(g for g, *_ in gaps if g > 0) / 1e3:.3f} ms in all; largest:")
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {gap / 1e3:7.3f} ms  after {before}  before {after}")
    host_ops = [e for e in events if e.get("cat") == "cpu_op" and start <= e["ts"] <= kernels[0]["ts"]]
    print("host ops before the first kernel (top by duration):")
    for e in sorted(host_ops, key=lambda e: -e["dur"])[:10]:
        print(f"  {e['dur'] / 1e3:7.3f} ms  {e['name'][:70]}")


def peak_extra_gib(fn, setup=None, keep_bytes=0):
    """Peak memory during ``fn()`` beyond what was allocated before it and ``keep_bytes``
    (the outputs every provider must produce, e.g. gradients), in GiB."""
    args = setup() if setup else ()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before - keep_bytes) / 2**30


def mean_entropy(hidden, weight, rows=512):
    logits = (hidden[:rows] @ weight.T).float()
    logprobs = torch.log_softmax(logits, -1)
    return -(logprobs.exp() * logprobs).sum(-1).mean().item()


def llm_like_hidden(n, h, weight, target_entropy=3.0, dtype=torch.bfloat16, seed=0):
    """``[N, H]`` hidden states scaled so the mean entropy of softmax(hidden @ weight.T) is
    near ``target_entropy`` nats (a trained LM's 2–4), never near-uniform random logits."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(n, h, device="cuda", generator=generator, dtype=torch.float32)
    low, high = 0.1, 50.0
    for _ in range(25):
        scale = (low * high) ** 0.5
        entropy = mean_entropy((base[:512] * scale).to(dtype), weight)
        if entropy > target_entropy:
            low = scale
        else:
            high = scale
    hidden = (base * scale).to(dtype)
    return hidden, mean_entropy(hidden, weight), scale


def teacher_s1():
    """(hidden, weight) of the teacher at 8192 × 4096 × 151,936 bf16, LLM-like (3 nats at τ = 1),
    the header line printed."""
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}, entropy {entropy:.2f} nats at τ=1")
    return hidden, weight


def environment():
    """GPU, versions, date and the commit: KD_KERNELS_GIT_SHA when set (the GPU machine's copy
    of the tree can carry a stale .git), else ``git rev-parse``."""
    sha = os.environ.get("KD_KERNELS_GIT_SHA", "")
    if not sha:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, git=sha or "unknown", date=datetime.date.today().isoformat())


def write_json(path, payload):
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
