"""Helpers shared by the tests (conftest.py keeps the pytest hooks)."""
import json
import os
import sys
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

HAS_CUDA = torch.cuda.is_available()
# float32 inputs take the teacher's epilogue matmul under the interpreter only (exact products
# for exact cases); natively the kernel refuses them (tests/test_lm_head_group_maxima.py)
INTERPRETER_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="float32 inputs: the epilogue matmul runs them under TRITON_INTERPRET=1 only")
FLOAT32_INTERPRETED = pytest.param(torch.float32, marks=INTERPRETER_ONLY)


def python_path(*paths: str) -> str:
    """The PYTHONPATH of a child Python (a subprocess, a Ray worker) that imports from ``paths``
    first, then from this process's own PYTHONPATH (where a machine keeps packages outside
    site-packages)."""
    inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return os.pathsep.join([*paths, *inherited])


def spawn_ranks(worker, world: int, *args) -> None:
    """Runs ``worker(rank, world, init_file, *args)`` in ``world`` fresh processes (a
    ``file://`` rendezvous in a temporary directory) and raises the first rank's error."""
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        mp.spawn(_rank_main, args=(worker, world, init_file, args), nprocs=world, join=True)


def fork_ranks(worker, world: int, *args, timeout_s: float = 300.0) -> None:
    """`spawn_ranks` in forked processes: they inherit the parent's imports (torch and
    transformers take ~15 s a process to import on 2 cores). The worker should call
    ``torch.set_num_threads(1)`` first (a forked OpenMP pool is not reused). Raises the first
    rank's error, or TimeoutError after ``timeout_s`` (the ranks are then terminated)."""
    import time

    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        context = mp.start_processes(_rank_main, args=(worker, world, init_file, args), nprocs=world, join=False,
                                     start_method="fork")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"fork_ranks: {worker.__name__} ran past {timeout_s} s")


