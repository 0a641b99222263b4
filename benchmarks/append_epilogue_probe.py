"""Probe for the appended schedule's epilogue (NOTES e21): the epilogue matmul over the whole
vocab of 8192 rows with each row's floor at its 4k-th largest logit (the density of elements a
settled floor lets through), for several ways of appending, against the statistics-only
epilogue and cuBLAS. Each variant is the module's source with `_append_reaching` replaced;
their keys are checked equal to the module's own (sorted per row).

usage: python benchmarks/append_epilogue_probe.py   (one H200)
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import llm_like_hidden, time_ms  # noqa: E402
from kd_kernels.ops import lm_head_group_maxima  # noqa: E402
from teacher_epilogue_parts import print_table  # noqa: E402

TEMPERATURE = 2.0
K = 64
CAPACITY = 1024

ONE_ATOMIC_AN_ELEMENT = '''    take = (z >= floors[:, None]) & (columns[None, :] < width) & rows_ok[:, None]
    row_counts = counts_ptr + rows[:, None] + tl.zeros_like(columns)[None, :]
    slot = tl.atomic_add(row_counts, take.to(tl.int32), mask=take, sem="relaxed")
    tl.store(keys_ptr + rows.to(tl.int64)[:, None] * key_capacity + slot,
             value_column_key(z, column_offset + columns[None, :]), mask=take & (slot < key_capacity))
'''
RESERVED_INT64_KEYS = '''    take = (z >= floors[:, None]) & (columns[None, :] < width) & rows_ok[:, None]
    taken = take.to(tl.int32)
    row_taken = tl.sum(taken, axis=1)
    first_slot = tl.atomic_add(counts_ptr + rows, row_taken, mask=row_taken > 0, sem="relaxed")
    slot = first_slot[:, None] + tl.cumsum(taken, axis=1) - taken
    tl.store(keys_ptr + rows.to(tl.int64)[:, None] * key_capacity + slot,
             value_column_key(z, column_offset + columns[None, :]), mask=take & (slot < key_capacity))
'''


def variant_module(name: str, body: str):
    """lm_head_group_maxima with `_append_reaching`'s body replaced, imported as a sibling module."""
    source = open(lm_head_group_maxima.__file__).read()
    start = source.index("    take = (z >= floors[:, None])")
    end = source.index("@triton.jit\ndef _lm_head_group_maxima_kernel")
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(source[:start] + body + "\n\n" + source[end:])
    spec = importlib.util.spec_from_file_location(f"kd_kernels.ops.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    n, h, v = 8192, 4096, 151936
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(n, h, weight)
    floors = torch.cat([(hidden[i:i + 1024] @ weight.T).float().topk(4 * K, dim=1).values[:, -1]
                        for i in range(0, n, 1024)]).contiguous()
    rows = [("cuBLAS bf16, 8192 rows", time_ms(lambda: hidden @ weight.T)[0])]
    counts = torch.zeros(n, dtype=torch.int32, device="cuda")
    keys = torch.empty(n, CAPACITY, dtype=torch.int64, device="cuda")
    modules = {"one atomic an element, int64 keys": variant_module("append_probe_atomic", ONE_ATOMIC_AN_ELEMENT),
               "a row's slots reserved at once, int64 keys": variant_module("append_probe_int64",
                                                                            RESERVED_INT64_KEYS),
               "the module's own": lm_head_group_maxima}
    matmul = lm_head_group_maxima.EpilogueMatmul(hidden, weight, None, v, TEMPERATURE, None)
    rows.append(("statistics and group maxima only", time_ms(lambda: matmul(0, v))[0]))
    reference = None
    for what, module in modules.items():
        call = module.EpilogueMatmul(hidden, weight, None, v, TEMPERATURE, None)
        rows.append((f"appending: {what}", time_ms(lambda: call(0, v, append=(floors, keys, counts)),
                                                   setup=lambda: (counts.zero_(), ())[1])[0]))
        counts.zero_()
        call(0, v, append=(floors, keys, counts))
        kept = torch.where(torch.arange(CAPACITY, device="cuda") < counts[:, None], keys, torch.iinfo(torch.int64).min)
        result = (counts.clone(), kept.sort(dim=1).values)
        if reference is None:
            reference = result
            print(f"appended per row: mean {counts.float().mean():.1f}, max {counts.max().item()}")
        else:
            same = torch.equal(result[0], reference[0]) and torch.equal(result[1], reference[1])
            print(f"{what}: keys {'equal to' if same else 'DIFFERENT from'} the first variant's", flush=True)
    print_table(rows, rows[0][1], n, h, v, entropy)


if __name__ == "__main__":
    main()
