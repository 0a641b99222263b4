"""What a row chunk of the student's schedule costs, by part, as totals over N rows: the
three cuBLAS matmuls of each chunk (float32 logits, dX, dW += with beta = 1), dX by split-K
batched matmuls, and the two streaming row kernels. Explains the lean schedule's cost
(many short chunks) against the fast one.

usage: python benchmarks/chunk_costs.py [--rows 384,512,2048] [--out results.json]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import environment, llm_like_hidden, time_ms, write_json  # noqa: E402
from kd_kernels.ops.row_statistics import RowStatistics, row_statistics  # noqa: E402
from kd_kernels.ops.softmax_gradient import softmax_gradient  # noqa: E402

N, H, V, K = 8192, 2048, 151_936, 64


def split_k_grad_hidden(grad, weight, splits):
    """``grad [C, V] @ weight [V, H]`` as ``splits`` batched matmuls over slices of V, summed in float32."""
    rows, columns = grad.shape
    parts = torch.bmm(grad.view(rows, splits, columns // splits).transpose(0, 1),
                      weight.view(splits, columns // splits, weight.shape[1]), out_dtype=torch.float32)
    return parts.sum(0).to(grad.dtype)


def chunk_costs(chunk_rows, hidden, weight, logits, grad_weight, lse, ids, labels):
    """ms of each part summed over the chunks that cover N rows."""
    starts = list(range(0, N, chunk_rows))

    def each_chunk(body):
        def run():
            for start in starts:
                body(start, min(start + chunk_rows, N) - start)
        return time_ms(run)[0]

    def view(rows):
        return logits[:rows]

    def as_grad(rows):
        return logits[:rows].view(torch.bfloat16)[:, :V]

    out = {}
    out["logits fp32 (mm)"] = each_chunk(lambda s, r: torch.mm(hidden[s:s + r], weight.T, out_dtype=torch.float32,
                                                               out=view(r)))
    stats = RowStatistics.empty(chunk_rows, K, False, True, hidden.device)
    out["row statistics"] = each_chunk(lambda s, r: row_statistics(view(r), None, V, 1.0, stats, ids[s:s + r],
                                                                   labels[s:s + r]))
    coef = torch.full((chunk_rows,), -1e-4, device=hidden.device)
    out["softmax gradient (in place)"] = each_chunk(
        lambda s, r: softmax_gradient(view(r), None, as_grad(r), lse[s:s + r], lse[s:s + r], coef[:r], None, V, 1.0))
    grad_hidden = torch.empty_like(hidden)
    out["dX (mm)"] = each_chunk(lambda s, r: torch.mm(as_grad(r), weight, out=grad_hidden[s:s + r]))
    for splits in (2, 4, 8):
        out[f"dX (split-K {splits}, bmm)"] = each_chunk(
            lambda s, r, splits=splits: grad_hidden[s:s + r].copy_(split_k_grad_hidden(as_grad(r), weight, splits)))
    out["dW (addmm, beta 1)"] = each_chunk(lambda s, r: grad_weight.addmm_(as_grad(r).T, hidden[s:s + r]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,384,512,1024,2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16)
    hidden, entropy, _ = llm_like_hidden(N, H, weight)
    largest = max(int(r) for r in args.rows.split(","))
    logits = torch.empty(largest, V, dtype=torch.float32, device="cuda")
    torch.mm(hidden[:largest], weight.T, out_dtype=torch.float32, out=logits)
    lse = torch.logsumexp(logits, -1).repeat(-(-N // largest))[:N].contiguous()
    ids = torch.randint(0, V, (N, K), device="cuda")
    labels = torch.randint(0, V, (N,), device="cuda")
    grad_weight = torch.zeros_like(weight)
    floor = {"logits (bf16 out)": time_ms(lambda: hidden @ weight.T)[0]}
    grad = (hidden @ weight.T) * 1e-4
    floor["dX"] = time_ms(lambda: grad @ weight)[0]
    floor["dW"] = time_ms(lambda: grad.T @ hidden)[0]
    print(f"N={N} H={H} V={V}; entropy {entropy:.2f}; floor (3 matmuls of all rows): "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in floor.items()) + f"; sum {sum(floor.values()):.2f} ms")
    table = {}
    for rows in (int(r) for r in args.rows.split(",")):
        table[rows] = chunk_costs(rows, hidden, weight, logits, grad_weight, lse, ids, labels)
    parts = list(next(iter(table.values())))
    print("| part (ms, all N rows) | " + " | ".join(f"{rows} rows ({-(-N // rows)} chunks)" for rows in table) + " |")
    print("| --- |" + " --- |" * len(table))
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{table[rows][part]:.2f}" for rows in table) + " |")
    if args.out:
        write_json(args.out, dict(environment=environment(), floor=floor, parts=table))


if __name__ == "__main__":
    main()