def cpu_ranks(worker, world: int, *args) -> None:
    """Ranks of a CPU (gloo) test: `fork_ranks` where this process runs Triton's interpreter
    (its kernels are interpreted ones; no CUDA), else `spawn_ranks`, whose fresh processes set
    the interpreter before defining any kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        fork_ranks(worker, world, *args)
    else:
        spawn_ranks(worker, world, *args)


def _rank_main(rank, worker, world, init_file, args):
    worker(rank, world, init_file, *args)
    # gloo's run-loop thread may still be releasing the last collective's tensors, which takes the
    # GIL; once the interpreter is finalizing, that thread is ended inside a destructor and the
    # process aborts ("terminate called without an active exception": ~40 % of runs on a 2-core
    # machine, traced with gdb to ProcessGroupGloo::runLoop during Py_FinalizeEx). A rank whose
    # checks passed leaves without finalizing; a failing one raises as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf if actual has a NaN."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    if torch.isnan(actual).any():
        return float("inf")
    denominator = expected.norm()
    if denominator == 0:
        return (actual - expected).norm().item()
    return ((actual - expected).norm() / denominator).item()


def check_teacher_topk(top, expected, atol, logits, temperature, vocab_size):
    """Values position by position within atol; an id may differ from the reference's only
    where its own exact log-prob is within atol of the reference value there (a near-tie
    that float32 accumulation order can flip)."""
    assert top.logprobs.dtype == torch.float32 and top.indices.dtype == torch.int32
    assert torch.allclose(top.logprobs.double().cpu(), expected.logprobs.cpu(), atol=atol, rtol=0)
    exact = torch.log_softmax(logits[:, :vocab_size].double().cpu() / temperature, -1)
    exact_at_ours = exact.gather(1, top.indices.long().cpu())
    same = top.indices.cpu() == expected.indices.cpu()
    assert (same | ((exact_at_ours - expected.logprobs.cpu()).abs() <= atol)).all()
    assert all(len(set(row)) == len(row) for row in top.indices.tolist())
    assert torch.allclose(top.lse.double().cpu(), expected.lse.cpu(), atol=atol, rtol=0)


def small_teacher_problem(seed, rows=37, columns=203, dtype=torch.float32, scale=1.0):
    """hidden ``[rows, 16]``, weight ``[columns, 16]``, bias ``[columns]`` of ``dtype``, on the
    GPU where there is one (the interpreter's tiles are 16 rows × 32 columns)."""
    generator = torch.Generator().manual_seed(seed)
    device = "cuda" if HAS_CUDA else "cpu"
    hidden = (scale * torch.randn(rows, 16, generator=generator)).to(device, dtype)
    weight = torch.randn(columns, 16, generator=generator).to(device, dtype)
    bias = torch.randn(columns, generator=generator).to(device, dtype)
    return hidden, weight, bias


def tied_row_problem(seed: int, rows: int, columns: int = 600):
    """float16 hidden ``[rows, 16]`` and weight ``[columns, 16]`` (on the GPU where there is one)
    whose logits are equal along every row: row 1's are ~3.6e9, where float32 keys ``z / τ + G``
    lose the noise in rounding (all its keys tie, more than any candidate slots), the other
    rows' are small (a uniform row)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=generator)
    hidden[:, 0] = 0.0
    hidden[1] = 0.0
    hidden[1, 0] = 60000.0
    weight = torch.randn(1, 16, generator=generator).expand(columns, 16).clone()
    weight[:, 0] = 60000.0
    device = "cuda" if HAS_CUDA else "cpu"
    return hidden.to(device, torch.float16), weight.to(device, torch.float16)


def check_schedule_with_ties_and_fewer_columns_than_k(schedule):
    """A teacher schedule ``schedule(hidden, weight, k, temperature, vocab_size, chunk_rows=None)``
    (16-bit inputs) against the reference where every group of a row ties (only the exact redo
    finds the one larger column) and where fewer columns than k exist (within one group, over
    whole groups: -inf at column 0 past them)."""
    from kd_kernels import reference

    device = "cuda" if HAS_CUDA else "cpu"
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(20, 16, generator=generator).half()
    hidden[[2, 11, 19]] = 0  # logits = weight[:, 0]: 0 everywhere but 1 at the last column
    hidden[[2, 11, 19], 0] = 1
    weight = torch.randn(300, 16, generator=generator).half()
    weight[:, 0] = 0
    weight[299, 0] = 1
    top = schedule(hidden.to(device), weight.to(device), 5, 1.0, 300, chunk_rows=8)
    assert top.indices[[2, 11, 19]].tolist() == [[299, 0, 1, 2, 3]] * 3
    logits = reference.lm_head_logits(hidden, weight)
    check_teacher_topk(top, reference.teacher_topk(hidden, weight, 5, 1.0, 300), 1e-5, logits, 1.0, 300)
    for k, width in ((12, 7), (40, 32)):
        few = schedule(hidden.to(device), weight.to(device), k, 0.5, width)
        expected = reference.teacher_topk(hidden, weight, k, 0.5, width)
        assert torch.equal(few.indices[:, :width].cpu(), expected.indices[:, :width].to(torch.int32).cpu())
        assert torch.isneginf(few.logprobs[:, width:]).all() and (few.indices[:, width:] == 0).all()


def counted_keys_case(capacity: int, k: int, rounded: bool, rows: int, device: str):
    """Inputs of the per-row key sorts (kd_kernels/ops/sort_keys.py `top_of_counted_keys`):
    (keys ``[rows, capacity]`` int64, counts ``[rows]`` int32, values ``[rows, capacity]``
    float32, columns ``[capacity]`` int32). rounded: ties (at the k-th value too; row 3 of one
    value; -0.0 beside 0.0, equal values whose lower column goes first), else distinct values.
    The keys are raw, as the appending matmul stores them (the column's word, then the float's
    bits). Counts: 0, capacity, past it (read as capacity), then random."""
    generator = torch.Generator(device=device).manual_seed(capacity + k)
    values = torch.randn(rows, capacity, device=device, generator=generator)
    if rounded:
        values = values.round(decimals=1)
        values[3] = 1.5
    columns = torch.randperm(200_000, device=device, generator=generator)[:capacity].int()
    wide = columns.expand(rows, -1)
    keys = torch.stack([wide, values.view(torch.int32)], dim=-1).view(torch.int64)[..., 0].contiguous()
    counts = torch.randint(0, capacity + 1, (rows,), device=device, generator=generator, dtype=torch.int32)
    counts[:3] = torch.tensor([0, capacity, capacity + 50], dtype=torch.int32)
    return keys, counts, values, columns


def decode_raw_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw keys as the appending matmul stores them (int64: a float's bits above its column)
    -> (float32 values, int64 columns)."""
    words = keys.contiguous().view(torch.int32).view(*keys.shape, 2)  # little-endian: the column's word first
    return words[..., 1].contiguous().view(torch.float32), words[..., 0].long()


def check_counted_top(got_values, got_columns, values, columns, counts, k: int) -> None:
    """Each row's k largest of its first counts[r] (value, column) pairs (none for a negative
    count), in order: value descending, then the lower column; -inf and column 0 past the count."""
    got_values, got_columns, values, columns = (t.cpu() for t in (got_values, got_columns, values, columns))
    capacity = values.shape[1]
    for row in range(values.shape[0]):
        count = max(0, min(int(counts[row]), capacity))
        by_column = torch.argsort(columns[:count])  # then by value, stably: ties in column order
        order = by_column[torch.sort(values[row, by_column], descending=True, stable=True).indices][:k]
        taken = len(order)
        assert torch.equal(got_values[row, :taken], values[row, order])
        assert torch.equal(got_columns[row, :taken], columns[order])
        assert torch.isneginf(got_values[row, taken:]).all() and (got_columns[row, taken:] == 0).all()


def tiny_llama(seed: int, vocab: int = 96, hidden: int = 32, layers: int = 2):
    """A small fp32 Llama (transformers' LlamaForCausalLM) initialized from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stopped_copy(source, target, step: int) -> str:
    """Copies the finished run directory ``source`` to ``target`` without its checkpoints after
    ``step``: the state a run stopped after ``step`` leaves (its metrics rows past ``step`` are
    dropped on resume). Returns ``target`` as a string."""
    import shutil

    from orchestration import checkpoint

    target = str(target)
    shutil.copytree(source, target)
    for later in checkpoint.candidates(target):
        if later != checkpoint.path_of(target, step):
            shutil.rmtree(later)
    assert checkpoint.candidates(target) == [checkpoint.path_of(target, step)], checkpoint.candidates(target)
    return target


def check_one_process_a_pair(output_dir, pairs: int) -> None:
    """A fused run's workers.json (``output_dir``, a Path) names teacher-r and student-r for each
    pair r, both in one process."""
    with open(output_dir / "workers.json") as handle:
        workers = json.load(handle)
    assert sorted(workers) == sorted([f"teacher-{r}" for r in range(pairs)] + [f"student-{r}" for r in range(pairs)])
    for rank in range(pairs):
        assert workers[f"teacher-{rank}"]["pid"] == workers[f"student-{rank}"]["pid"]
