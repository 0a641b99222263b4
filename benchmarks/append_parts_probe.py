"""Where the appending matmul's time goes with real floors (k = 1024 at 8192 × 4096 × 151,936):
the matmul alone (profiler device ms, median of 5) as is, without the key stores, without the
slot atomics, without both, and with floors no element reaches; beside cuBLAS and the
statistics-only epilogue matmul. Each variant runs in its own process (``--variant``): the
parts are taken out by replacing the kernel's helpers before its first compile, which Triton
does not allow twice in one process. Timing only: the variants without atomics or stores leave
wrong keys.

usage: python benchmarks/append_parts_probe.py            (every variant, one process each)
       python benchmarks/append_parts_probe.py --variant "no stores"
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from harness import kernel_times, teacher_s1  # noqa: E402
from kd_kernels.ops import lm_head_group_maxima as epilogue  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import Appends, EpilogueMatmul, _popcount  # noqa: E402
from kd_kernels.ops.topk_from_appended import appended_plan, sample_floors  # noqa: E402

K = 1024


@triton.jit
def _reserve_no_atomic(grouped, row_offsets, floor_ptr, counts_ptr, GROUP_COLUMNS: tl.constexpr):
    # `_reserve_slots` with every row's first slot 0: no atomic, no broadcast of its result
    lane = tl.arange(0, GROUP_COLUMNS)[None, None, :]
    floor = tl.load(floor_ptr + row_offsets, mask=row_offsets >= 0, other=float("inf"))
    bits = tl.sum(tl.where(grouped >= floor[:, None, None], 1 << lane, 0), axis=2)
    count = _popcount(bits, True)
    first = tl.cumsum(count, axis=1) - count
    return floor, bits, first


# one relaxed atomic a (row, group) with any element kept, by the thread that holds the group: its
# result is that thread's own, so no block barrier broadcasts it (Triton's atomic on a row does)
_GROUP_ATOMIC_PTX = tl.constexpr("""
{
.reg .pred taken;
mov.u32 $0, 0;
setp.ne.u32 taken, $1, 0;
@taken atom.global.relaxed.gpu.add.u32 $0, [$2], $1;
}
""")


@triton.jit
def _reserve_group_atomics(grouped, row_offsets, floor_ptr, counts_ptr, GROUP_COLUMNS: tl.constexpr):
    lane = tl.arange(0, GROUP_COLUMNS)[None, None, :]
    floor = tl.load(floor_ptr + row_offsets, mask=row_offsets >= 0, other=float("inf"))
    bits = tl.sum(tl.where(grouped >= floor[:, None, None], 1 << lane, 0), axis=2)
    count = _popcount(bits, True)
    counters = (counts_ptr + tl.maximum(row_offsets, 0)).to(tl.int64, bitcast=True)[:, None] + tl.zeros_like(count)
    first = tl.inline_asm_elementwise(_GROUP_ATOMIC_PTX, "=r,r,l", [count, counters.to(tl.int64)], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return floor, bits, first


def _without_stores(ptx: str) -> str:
    return "\n".join(line for line in ptx.splitlines() if not line.startswith("st.global"))


def patch(variant: str) -> None:
    """Replaces the kernel's helpers for ``variant`` (before anything compiles)."""
    if variant in ("no stores", "neither"):
        epilogue._STORE_APPENDED_PTX = tl.constexpr(_without_stores(epilogue._STORE_APPENDED_PTX.value))
    if variant in ("no atomic", "neither"):
        epilogue._reserve_slots = _reserve_no_atomic
    if variant == "atomic a group in PTX":
        epilogue._reserve_slots = _reserve_group_atomics


def run(variant: str) -> None:
    patch(variant)
    hidden, weight = teacher_s1()
    rows, v = hidden.shape[0], weight.shape[0]
    plan = appended_plan(v, K)
    sample = torch.empty(rows, plan.sample_columns, dtype=hidden.dtype, device="cuda")
    EpilogueMatmul(hidden, weight[::plan.stride], None, plan.sample_width, 2.0, sample)(0, plan.sample_width)
    floors = sample_floors(sample[:, :plan.sample_width], plan.rank, torch.empty(rows, device="cuda"))
    if variant == "unreached floors":
        floors.fill_(float("inf"))
    del sample
    counts = torch.zeros(rows, dtype=torch.int32, device="cuda")
    keys = torch.empty(rows, plan.capacity, dtype=torch.int64, device="cuda")
    appending = EpilogueMatmul(hidden, weight, None, v, 2.0, None, appends=Appends(floors, keys, counts))
    statistics = EpilogueMatmul(hidden, weight, None, v, 2.0, None)

    def appends():
        counts.zero_()
        appending(0, v)

    calls = {"cuBLAS": lambda: hidden @ weight.T, "statistics only": lambda: statistics(0, v), variant: appends}
    for call in calls.values():
        call()
    times = {name: sum(ms for kernel, ms in kernel_times(call).items() if "zero" not in kernel and "fill" not in kernel)
             for name, call in calls.items()}
    appended = counts.float().mean().item()
    print(f"| {variant} | {times[variant]:.3f} | {times['cuBLAS']:.3f} | {times['statistics only']:.3f} | "
          f"{times[variant] / times['cuBLAS']:.3f} | {appended:.0f} |", flush=True)


VARIANTS = ("as is", "no stores", "no atomic", "neither", "unreached floors", "atomic a group in PTX")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS)
    args = parser.parse_args()
    if args.variant:
        run(args.variant)
        return
    print(f"k = {K}; device ms (profiler, median of 5), each row its own process")
    print("| appending matmul | ms | cuBLAS ms | statistics-only ms | × cuBLAS | counts a row (mean) |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    for variant in VARIANTS:
        result = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        lines = [line for line in result.stdout.splitlines() if line.startswith("|")]
        print(lines[-1] if lines else f"| {variant} | failed: {result.stderr.strip().splitlines()[-1:]} |",
              flush=True)


if __name__ == "__main__":
    main()
