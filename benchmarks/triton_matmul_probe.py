"""Can a Triton matmul carry the teacher's epilogue at cuBLAS speed? (issue #4, from hidden)

Times, at the teacher shape (8192 × 4096 × 151,936 bf16), cuBLAS (bf16 and float32 out) and a
persistent Triton TMA matmul (tiles walked in L2-friendly groups, optionally Hopper warp
specialization and a flattened loop) with four epilogues:

- ``bf16``: the logits tile stored in bf16 (what the floor stores);
- ``fp32``: stored in float32 (what the selection would read);
- ``stats``: nothing stored but per-(row, tile) max and Σ exp at τ, and per-(row, 32 columns)
  maxima (the epilogue of an exact two-stage top-k: the k-th largest group maximum bounds the
  k-th value, so only ~k groups of a row are candidates);
- ``fp32+stats``: both.

Prints one table (ms, TFLOP/s, × cuBLAS bf16). ``--quick`` runs a smaller shape.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import time_ms  # noqa: E402
from kd_kernels.ops.lm_head_group_maxima import _tile_position  # noqa: E402  (the kernel's tile order)

EPILOGUES = {"bf16": 0, "fp32": 1, "stats": 2, "fp32+stats": 3}
GROUP = 32  # columns per group maximum


@triton.jit
def _probe_kernel(a_desc, b_desc, c_desc, tile_max_ptr, tile_sum_ptr, group_max_ptr, M, N, K, scale2,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                  EPILOGUE: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr,
                  GROUP_COLS: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    tile_id_c = start - NUM_SMS
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = _tile_position(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_position(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if EPILOGUE == 0 or EPILOGUE == 1 or EPILOGUE == 3:
            out = acc.to(tl.bfloat16) if EPILOGUE == 0 else acc
            if SUBTILE:
                halves = tl.permute(tl.reshape(out, (BM, 2, BN // 2)), (0, 2, 1))
                left, right = tl.split(halves)
                c_desc.store([off_m, off_n], left)
                c_desc.store([off_m, off_n + BN // 2], right)
            else:
                c_desc.store([off_m, off_n], out)
        if EPILOGUE >= 2:
            rows = off_m + tl.arange(0, BM)
            columns = off_n + tl.arange(0, BN)
            z2 = tl.where(columns[None, :] < N, acc * scale2, float("-inf"))
            tile_max = tl.max(z2, axis=1)
            tile_sum = tl.sum(tl.exp2(z2 - tile_max[:, None]), axis=1)
            tl.store(tile_max_ptr + rows * num_pid_n + pid_n, tile_max, mask=rows < M)
            tl.store(tile_sum_ptr + rows * num_pid_n + pid_n, tile_sum, mask=rows < M)
            group_max = tl.max(tl.reshape(z2, (BM, BN // GROUP_COLS, GROUP_COLS)), axis=2)
            groups = pid_n * (BN // GROUP_COLS) + tl.arange(0, BN // GROUP_COLS)
            num_groups = num_pid_n * (BN // GROUP_COLS)
            tl.store(group_max_ptr + rows[:, None] * num_groups + groups[None, :], group_max,
                     mask=rows[:, None] < M)


def run_probe(hidden, weight, config, epilogue, num_sms):
    bm, bn, bk, warps, stages, ws, flatten, subtile = config
    m, k = hidden.shape
    n = weight.shape[0]
    out_dtype = torch.bfloat16 if epilogue == "bf16" else torch.float32
    out = torch.empty(m, n, dtype=out_dtype, device="cuda") if epilogue != "stats" else torch.empty(
        bm, bn, dtype=torch.float32, device="cuda")
    tiles_n = triton.cdiv(n, bn)
    tile_max = torch.empty(m, tiles_n, device="cuda")
    tile_sum = torch.empty(m, tiles_n, device="cuda")
    group_max = torch.empty(m, tiles_n * (bn // GROUP), device="cuda")
    a_desc = TensorDescriptor.from_tensor(hidden, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn // 2 if subtile else bn])
    grid = (min(num_sms, triton.cdiv(m, bm) * tiles_n),)

    def call():
        _probe_kernel[grid](a_desc, b_desc, c_desc, tile_max, tile_sum, group_max, m, n, k, 1.4426950408889634 / 2,
                            BM=bm, BN=bn, BK=bk, GROUP_M=8, NUM_SMS=grid[0], EPILOGUE=EPILOGUES[epilogue], WS=ws,
                            FLATTEN=flatten, SUBTILE=subtile, GROUP_COLS=GROUP, num_warps=warps, num_stages=stages)
    return call, out, (tile_max, tile_sum, group_max)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    m, h, v = (2048, 4096, 32768) if args.quick else (8192, 4096, 151936)
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden = (torch.randn(m, h, device="cuda") * 2.0).to(torch.bfloat16)
    flops = 2 * m * h * v
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    cublas_bf16, _, _ = time_ms(lambda: torch.mm(hidden, weight.T))
    cublas_fp32, _, _ = time_ms(lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32))
    rows.append(("cuBLAS", "bf16", cublas_bf16))
    rows.append(("cuBLAS", "fp32", cublas_fp32))
    reference = torch.mm(hidden[:256], weight.T, out_dtype=torch.float32)
    configs = [  # bm, bn, bk, warps, stages, ws, flatten, subtile
        (128, 256, 64, 8, 3, False, True, True),
        (128, 256, 64, 8, 3, True, False, True),
        (128, 256, 64, 8, 4, False, True, True),
        (128, 128, 64, 8, 4, False, True, False),
        (128, 128, 64, 4, 4, False, True, False),
        (128, 128, 64, 8, 4, True, False, False),
    ]
    for config, epilogue in itertools.product(configs, EPILOGUES):
        name = "{}x{}x{} w{} s{}{}{}".format(*config[:5], " ws" if config[5] else "", " flat" if config[6] else "")
        try:
            call, out, stats = run_probe(hidden, weight, config, epilogue, num_sms)
            call()
            torch.cuda.synchronize()
            if epilogue != "stats":
                error = (out[:256].float() - reference).abs().max().item()
                assert error < (0.1 if epilogue == "bf16" else 1e-3), f"{name} {epilogue}: max error {error}"
            else:
                expected = reference.view(256, -1)[:, :GROUP].amax(-1) * (1.4426950408889634 / 2)
                assert torch.allclose(stats[2][:256, 0], expected, atol=1e-3), f"{name}: group maxima wrong"
            ms, _, _ = time_ms(call)
            rows.append((name, epilogue, ms))
        except Exception as error:  # noqa: BLE001 (a config that does not compile is a row, not the end)
            rows.append((name, epilogue, float("nan")))
            print(f"{name} {epilogue}: {type(error).__name__}: {str(error)[:300]}", flush=True)
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"M={m} K={h} N={v}\n")
    print("| kernel | epilogue | ms | TFLOP/s | × cuBLAS bf16 |")
    print("| --- | --- | --- | --- | --- |")
    for name, epilogue, ms in rows:
        print(f"| {name} | {epilogue} | {ms:.2f} | {flops / ms / 1e9:.0f} | {ms / cublas_bf16:.3f} |")


if __name__ == "__main__":
    main()
