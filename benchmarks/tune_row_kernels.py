"""Launch configurations of the row-streaming kernels at [2048, 151,936] float32: GB/s per
(BLOCK_V, num_warps), against a device-to-device copy of the same bytes."""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kd_kernels.ops.row_statistics import _row_statistics_kernel  # noqa: E402
from kd_kernels.ops.softmax_gradient import _softmax_gradient_kernel  # noqa: E402

rows, columns = 2048, 151_936
logits = torch.randn(rows, columns, device="cuda") * 3
lse = torch.empty(rows, device="cuda")
lse_t = torch.empty(rows, device="cuda")
arg = torch.empty(rows, device="cuda", dtype=torch.int64)
coef = torch.randn(rows, device="cuda")
copy_ms = triton.testing.do_bench(lambda: logits.clone(), return_mode="median")
nbytes = logits.numel() * 4
print(f"copy: {2 * nbytes / copy_ms / 1e6:.0f} GB/s (read + write)")
print("| kernel | BLOCK_V | warps | ms | GB/s |")
exp_out = torch.empty(rows, columns, device="cuda", dtype=torch.bfloat16)  # not in place: runs repeat
shift = torch.empty(rows, device="cuda")
for tempered, write_exp in ((False, False), (True, False), (False, True)):
    for block in (512, 1024, 2048, 4096) if write_exp else (1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8) if write_exp else (4, 8, 16):
            def run():
                _row_statistics_kernel[(rows,)](logits, logits, arg, arg, lse, lse_t, lse_t, arg, lse, lse, exp_out,
                                                shift, logits.stride(0), 0, 0, exp_out.stride(0), columns, columns,
                                                0, 0, 0.5, 1.0, HAS_BIAS=False, TEMPERED=tempered, HAS_IDS=False,
                                                HAS_LABELS=False, WRITE_EXP=write_exp, PLAIN_ONLINE=not write_exp,
                                                TEMPERED_ONLINE=tempered, BLOCK_V=block, BLOCK_K=1, SLACK=16.0,
                                                num_warps=warps)
            ms = triton.testing.do_bench(run, return_mode="median")
            moved = nbytes * (1.5 if write_exp else 1.0)
            name = "lse + exp written" if write_exp else f"lse tempered={tempered}"
            print(f"| {name} | {block} | {warps} | {ms:.3f} | {moved / ms / 1e6:.0f} |")
for block in (1024, 2048, 4096, 8192):
    for warps in (4, 8, 16):
        def run():
            grad = logits.view(torch.bfloat16)[:, :columns]
            _softmax_gradient_kernel[(rows,)](logits, logits, grad, lse, lse_t, coef, coef, logits.stride(0),
                                              grad.stride(0), columns, columns, 0.5, HAS_BIAS=False,
                                              HAS_TEMPERED=False, IN_PLACE=True, BLOCK_V=block, num_warps=warps)
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"| grad in place | {block} | {warps} | {ms:.3f} | {nbytes * 1.5 / ms / 1e6:.0f} |")
