"""End-to-end distillation throughput at real shapes: one process with full logits, one
process with kd_kernels, and the Ray driver on one GPU (colocated and fused placements).

Models are random-initialized Qwen2 checkpoints written with ``save_pretrained`` (with a
word-level tokenizer of the vocabulary, so the driver takes the tokenizer from them), data
random pre-tokenized documents (``NAME.npy`` + offsets). Default shapes: a Qwen2.5-1.5B-like
teacher (1536, 28 layers, 12 / 2 heads, 8960) and a 0.5B-like student (896, 24, 14 / 2, 4864),
vocab 151,936, 8 rows x 2048 tokens a step, bf16.

Rows (protocol "median step": the median over the steps after the warm-up; tokens/s and the
peak memory, GPU allocated on CUDA, resident set on CPU):
  single process, full logits (PyTorch)   teacher logits, log_softmax, KL at the temperature
      + CE on the student's logits, backward, AdamW: the loop users write
  single process, kd_kernels              the same loop with kd.teacher_topk and
      kd.topk_divergence on the final hidden states (no logits, no Ray)
  ..., packed[, ATTENTION]                each loop again on the driver's rows: the documents
      packed with an EOS between them, position ids per document, the block-diagonal mask;
      once per --attention entry: sdpa (a dense mask, the unnamed row) or flex_attention (a
      block mask that skips the tiles across documents; CUDA only)
  single process, ..., packed[, ATTENTION], compiled   (--compile) each loop on packed rows with
      each decoder layer of both models compiled as the driver's compile=true does
      (`compilation.compile_decoder_layers`); the eager full-logits loop stays the floor
  driver PLACEMENT (STRATEGY[, ATTENTION]) orchestrate.py's driver on one GPU: colocated (a
      teacher and a student actor, top-k by CUDA IPC) and fused (both workers in one actor,
      one process, top-k handed over in process); one row per --placements, --strategies
      (replica, fsdp2) and --attention entry; a run that runs out of memory is a row saying so.
  driver PLACEMENT (STRATEGY[, ATTENTION], compiled)   (--compile) each driver row again with
      --set compile=true
Compiled rows compile in their first step (the forward, then the backward at its first call),
and each shape compiles once (static shapes), so the warm-up steps hold the compilation: a
single-process row whose timed steps compile is refused; first_step_s says what it cost.
--compile-only: only the compiled rows (with --skip-single: the compiled driver rows alone).
``--tiny``: small shapes on the CPU (a smoke test). Compare the strategies on a 1.5B-like
student: ``--student 1536,28,12,2,8960 --strategies replica,fsdp2 --set activation_checkpointing=true``.

On-policy parts (instead of the above; no Ray for --weight-sync):
  --weight-sync   trainer -> rollout weight sync colocated on one GPU, random-init bf16 students
      of Qwen2.5-0.5B/1.5B/7B shapes: the receiver in a second process copying straight out of
      the trainer's parameters by CUDA IPC, and through packed 512 MiB buckets; and the
      driver's colocated path, the trainer pushing into the receiver's shared buffer (mapped
      once; lock, one copy, publish the version, no message), with the same copy alone; the
      floor is torch's device-to-device copy of the same bytes in one buffer. Rows: seconds and
      GB/s an update (cold: the first, opening the IPC handles; warm: the median of the next
      ones), the share of the floor's bandwidth, and the update's parts (IPC: the sender's
      call, the receiver's call with its copy, the messages; push: the part under the lock and
      the lock wait). The receiver is a `RolloutWorker` taking the driver's calls (the
      flattened path: one call that pauses, copies and continues); the messages go over a
      multiprocessing queue, not Ray. With --tiny: a tiny model on the CPU, the floor and the
      push rows (a smoke test).
  --onpolicy      the on-policy rows named in --onpolicy-rows, each printed and appended to
      --results when it is done: "default" and "pair", the driver with mode=on_policy at the GPU
      default and at a 1.5B -> 0.5B-like pair (Qwen2.5 layers and hidden sizes, the driver's
      vocab): the step's breakdown (generate / sync / teacher / transfer / student seconds and
      the rest) and tokens/s, with the setup the step does not depend on made cheap
      (`ONPOLICY_SETUP`, stated in the row); "generation" and "generation-0.5b", tokens/s of the
      rollout worker against plain Hugging Face generate of the same model and batch, and a
      bare KV-cached loop. With --tiny: tiny shapes on the CPU (a smoke test).

usage: python benchmarks/bench_e2e_throughput.py [--steps 20] [--tiny] [--strategies replica,fsdp2]
           [--placements colocated,fused] [--attention sdpa,flex_attention] [--compile [--compile-only]]
       python benchmarks/bench_e2e_throughput.py --weight-sync [--sync-models 0.5b,1.5b,7b] [--tiny]
       python benchmarks/bench_e2e_throughput.py --onpolicy [--onpolicy-rows default,pair,generation,generation-0.5b]
           [--steps 8 --warmup 3]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import add_results_arguments, append_rows, environment, print_table, result_row  # noqa: E402
from orchestration.compilation import compile_decoder_layers  # noqa: E402
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402
from orchestration.models import build_model  # noqa: E402
from orchestration.hf_models import final_hidden_states, output_embedding  # noqa: E402
from orchestration.metrics import memory_mib  # noqa: E402
from orchestration.packing import PackedRows, from_lists, load_token_documents, save_token_documents  # noqa: E402

BENCHMARK = "bench_e2e_throughput"
FLOOR = "single process, full logits (PyTorch)"
TEACHER, STUDENT = "1536,28,12,2,8960", "896,24,14,2,4864"
TINY = dict(teacher="64,2,4,2,128", student="32,2,4,2,64", vocab=512, rows=2, row_tokens=32, steps=4, k=8)


def shape_of(text: str) -> dict:
    hidden, layers, heads, kv_heads, intermediate = (int(part) for part in text.split(","))
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=intermediate)


def write_checkpoint(directory: str, shape: dict, vocab: int, row_tokens: int, seed: int, device: str) -> str:
    """A random Qwen2 checkpoint of ``shape`` with a word-level tokenizer of ``vocab`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=max(row_tokens, 64), tie_word_embeddings=False,
                         eos_token_id=1, pad_token_id=0, bos_token_id=2, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                            unk_token="<pad>").save_pretrained(directory)
    return directory


def write_documents(path: str, vocab: int, tokens: int, row_tokens: int, seed: int = 0) -> str:
    """Random documents of ``row_tokens / 8 .. 2 row_tokens`` ids (3..vocab-1) totalling about ``tokens``."""
    generator = np.random.default_rng(seed)
    documents, total = [], 0
    while total < tokens:
        length = int(generator.integers(max(1, row_tokens // 8), 2 * row_tokens))
        documents.append(generator.integers(3, vocab, length))
        total += length
    return save_token_documents(path, from_lists(documents))


def _peak_mib(device: torch.device) -> float:
    stats = memory_mib(device)
    return stats.get("cuda_max_allocated_mib", stats["peak_rss_mib"])


def _attention_suffix(attention: str) -> str:
    return "" if attention == "sdpa" else f", {attention}"


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def single_process(kind: str, paths: tuple, args, device: torch.device, packed=None, attention: str = "sdpa",
                   compiled: bool = False) -> dict:
    """One process: the teacher scores, the student trains; ``kind`` "full" (logits) or "kd_kernels".
    ``packed`` (`packing.PackedRows`): its rows in order, with the driver's position ids and
    block-diagonal mask for the models' ``attention`` implementation, instead of random causal
    rows. ``compiled``: both models' decoder layers compiled as the driver compiles them;
    raises RuntimeError when a timed step compiled a graph (raise --warmup)."""
    from transformers import AutoModelForCausalLM

    from orchestration.workers import layout_of

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = dict(attn_implementation=attention)
    teacher = AutoModelForCausalLM.from_pretrained(paths[0], dtype=dtype, **loaded).to(device).eval()
    student = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32, **loaded).to(device)
    if compiled:
        for model in (teacher, student):
            compile_decoder_layers(model)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4, fused=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, vocab, graphs = [], args.vocab, None
    for step in range(args.steps):
        if packed is None:
            tokens = torch.randint(3, vocab, (args.rows, args.row_tokens), device=device)
            labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)
            layout = dict(position_ids=None, attention_mask=None)
        else:
            batch = packed.batch([(0, (step * args.rows + row) % packed.rows_in_epoch()) for row in range(args.rows)])
            tokens, labels = batch.input_ids.to(device), batch.labels.to(device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if packed is not None:  # the mask is built within the step, as the driver builds it
            position_ids, mask = layout_of(batch.position_ids, batch.document_ids, device, attention)
            layout = dict(position_ids=position_ids, attention_mask=mask)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            if kind == "full":
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=tokens, **layout).logits.float()
                student_logits = student(input_ids=tokens, **layout).logits.float()
                teacher_logprobs = torch.log_softmax(teacher_logits, -1)
                student_logprobs = torch.log_softmax(student_logits, -1)
                kl = (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1).mean()
                loss = 0.5 * kl + 0.5 * F.cross_entropy(student_logits.reshape(-1, vocab), labels.reshape(-1))
            else:
                with torch.no_grad():
                    hidden = final_hidden_states(teacher, tokens, **layout).reshape(-1, teacher.config.hidden_size)
                    top = kd.teacher_topk(hidden.to(dtype), output_embedding(teacher)[0].to(dtype), args.k)
                hidden = final_hidden_states(student, tokens, **layout).reshape(-1, student.config.hidden_size)
                loss = kd.topk_divergence(hidden.to(dtype), output_embedding(student)[0].to(dtype), top,
                                          labels.reshape(-1), ce_weight=0.5, kd_weight=0.5)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step == 0:
            first_step_s = time.perf_counter() - start
        if step == args.warmup - 1:
            graphs = _compiled_graphs()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    name = ((FLOOR if kind == "full" else "single process, kd_kernels")
            + ("" if packed is None else ", packed" + _attention_suffix(attention))
            + (", compiled" if compiled else ""))
    if compiled and _compiled_graphs() != graphs:
        raise RuntimeError(f"{name}: graphs compiled after the warm-up: raise --warmup (got {args.warmup})")
    seconds = statistics.median(times)
    extra = dict(first_step_s=first_step_s) if compiled else {}
    return dict(provider=name, ms=1e3 * seconds, tokens_per_s=args.rows * args.row_tokens / seconds,
                peak_mib=_peak_mib(device), **extra)


def release_memory(device: torch.device) -> None:
    """Hands this process's cached CUDA blocks back: the driver's workers, other processes on the
    same GPU, cannot use what a finished row's caching allocator still holds."""
    torch._dynamo.reset()  # the compiled rows' graphs hold their models' guards
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# a driver step's parts (medians in the row): the teacher's calls as they ran (on a GPU the launches,
# their kernels run later), the student waiting for them, the top-k's hand-over, the student's step
# (through its final host sync, so on a GPU also the queued teacher kernels), the student call's dispatch
DRIVER_PARTS = ("teacher", "wait", "transfer", "student", "dispatch")


def driver(placement: str, strategy: str, paths: tuple, data: str, args, attention: str = "sdpa",
           compiled: bool = False) -> dict:
    name = f"driver {placement} ({strategy}{_attention_suffix(attention)}{', compiled' if compiled else ''})"
    run_name = f"{placement}_{strategy}{'_compiled' if compiled else ''}"
    config = load_config(None, [f"output_dir={args.output_dir}/{run_name}", f"steps={args.steps}",
                                f"teacher_path={paths[0]}", f"student_path={paths[1]}", f"data_path={data}",
                                f"row_tokens={args.row_tokens}", f"rows_per_micro_batch={args.rows}",
                                "micro_batches=1", f"k={args.k}", f"student_strategy={strategy}",
                                "checkpoint_every=0", "overwrite=true", "ce_weight=0.5", "kd_weight=0.5",
                                f"attention={attention}", f"device={args.device}", f"placement={placement}",
                                *args.set, f"compile={str(compiled).lower()}"])
    try:
        summary = run(config, progress=False)
    except Exception as error:  # noqa: BLE001 - out of memory is a result of this comparison
        if "out of memory" not in str(error).lower():
            raise
        where = str(error).strip().splitlines()[0][:300]
        print(f"{name}: out of memory: {where}", file=sys.stderr)
        return dict(provider=name, ms=None, tokens_per_s=None, peak_mib=None, note=f"out of memory: {where}")
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle]
    first_step_s, records = records[0]["step_seconds"], records[args.warmup:]
    peaks = {worker: values.get("cuda_max_allocated_mib", values["peak_rss_mib"])
             for worker, values in summary["memory"].items()}
    with open(os.path.join(config.output_dir, "workers.json")) as handle:
        pids = {worker: about["pid"] for worker, about in json.load(handle).items()}
    by_process = {pids[worker]: peak for worker, peak in peaks.items()}  # a fused pair's workers share one
    seconds = statistics.median(r["step_seconds"] for r in records)
    parts = {f"{part}_ms": 1e3 * statistics.median(r[f"{part}_seconds"] for r in records) for part in DRIVER_PARTS}
    return dict(provider=name, ms=1e3 * seconds, tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                peak_mib=sum(by_process.values()), **{f"{worker}_peak_mib": peak for worker, peak in peaks.items()},
                **parts, **(dict(first_step_s=first_step_s) if compiled else {}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=TEACHER, help="hidden,layers,heads,kv_heads,intermediate")
    parser.add_argument("--student", default=STUDENT, help="hidden,layers,heads,kv_heads,intermediate")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", type=int, default=8, help="rows a step")
    parser.add_argument("--row-tokens", type=int, default=2048)
    parser.add_argument("--k", type=int, default=64, help="teacher top-k")
    parser.add_argument("--steps", type=int, default=20, help="steps a row (the first --warmup are not timed)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--strategies", default="replica", help="driver rows: replica, fsdp2 or both (comma)")
    parser.add_argument("--attention", default="sdpa", help="packed and driver rows: sdpa, flex_attention or both "
                        "(comma); flex_attention on CUDA only")
    parser.add_argument("--placements", default="colocated,fused",
                        help="driver rows: colocated, fused or both (comma), each with every strategy")
    parser.add_argument("--skip-single", action="store_true", help="only the driver rows")
    parser.add_argument("--compile", action="store_true", help="also the compiled rows: the kd_kernels loop on "
                        "packed rows and each driver row with compiled decoder layers")
    parser.add_argument("--compile-only", action="store_true", help="with --compile: only the compiled rows")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    parser.add_argument("--output-dir", default="runs/bench_e2e_throughput", help="checkpoints, data and runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a driver option")
    add_results_arguments(parser, BENCHMARK)
    add_onpolicy_arguments(parser)
    args = parser.parse_args(argv)
    if args.weight_sync or args.onpolicy:
        return onpolicy_main(args, parser)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        args.warmup = 1
    args.device = "cpu" if args.tiny else "cuda"
    if args.steps <= args.warmup:
        parser.error(f"--steps: expected more than --warmup ({args.warmup}), got {args.steps}")
    if args.compile_only and not args.compile:
        parser.error("--compile-only: needs --compile")
    if args.compile and args.warmup < 1:
        parser.error(f"--warmup: --compile compiles in the warm-up steps, expected at least 1, got {args.warmup}")
    if any(setting.split("=", 1)[0].strip() == "compile" for setting in args.set):
        parser.error("--set compile=...: each driver row sets compile itself (false; true for --compile's rows)")
    for option, allowed in (("placements", ("colocated", "fused")), ("strategies", ("replica", "fsdp2"))):
        if unknown := [name for name in getattr(args, option).split(",") if name not in allowed]:
            parser.error(f"--{option}: expected {' and/or '.join(allowed)} (comma), got {unknown}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_e2e_throughput: needs a CUDA device (or --tiny)")
    attentions = args.attention.split(",")
    if unknown := [name for name in attentions if name not in ("sdpa", "flex_attention")]:
        parser.error(f"--attention: expected sdpa and/or flex_attention, got {unknown}")
    if "flex_attention" in attentions and args.device == "cpu":
        parser.error("--attention: flex_attention trains on CUDA only (torch has no flex_attention backward on the "
                     "CPU); use sdpa with --tiny")
    device = torch.device(args.device)
    os.makedirs(args.output_dir, exist_ok=True)
    paths = tuple(write_checkpoint(os.path.join(args.output_dir, name), shape_of(text), args.vocab, args.row_tokens,
                                   seed, args.device)
                  for name, text, seed in (("teacher", args.teacher, 0), ("student", args.student, 1)))
    data = os.path.join(args.output_dir, "documents.npy")
    if not os.path.exists(data):
        write_documents(data, args.vocab, args.rows * args.row_tokens * (args.steps + 2) * 2, args.row_tokens)
    env = environment(args.commit)
    named = (args.teacher, args.student) == (TEACHER, STUDENT)
    shape = dict(name="tiny CPU" if args.tiny else "Qwen2.5-1.5B -> 0.5B-like" if named else
                 f"teacher {args.teacher} -> student {args.student}", teacher=args.teacher,
                 student=args.student, vocab=args.vocab, tokens_per_step=args.rows * args.row_tokens, k=args.k)
    print(f"environment: {env}")
    rows, floor = [], None

    def publish(measured: dict) -> None:
        """One row: its ratio to the full-logits loop's time (measured first), appended and printed
        at once, so a run stopped part-way keeps the rows it finished."""
        nonlocal floor
        provider, ms = measured.pop("provider"), measured.pop("ms")
        floor = ms if provider == FLOOR else floor
        ratio = ms / floor if ms is not None and floor else None
        rows.append(result_row(env, BENCHMARK, shape, provider, "median step", ms, FLOOR, ratio, None, **measured))
        append_rows(args.results, rows[-1:])
        print_table(rows[-1:], {"row": "provider", "tokens/s": "tokens_per_s", "step ms": "ms",
                                "× floor (time)": "ratio", "peak MiB": "peak_mib"})
        sys.stdout.flush()

    variants = [True] if args.compile_only else [False, True] if args.compile else [False]
    if not args.skip_single:
        packed = PackedRows(load_token_documents(data), args.row_tokens, eos_id=1, pad_id=0, seed=0)
        runs = [] if args.compile_only else [("full", None, "sdpa", False), ("kd_kernels", None, "sdpa", False)]
        for attention in attentions:
            if not args.compile_only:
                runs += [("full", packed, attention, False), ("kd_kernels", packed, attention, False)]
            if args.compile:
                runs += [("full", packed, attention, True), ("kd_kernels", packed, attention, True)]
        for kind, packed_rows, attention, compiled in runs:
            publish(single_process(kind, paths, args, device, packed_rows, attention, compiled))
            release_memory(device)
    for attention in attentions:
        for placement in args.placements.split(","):
            for strategy in args.strategies.split(","):
                for compiled in variants:
                    publish(driver(placement, strategy, paths, data, args, attention, compiled))
    print()
    print_table(rows, {"row": "provider", "tokens/s": "tokens_per_s", "step ms": "ms", "× floor (time)": "ratio",
                       "peak MiB": "peak_mib"})
    return rows



# ---- on-policy parts: weight sync and the on-policy step --------------------------------------

# Qwen2.5 shapes: (hidden, intermediate, layers, attention heads, KV heads, vocab, tied embeddings)
QWEN_SHAPES = {"0.5b": (896, 4864, 24, 14, 2, 151_936, True), "1.5b": (1536, 8960, 28, 12, 2, 151_936, True),
               "7b": (3584, 18_944, 28, 28, 4, 152_064, False)}
SYNC_TINY = {"tiny": (64, 128, 2, 4, 2, 512, True)}  # --weight-sync --tiny: on the CPU
SYNC_REPEATS = 5  # warm updates after the cold one
ONPOLICY_ROWS = ("default", "pair", "generation", "generation-0.5b")
# the parts of an on-policy step, in order: the generation as the driver waits for it, the whole
# weight update as the driver waits for it (a push, or pause, flush, send, continue), the student
# waiting on the teacher's scores, the top-k's hand-over, the student's step, the student call's
# dispatch; the rest is the driver's
ONPOLICY_PARTS = ("generate_seconds", "sync_wall_seconds", "wait_seconds", "transfer_seconds", "student_seconds",
                  "dispatch_seconds")
# what the on-policy step does not depend on, made cheap: the tokenizer (same vocab) trained on
# less text, a teacher pretrained briefly (its samples' scores cost the same), no checkpoints
ONPOLICY_SETUP = ("max_corpus_bytes=1000000", "teacher_pretrain_steps=20", "checkpoint_every=0")
ONPOLICY_PAIR = ("teacher_hidden=1536", "teacher_layers=28", "student_hidden=896", "student_layers=24", "heads=16")
ONPOLICY_TINY = ("device=cpu", "tokenizer_vocab=512", "max_corpus_bytes=200000", "teacher_hidden=64",
                 "teacher_layers=2", "student_hidden=32", "student_layers=2", "heads=4", "rows_per_micro_batch=2",
                 "micro_batches=1", "max_new_tokens=8", "k=8")
SYNC_FLOOR = "device-to-device copy (torch)"
PUSH = "push into the shared buffer (the trainer's update)"
PUSH_COPY = "push: the copy alone, into the mapped buffer"


def add_onpolicy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on-policy parts")
    group.add_argument("--weight-sync", action="store_true", help="time the colocated CUDA IPC weight sync")
    group.add_argument("--sync-models", default="0.5b,1.5b,7b", help=f"of {', '.join(QWEN_SHAPES)}")
    group.add_argument("--onpolicy", action="store_true", help="the on-policy step breakdown and generation speed")
    group.add_argument("--onpolicy-rows", default="default,pair,generation,generation-0.5b",
                       help=f"which on-policy rows, in order (comma): {', '.join(ONPOLICY_ROWS)}")


def qwen_like(name: str, device: str = "cuda"):
    """A random-init bf16 Qwen2 causal LM of ``QWEN_SHAPES[name]`` (or ``SYNC_TINY[name]``) on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab, tied = {**QWEN_SHAPES, **SYNC_TINY}[name]
    config = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=tied, torch_dtype=torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _sync_receiver(name: str, device: str, inbox, outbox) -> None:
    """The rollout side in its own process: a `RolloutWorker` (flattened) of a model of the same
    shapes, taking the driver's calls as messages ``(method, arguments)``; answers each with
    (the call's result, its seconds)."""
    from orchestration.rollout import RolloutWorker

    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    worker = RolloutWorker(qwen_like(name, device), pad_token_id=0, device=device)
    outbox.put("ready")
    while (message := inbox.get()) is not None:
        method, arguments = message
        start = time.perf_counter()
        result = getattr(worker, method)(*arguments)
        outbox.put((result, time.perf_counter() - start))


def _timed(function, device: str, repeats: int, *arguments) -> list[float]:
    """Seconds of ``repeats`` calls of ``function(*arguments)``, each between device synchronizations."""
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        function(*arguments)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def weight_sync_rows(env: dict, names: list[str], device: str = "cuda") -> list[dict]:
    """Per model: the floor (one flat device copy of the parameters' bytes), the two CUDA IPC
    paths of `orchestration.weight_sync` to a receiver process on the same GPU (CUDA only), and
    the trainer's push into the receiver's shared buffer. An IPC update's seconds run from its
    first call (the sender's, or the receiver's pause) to the sender's `release_shared` after
    the receiver's last answer (the receiver has published the new weight_version by then); its
    parts: the sender's calls, the receiver's calls (its copy among them), and the rest, the
    messages. A push's seconds are the trainer's whole `WeightPusher.push` (lock, copy, wait,
    publish, unlock; no message), with its lock-held part and its lock wait; "the copy alone"
    is the same copy into the mapped buffer without the lock."""
    import torch.multiprocessing as mp

    from orchestration.flat_parameters import flat_region, flatten_parameters
    from orchestration.weight_sync import WeightPusher, WeightSender

    rows = []
    context = mp.get_context("spawn")
    for name in names:
        model = qwen_like(name, device)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shape = dict(name=f"Qwen2.5-{name.upper()}-like student, bf16", bytes=total,
                     parameters=sum(p.numel() for p in model.parameters()))
        source, target = (torch.empty(total, dtype=torch.uint8, device=device) for _ in range(2))
        floor = _timed(target.copy_, device, SYNC_REPEATS + 1, source)
        del source, target
        floor_s = statistics.median(floor[1:])
        measured = {SYNC_FLOOR: (floor[0], floor_s, 1, None)}
        inbox, outbox = context.Queue(), context.Queue()
        child = context.Process(target=_sync_receiver, args=(name, device, inbox, outbox))
        child.start()
        assert outbox.get(timeout=600) == "ready"
        flatten_parameters(model)
        sender = WeightSender(model, bucket_bytes=512 * 2**20)
        version = 0

        def call(method: str, *arguments) -> tuple:
            inbox.put((method, arguments))
            return outbox.get(timeout=600)

        for provider in ("CUDA IPC, the flattened parameters", "CUDA IPC, packed 512 MiB buckets"):
            if device != "cuda":
                break
            seconds, parts = [], []
            for _ in range(SYNC_REPEATS + 1):
                version += 1
                copy = handled = sending = 0.0
                update_start = time.perf_counter()
                if provider.endswith("parameters"):  # one call pauses, copies, continues
                    start = time.perf_counter()
                    arguments = sender.share_tensors(version)
                    sending = time.perf_counter() - start
                    reply, handled = call("update_weights_from_tensor", *arguments, True)
                    copy = reply["seconds"]
                else:  # pause -> a call a bucket -> continue
                    handled = call("pause_generation")[1]
                    for index in range(len(sender.buckets)):
                        start = time.perf_counter()
                        arguments = sender.share(index, version)
                        sending += time.perf_counter() - start
                        reply, call_seconds = call("update_weights_from_tensor", *arguments)
                        copy, handled = copy + reply["seconds"], handled + call_seconds
                        if index < len(sender.buckets) - 1:
                            sender.release_shared()  # frees the bucket; the last one's call ends the update
                    handled += call("continue_generation")[1]
                released = sender.release_shared()
                seconds.append(time.perf_counter() - update_start)
                if released.weight_version != version:
                    raise RuntimeError(f"weight sync: the sender released weight_version {released.weight_version}, "
                                       f"expected {version}")
                parts.append((sending, handled, copy, seconds[-1] - sending - handled))
            measured[provider] = (seconds[0], statistics.median(seconds[1:]), len(sender.buckets),
                                  [statistics.median(part[i] for part in parts[1:]) for i in range(4)])
        # the driver's colocated sync: the receiver shares its buffer once (after the rows above, whose
        # calls would otherwise take its lock file too), the trainer maps it once and pushes by itself
        pusher = WeightPusher(model, call("share_weight_buffer")[0])
        pushes = []
        for _ in range(SYNC_REPEATS + 1):
            version += 1
            start = time.perf_counter()
            metrics, waited = pusher.push(version)
            pushes.append((time.perf_counter() - start, metrics.seconds, waited))
        if call("get_weight_version")[0] != version:
            raise RuntimeError(f"weight sync: the receiver holds weight_version {call('get_weight_version')[0]} "
                               f"after the push of {version}")
        flat, mapped = flat_region([p.detach() for p in model.parameters()]), pusher.buffer
        alone = _timed(mapped.copy_, device, SYNC_REPEATS + 1, flat)
        pusher.close()
        inbox.put(None)
        child.join(timeout=600)
        for provider, (cold, warm, buckets, part) in measured.items():
            extra = {} if part is None else dict(sender_ms=1e3 * part[0], receiver_ms=1e3 * part[1],
                                                 receiver_copy_ms=1e3 * part[2],
                                                 messages_ms=1e3 * part[3])
            rows.append(result_row(env, BENCHMARK, shape, provider, "weight update", 1e3 * warm, SYNC_FLOOR,
                                   warm / floor_s, None, warm_seconds=warm, cold_seconds=cold,
                                   gb_per_s=total / warm / 1e9, share_of_floor=floor_s / warm, buckets=buckets,
                                   **extra))
        warm = statistics.median(push[0] for push in pushes[1:])
        rows.append(result_row(env, BENCHMARK, shape, PUSH, "weight update", 1e3 * warm, SYNC_FLOOR, warm / floor_s,
                               None, warm_seconds=warm, cold_seconds=pushes[0][0], gb_per_s=total / warm / 1e9,
                               share_of_floor=floor_s / warm, buckets=1,
                               locked_ms=1e3 * statistics.median(push[1] for push in pushes[1:]),
                               lock_wait_ms=1e3 * statistics.median(push[2] for push in pushes[1:])))
        warm = statistics.median(alone[1:])
        rows.append(result_row(env, BENCHMARK, shape, PUSH_COPY, "weight update", 1e3 * warm, SYNC_FLOOR,
                               warm / floor_s, None, warm_seconds=warm, cold_seconds=alone[0],
                               gb_per_s=total / warm / 1e9, share_of_floor=floor_s / warm, buckets=1))
        del model, sender, pusher, flat, mapped
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def onpolicy_driver_row(env: dict, name: str, steps: int, warmup: int, output_dir: str, extra: list,
                        setup: list) -> dict:
    """The driver in mode=on_policy: the median step, tokens/s and the mean seconds of each part of
    a step after ``warmup`` (`ONPOLICY_PARTS`, each timed where it runs and ending on a device
    synchronization or a copy to the host; ``rest_seconds`` is the mean step less their sum: the
    driver's response batches, its calls to the teacher and the metrics row). ``teacher_seconds``
    (the teacher's own scoring) and ``sync_seconds`` (the update from student-0's share to its
    release, docs/DESIGN.md) lie within wait and sync_wall. ``run_seconds`` is the whole run,
    ``loop_seconds`` its steps (the rest is setup and the final evaluation). ``setup``: the
    options the step does not depend on (stated in the row)."""
    overrides = [f"output_dir={output_dir}", f"steps={steps}",
                 "overwrite=true", "mode=on_policy", *setup, *extra]
    config = load_config(None, overrides)
    started = time.perf_counter()
    summary = run(config, progress=True)  # the phases' lines say where the setup's time goes
    run_seconds = time.perf_counter() - started
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle]
    timed = records[warmup:]
    parts = {key: statistics.mean(r.get(key, 0.0) for r in timed) for key in ONPOLICY_PARTS}
    step_mean = statistics.mean(r["step_seconds"] for r in timed)
    shape = dict(name=name, teacher=f"{config.teacher_layers} x {config.teacher_hidden}",
                 student=f"{config.student_layers} x {config.student_hidden}", vocab=summary["vocab"],
                 samples_per_step=config.rows_per_micro_batch * config.micro_batches,
                 max_new_tokens=config.max_new_tokens, k=config.k, device=config.device, setup=" ".join(setup),
                 steps=steps, warmup=warmup)
    syncs = [r["sync_gb_per_s"] for r in timed if "sync_gb_per_s" in r]
    return result_row(env, BENCHMARK, shape, "driver, on_policy", "median step",
                      1e3 * statistics.median(r["step_seconds"] for r in timed), None, None, None,
                      tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                      response_tokens=statistics.mean(r["tokens"] for r in timed),
                      sync_transport=summary["weight_sync"], sync_gb_per_s=statistics.median(syncs) if syncs else None,
                      step_mean_seconds=step_mean, **parts, rest_seconds=step_mean - sum(parts.values()),
                      teacher_seconds=statistics.mean(r["teacher_seconds"] for r in timed),
                      sync_seconds=statistics.mean(r.get("sync_seconds", 0.0) for r in timed),
                      run_seconds=run_seconds, loop_seconds=sum(r["step_seconds"] for r in records))


def generation_row(env: dict, name: str, build, vocab: int, batch: int, new: int, device: str) -> list[dict]:
    """Generation tokens/s of `rollout.RolloutWorker` against ``model.generate`` of the same
    model (``build()``, bf16 on CUDA), prompts and sampling (no stop token: every row generates
    ``new`` tokens), and the floor under both: a bare KV-cached loop of the model's forward and
    multinomial sampling (what any generate pays for the model itself). Median of 3 after a
    warm-up, device-synchronized."""
    from orchestration.rollout import RolloutWorker, SamplingParams

    cuda = device == "cuda"
    model = build().to(device=device, dtype=torch.bfloat16 if cuda else torch.float32).eval()
    prompt_tokens = 64
    prompts = torch.randint(3, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(0))
    worker = RolloutWorker(model, pad_token_id=0, device=device, vocab_size=vocab)
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    on_device = prompts.to(device)

    def ours():
        worker.generate(prompts.tolist(), sampling)

    @torch.no_grad()
    def plain():
        model.generate(input_ids=on_device, attention_mask=torch.ones_like(on_device), max_new_tokens=new,
                       do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None,
                       use_cache=True)

    accepted = inspect.signature(model.forward).parameters
    cache_keyword = "cache" if "cache" in accepted else "past_key_values"  # the name the installed version takes
    last_only = dict(logits_to_keep=1) if "logits_to_keep" in accepted else {}

    @torch.no_grad()
    def loop():
        out = model(input_ids=on_device, use_cache=True, **last_only)
        for position in range(new):  # new tokens from new forwards, as generate
            token = torch.multinomial(torch.softmax(out.logits[:, -1, :vocab].float(), -1), 1)
            if position + 1 < new:
                cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
                out = model(input_ids=token, use_cache=True, **{cache_keyword: cache}, **last_only)

    timed = {}
    for provider, call in (("plain HF generate", plain), ("rollout worker", ours),
                           ("bare KV-cached loop (torch)", loop)):
        call()  # warm-up
        seconds = []
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        timed[provider] = statistics.median(seconds)
    shape = dict(name=f"generation, {name}", batch=batch, prompt_tokens=prompt_tokens, new_tokens=new, vocab=vocab,
                 device=device)
    return [result_row(env, BENCHMARK, shape, provider, "median of 3", 1e3 * seconds, "plain HF generate",
                       seconds / timed["plain HF generate"], None, tokens_per_s=batch * new / seconds,
                       ms_per_token=1e3 * seconds / new)
            for provider, seconds in timed.items()]


def onpolicy_rows(env: dict, row: str, args) -> list[dict]:
    """The rows of one ``--onpolicy-rows`` entry (module docstring)."""
    tiny = list(ONPOLICY_TINY) if args.tiny else []
    device = "cpu" if args.tiny else "cuda"
    if row in ("default", "pair"):
        extra = [*(ONPOLICY_PAIR if row == "pair" else []), *tiny, *args.set]
        name = ("on-policy, GPU default" if row == "default"
                else "on-policy, 1.5B -> 0.5B-like pair (Qwen2.5 layers x hidden)")
        return [onpolicy_driver_row(env, name + (" (tiny CPU)" if args.tiny else ""), args.steps, args.warmup,
                                    os.path.join(args.output_dir, f"onpolicy_{row}"), extra, list(ONPOLICY_SETUP))]
    config = load_config(None, [f"device={device}", *tiny, *args.set])
    batch, new = config.rows_per_micro_batch * config.micro_batches, config.max_new_tokens
    if row == "generation":
        vocab = config.tokenizer_vocab
        return generation_row(env, "driver default student" + (" (tiny CPU)" if args.tiny else ""),
                              lambda: build_model(None, config.student_hidden, config.student_layers, config, vocab, 1),
                              vocab, batch, new, device)
    return generation_row(env, "Qwen2.5-0.5B-like", lambda: qwen_like("0.5b"), QWEN_SHAPES["0.5b"][5], batch, new,
                          device)


COLUMNS = {"shape": lambda row: row["shape"]["name"], "provider": "provider", "ms": "ms", "× floor": "ratio",
           "GB/s": "gb_per_s", "share of floor": "share_of_floor", "receiver copy ms": "receiver_copy_ms",
           "sender ms": "sender_ms", "receiver ms": "receiver_ms", "messages ms": "messages_ms",
           "locked ms": "locked_ms", "lock wait ms": "lock_wait_ms",
           "cold s": "cold_seconds", "tokens/s": "tokens_per_s", "ms/token": "ms_per_token",
           "generate s": "generate_seconds", "sync s": "sync_wall_seconds", "(copy s)": "sync_seconds",
           "teacher wait s": "wait_seconds", "(teacher s)": "teacher_seconds", "transfer s": "transfer_seconds",
           "student s": "student_seconds", "dispatch s": "dispatch_seconds", "rest s": "rest_seconds",
           "step s": "step_mean_seconds", "run s": "run_seconds", "loop s": "loop_seconds"}


def onpolicy_main(args, parser: argparse.ArgumentParser) -> list[dict]:
    """--weight-sync and --onpolicy: each row printed and appended to ``--results`` as soon as it
    is measured, so a run stopped part-way keeps the rows it finished."""
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("bench_e2e_throughput: needs a CUDA device (or --tiny)")
    env = environment(args.commit)
    print(f"environment: {env}", flush=True)
    rows = []

    def publish(measured: list[dict]) -> None:
        rows.extend(measured)
        append_rows(args.results, measured)
        print_table(measured, {key: value for key, value in COLUMNS.items()
                               if callable(value) or any(row.get(value) is not None for row in measured)})
        sys.stdout.flush()

    if args.weight_sync and args.tiny:
        publish(weight_sync_rows(env, list(SYNC_TINY), "cpu"))
    elif args.weight_sync:
        names = [part.strip().lower() for part in args.sync_models.split(",") if part.strip()]
        if not names or any(name not in QWEN_SHAPES for name in names):
            parser.error(f"--sync-models: expected a comma-separated list of {', '.join(QWEN_SHAPES)}, "
                         f"got {args.sync_models!r}")
        publish(weight_sync_rows(env, names))
    if args.onpolicy:
        chosen = [part.strip() for part in args.onpolicy_rows.split(",") if part.strip()]
        if not chosen or any(row not in ONPOLICY_ROWS for row in chosen):
            parser.error(f"--onpolicy-rows: expected a comma-separated list of {', '.join(ONPOLICY_ROWS)}, "
                         f"got {args.onpolicy_rows!r}")
        if args.tiny and "generation-0.5b" in chosen:
            parser.error("--onpolicy-rows: generation-0.5b needs a CUDA device (no --tiny)")
        if any(row in ("default", "pair") for row in chosen) and args.steps <= args.warmup:
            parser.error(f"--steps: expected more than --warmup ({args.warmup}), got {args.steps}")
        for row in chosen:
            publish(onpolicy_rows(env, row, args))
    return rows


if __name__ == "__main__":
    main()
