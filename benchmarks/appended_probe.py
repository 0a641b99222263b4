"""Probe: rows the appended schedule redoes, and its peak memory, for random and LLM-like hidden."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import llm_like_hidden  # noqa: E402
import kd_kernels.teacher_chunked as chunked  # noqa: E402
from kd_kernels.ops import topk_from_appended as app  # noqa: E402

redone = []
orig = chunked._redo_rows
def spy(overflow, *a, **kw):
    rows = orig(overflow, *a, **kw)
    redone.append(int(rows.numel()))
    return rows
chunked._redo_rows = spy
counts_seen = []
orig_rank = app.rank_appended
def rank_spy(keys, counts, k, order):
    out = orig_rank(keys, counts, k, order)
    c = counts.float()
    counts_seen.append((c.mean().item(), c.min().item(), c.max().item(), int((counts < k).sum()), int((counts > keys.shape[1]).sum())))
    return out
app.rank_appended = rank_spy
g = torch.Generator(device="cuda").manual_seed(1)
weight = (torch.randn(151_936, 4096, device="cuda", generator=g) * 0.02).bfloat16()
for name, hidden in (("random x0.8", (torch.randn(8192, 4096, device="cuda", generator=g) * 0.8).bfloat16()),
                     ("llm-like", llm_like_hidden(8192, 4096, weight)[0])):
    for k in (256, 1024):
        chunked.teacher_topk_appended(hidden[:256], weight, k, 2.0, 151_936, select="cuda")
        torch.cuda.synchronize(); redone.clear(); counts_seen.clear()
        torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
        top = chunked.teacher_topk_appended(hidden, weight, k, 2.0, 151_936, select="cuda")
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before - top.logprobs.nbytes - top.indices.nbytes - top.lse.nbytes
        print(name, "k", k, "redone", redone, "extra MiB", round(extra / 2**20, 1))
        for c in counts_seen: print("   counts mean/min/max, <k, >cap:", [round(x, 1) if isinstance(x, float) else x for x in c])
