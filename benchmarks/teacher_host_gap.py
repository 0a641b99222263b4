"""Is the teacher's time over the bare matmul spent on the device or in the host's launches?

Times (device events, median of 10) the bare matmul and ``kd.teacher_topk`` from hidden, alone
(timing starts before the host has launched anything: its Python work before the first kernel
counts) and behind a 3 ms device sleep (the host launches while the device is busy, as in a
training step, where the teacher's forward runs before its lm_head), the sleep subtracted.
``--host-profile N``: then the host's own work per call, calls made behind a long device sleep
(the host never waits for the device but at the call's final sync): the time to the first
matmul launch and to the final sync, then cProfile's N functions with the most time of their own.

usage: python benchmarks/teacher_host_gap.py [--schedule epilogue,maxima] [--k 8,64] [--host-profile 30]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402
from harness import llm_like_hidden, time_ms, with_env  # noqa: E402

SLEEP_CYCLES = 5_000_000
PROFILE_SLEEP_CYCLES = 100_000_000  # ~50 ms: longer than any call's host work
PROFILE_CALLS = 20


def host_milestones(call, profile: bool = False):
    """Median host ms from a call's start, made behind a long device sleep, to (the first
    epilogue-matmul launch, the entry of the final sync's function ``_finish_with_redo``);
    with ``profile``, the cProfile stats of the calls up to their first launch, else None."""
    from kd_kernels import teacher_chunked
    from kd_kernels.ops import lm_head_group_maxima

    marks, before_launch = {}, cProfile.Profile()
    finish, launch = teacher_chunked._finish_with_redo, lm_head_group_maxima.EpilogueMatmul.__call__

    def finish_marked(*args, **kwargs):
        marks.setdefault("sync", time.perf_counter())
        return finish(*args, **kwargs)

    def launch_marked(self, *args, **kwargs):
        if "launch" not in marks:
            before_launch.disable()
            marks["launch"] = time.perf_counter()
        return launch(self, *args, **kwargs)
    teacher_chunked._finish_with_redo, lm_head_group_maxima.EpilogueMatmul.__call__ = finish_marked, launch_marked
    first, last = [], []
    try:
        for _ in range(PROFILE_CALLS):
            torch.cuda._sleep(PROFILE_SLEEP_CYCLES)
            marks.clear()
            start = time.perf_counter()
            if profile:
                before_launch.enable()
            call()
            first.append(1e3 * (marks.get("launch", start) - start))
            last.append(1e3 * (marks.get("sync", start) - start))
            torch.cuda.synchronize()
    finally:
        teacher_chunked._finish_with_redo, lm_head_group_maxima.EpilogueMatmul.__call__ = finish, launch
    return (sorted(first)[len(first) // 2], sorted(last)[len(last) // 2],
            pstats.Stats(before_launch) if profile else None)


def host_profile(name, call, top):
    """The host's milestones of a call (`host_milestones`, no profiler), then a cProfile of
    PROFILE_CALLS calls, each behind a long device sleep: the ``top`` functions by own time (the
    final sync's wait is ``_finish_with_redo``'s own time)."""
    call()
    torch.cuda.synchronize()
    to_launch, to_sync, _ = host_milestones(call)
    print(f"\n{name}: host {to_launch:.3f} ms from the call to the first matmul launch, {to_sync:.3f} ms to the "
          f"final sync (no profiler); up to the first launch, by cumulative time:")
    host_milestones(call, profile=True)[2].sort_stats("cumulative").print_stats(top)
    profiler = cProfile.Profile()
    for _ in range(PROFILE_CALLS):
        torch.cuda._sleep(PROFILE_SLEEP_CYCLES)
        profiler.enable()
        call()
        profiler.disable()
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="", help="comma-separated KD_KERNELS_TEACHER_SCHEDULE values "
                                                       "(default: the default schedule only)")
    parser.add_argument("--k", default="8,64", help="comma-separated")
    parser.add_argument("--host-profile", type=int, default=0, help="print this many functions of each call's "
                                                                     "host profile (0: no profile)")
    args = parser.parse_args()
    n, h, v = 8192, 4096, 151_936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, _, _ = llm_like_hidden(n, h, weight)
    sleep = time_ms(lambda: torch.cuda._sleep(SLEEP_CYCLES))[0]
    calls = {"floor: lm_head matmul": lambda: hidden @ weight.T}
    for schedule in args.schedule.split(",") if args.schedule else [""]:
        for k in [int(part) for part in args.k.split(",")]:
            calls[f"ours from hidden (cuda{', ' + schedule if schedule else ''}), k={k}"] = (
                lambda k=k, schedule=schedule: with_env("KD_KERNELS_TEACHER_SCHEDULE", schedule or None, lambda: (
                    kd.teacher_topk(hidden, weight, k=k, temperature=2.0, backend="cuda"))))
    print(f"{torch.cuda.get_device_name()}, N={n} H={h} V={v}; sleep {sleep:.2f} ms")
    print("| call | alone ms | behind the sleep ms (sleep subtracted) |")
    print("| --- | --- | --- |")
    for name, call in calls.items():
        alone = time_ms(call)[0]
        behind = time_ms(lambda: (torch.cuda._sleep(SLEEP_CYCLES), call()))[0] - sleep
        print(f"| {name} | {alone:.2f} | {behind:.2f} |", flush=True)
    for name, call in list(calls.items())[1:] if args.host_profile else []:
        host_profile(name, call, args.host_profile)


if __name__ == "__main__":
    main()
