"""Throughput of the Ray driver on GPUs against one process doing the same work in PyTorch.

Providers (protocol "median step": the median over the steps after 5 of warm-up):
  single process, full-logits KD (PyTorch)   the floor: the same teacher and student in one
      process, teacher forward, KL over the whole vocab at the temperature + CE, student step
  colocated                 teacher and student workers on one GPU, top-k through CUDA IPC,
                            the teacher scoring step i + 1 while the student trains step i
  colocated, no overlap     the same, one after the other
  disaggregated             a GPU each, top-k through NCCL (when two GPUs are there)
Rows: ``ms`` a step, ``tokens_per_s``, and for the driver the mean seconds a step spends in
the teacher, waiting for it, in the transfer, in the student and in Ray's dispatch;
``teacher_hidden`` = 1 − wait / teacher time, the share of the teacher's time the student did
not wait for. All at the driver's GPU default sizes. Default: 40 steps, ~4 minutes on one H200.

On-policy parts (instead of the above; no Ray for --weight-sync):
  --weight-sync   trainer -> rollout weight sync colocated on one GPU, random-init bf16 students
      of Qwen2.5-0.5B/1.5B/7B shapes: the receiver in a second process copying straight out of
      the trainer's parameters by CUDA IPC (the driver's colocated path), and through packed
      512 MiB buckets; the floor is torch's device-to-device copy of the same bytes in one
      buffer. Rows: seconds and GB/s an update (cold: the first, opening the IPC handles; warm:
      the median of the next ones) and the share of the floor's bandwidth.
  --onpolicy      the driver with mode=on_policy: the step's breakdown (generate / sync /
      teacher / student seconds) and tokens/s at the GPU default and at a 1.5B -> 0.5B-like
      pair (Qwen2.5 layers and hidden sizes, the driver's vocab); and generation tokens/s of
      the rollout worker against plain Hugging Face generate of the same model and batch.

usage: python benchmarks/bench_e2e_throughput.py [--steps 40] [--set key=value ...]
       python benchmarks/bench_e2e_throughput.py --weight-sync [--sync-models 0.5b,1.5b,7b]
       python benchmarks/bench_e2e_throughput.py --onpolicy [--steps 40]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import add_results_arguments, append_rows, environment, print_table, result_row  # noqa: E402
from orchestration.config import load_config  # noqa: E402
from orchestration.driver import run  # noqa: E402
from orchestration.models import build_model  # noqa: E402

BENCHMARK = "bench_e2e_throughput"
FLOOR = "single process, full-logits KD (PyTorch)"
WARMUP = 5
PARTS = ("teacher_seconds", "wait_seconds", "transfer_seconds", "student_seconds", "dispatch_seconds")


def driver_measurement(name, steps, output_dir, extra, *overrides) -> dict:
    # throughput does not depend on how much text the tokenizer and rows come from: 4 MB is quicker
    config = load_config(None, [f"output_dir={output_dir}/{name}", f"steps={steps}", "teacher_pretrain_steps=20",
                                "checkpoint_every=0", "max_corpus_bytes=4000000", "overwrite=true", *extra, *overrides])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle][WARMUP:]
    mean = {key: statistics.mean(r[key] for r in records) for key in PARTS}
    return dict(provider=name, ms=1e3 * statistics.median(r["tokens"] / r["tokens_per_s"] for r in records),
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in records), placement=summary["placement"],
                transfer=summary["transfer"],
                teacher_hidden=min(max(1.0 - mean["wait_seconds"] / max(mean["teacher_seconds"], 1e-9), 0.0), 1.0),
                **mean)


def baseline_measurement(steps, extra) -> dict:
    """One process: teacher forward, full logits, KL + CE, student backward and step."""
    config = load_config(None, ["device=cuda", *extra])
    vocab = config.tokenizer_vocab
    teacher = build_model(None, config.teacher_hidden, config.teacher_layers, config, vocab, 0).cuda().eval()
    student = build_model(None, config.student_hidden, config.student_layers, config, vocab, 1).cuda()
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr)
    rows = config.rows_per_micro_batch * config.micro_batches
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        tokens = torch.randint(0, vocab, (rows, config.row_tokens), device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            teacher_logits = teacher(input_ids=tokens).logits[..., :vocab].float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            student_logits = student(input_ids=tokens).logits[..., :vocab].float()
        teacher_logprobs = torch.log_softmax(teacher_logits / config.temperature, -1)
        student_logprobs = torch.log_softmax(student_logits / config.temperature, -1)
        kl = (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1).mean()
        ce = F.cross_entropy(student_logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss = config.kd_weight * kl + config.ce_weight * ce
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    step_seconds = statistics.median(times)
    return dict(provider=FLOOR, ms=1e3 * step_seconds, tokens_per_s=rows * config.row_tokens / step_seconds,
                placement="one GPU", transfer="none", peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps a layout (the first 5 are warm-up)")
    parser.add_argument("--output-dir", default="runs/bench_e2e_throughput", help="the driver's runs go here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a driver option for every run (python orchestrate.py --help lists them)")
    add_results_arguments(parser, BENCHMARK)
    add_onpolicy_arguments(parser)
    args = parser.parse_args()
    if args.weight_sync or args.onpolicy:
        return onpolicy_main(args, parser)
    if args.steps <= WARMUP:
        parser.error(f"--steps: expected more than the {WARMUP} warm-up steps, got {args.steps}")
    if not torch.cuda.is_available():
        sys.exit("bench_e2e_throughput: needs a CUDA device")
    env = environment(args.commit)
    config = load_config(None, ["device=cuda", *args.set])
    shape = dict(name="driver, GPU default", tokens_per_step=config.row_tokens * config.rows_per_micro_batch
                 * config.micro_batches, vocab=config.tokenizer_vocab, k=config.k,
                 teacher=f"{config.teacher_layers} x {config.teacher_hidden}",
                 student=f"{config.student_layers} x {config.student_hidden}", gpus=torch.cuda.device_count())
    measurements = [baseline_measurement(args.steps, args.set),
                    driver_measurement("colocated", args.steps, args.output_dir, args.set, "placement=colocated"),
                    driver_measurement("colocated, no overlap", args.steps, args.output_dir, args.set,
                                       "placement=colocated", "overlap=false")]
    if torch.cuda.device_count() >= 2:
        measurements.append(driver_measurement("disaggregated", args.steps, args.output_dir, args.set,
                                               "placement=disaggregated"))
    floor_ms = measurements[0]["ms"]
    rows = []
    for m in measurements:
        provider, ms = m.pop("provider"), m.pop("ms")
        rows.append(result_row(env, BENCHMARK, shape, provider, "median step", ms, FLOOR, ms / floor_ms, None, **m))
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, {"layout": "provider", "transfer": "transfer", "tokens/s": "tokens_per_s", "step ms": "ms",
                       "× floor (time)": "ratio", **{part.replace("_seconds", " s"): part for part in PARTS},
                       "teacher hidden": "teacher_hidden"})



# ---- on-policy parts: weight sync and the on-policy step --------------------------------------

# Qwen2.5 shapes: (hidden, intermediate, layers, attention heads, KV heads, vocab, tied embeddings)
QWEN_SHAPES = {"0.5b": (896, 4864, 24, 14, 2, 151_936, True), "1.5b": (1536, 8960, 28, 12, 2, 151_936, True),
               "7b": (3584, 18_944, 28, 28, 4, 152_064, False)}
SYNC_REPEATS = 5  # warm updates after the cold one
SYNC_FLOOR = "device-to-device copy (torch)"


def add_onpolicy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on-policy parts")
    group.add_argument("--weight-sync", action="store_true", help="time the colocated CUDA IPC weight sync")
    group.add_argument("--sync-models", default="0.5b,1.5b,7b", help=f"of {', '.join(QWEN_SHAPES)}")
    group.add_argument("--onpolicy", action="store_true", help="the on-policy step breakdown and generation speed")


def qwen_like(name: str):
    """A random-init bf16 Qwen2 causal LM of ``QWEN_SHAPES[name]`` on the current GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab, tied = QWEN_SHAPES[name]
    config = Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=tied, torch_dtype=torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def _sync_receiver(name: str, inbox, outbox) -> None:
    """The rollout side in its own process: a model of the same shapes, updated from each message
    ``(receive_buffer arguments, last bucket of the update)``; answers each message."""
    from orchestration.weight_sync import WeightReceiver

    torch.cuda.set_device(0)
    receiver = WeightReceiver(qwen_like(name))
    outbox.put("ready")
    while (message := inbox.get()) is not None:
        arguments, last = message
        if not receiver.paused:
            receiver.pause()
        receiver.receive_buffer(*arguments)
        if last:
            receiver.resume()
        outbox.put("done")


def weight_sync_rows(env: dict, names: list[str]) -> list[dict]:
    """Per model: the floor (one flat device copy of the parameters' bytes) and the two CUDA IPC
    paths of `orchestration.weight_sync` to a receiver process on the same GPU."""
    import torch.multiprocessing as mp

    from orchestration.weight_sync import WeightSender

    rows = []
    context = mp.get_context("spawn")
    for name in names:
        model = qwen_like(name)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shape = dict(name=f"Qwen2.5-{name.upper()}-like student, bf16", bytes=total,
                     parameters=sum(p.numel() for p in model.parameters()))
        source, target = torch.empty(total, dtype=torch.uint8, device="cuda"), torch.empty(total, dtype=torch.uint8,
                                                                                             device="cuda")
        floor = []
        for _ in range(SYNC_REPEATS + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            target.copy_(source)
            torch.cuda.synchronize()
            floor.append(time.perf_counter() - start)
        del source, target
        floor_s = statistics.median(floor[1:])
        measured = {SYNC_FLOOR: (floor[0], floor_s, 1)}
        inbox, outbox = context.Queue(), context.Queue()
        child = context.Process(target=_sync_receiver, args=(name, inbox, outbox))
        child.start()
        assert outbox.get(timeout=600) == "ready"
        sender = WeightSender(model, bucket_bytes=512 * 2**20)
        version = 0
        for provider in ("CUDA IPC, the parameters' storages", "CUDA IPC, packed 512 MiB buckets"):
            seconds = []
            for _ in range(SYNC_REPEATS + 1):
                version += 1
                if provider.endswith("storages"):
                    inbox.put((sender.share_tensors(version), True))
                    assert outbox.get(timeout=600) == "done"
                else:
                    for index in range(len(sender.buckets)):
                        inbox.put((sender.share(index, version), index == len(sender.buckets) - 1))
                        assert outbox.get(timeout=600) == "done"
                        if index < len(sender.buckets) - 1:
                            sender.release_shared()  # frees the bucket; the last one's call ends the update
                metrics = sender.release_shared()
                seconds.append(metrics.seconds)
            measured[provider] = (seconds[0], statistics.median(seconds[1:]), len(sender.buckets))
        inbox.put(None)
        child.join(timeout=600)
        for provider, (cold, warm, buckets) in measured.items():
            rows.append(result_row(env, BENCHMARK, shape, provider, "weight update", 1e3 * warm, SYNC_FLOOR,
                                   warm / floor_s, None, warm_seconds=warm, cold_seconds=cold,
                                   gb_per_s=total / warm / 1e9, share_of_floor=floor_s / warm, buckets=buckets))
        del model, sender
        torch.cuda.empty_cache()
    return rows


def onpolicy_driver_row(env: dict, name: str, steps: int, output_dir: str, extra: list) -> dict:
    """The driver in mode=on_policy: median step, tokens/s, mean seconds of each part."""
    config = load_config(None, [f"output_dir={output_dir}/{name.replace(' ', '_')}", f"steps={steps}",
                                "teacher_pretrain_steps=20", "checkpoint_every=0", "max_corpus_bytes=4000000",
                                "overwrite=true", "mode=on_policy", *extra])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle][WARMUP:]
    parts = {key: statistics.mean(r.get(key, 0.0) for r in records)
             for key in ("generate_seconds", "sync_seconds", "teacher_seconds", "student_seconds")}
    ms = 1e3 * statistics.median(r["step_seconds"] for r in records)
    shape = dict(name=name, teacher=f"{config.teacher_layers} x {config.teacher_hidden}",
                 student=f"{config.student_layers} x {config.student_hidden}", vocab=config.tokenizer_vocab,
                 samples_per_step=config.rows_per_micro_batch * config.micro_batches,
                 max_new_tokens=config.max_new_tokens, k=config.k)
    return result_row(env, BENCHMARK, shape, "driver, on_policy", "median step", ms, None, None, None,
                      tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                      sync_transport=summary["weight_sync"],
                      sync_gb_per_s=statistics.median(r["sync_gb_per_s"] for r in records if "sync_gb_per_s" in r),
                      **parts)


def generation_rows(env: dict, extra: list) -> list[dict]:
    """Generation tokens/s of `rollout.RolloutWorker` against ``model.generate`` of the same
    bf16 model, prompts and sampling (no stop token: every row generates max_new_tokens)."""
    from orchestration.rollout import RolloutWorker, SamplingParams

    rows = []
    config = load_config(None, ["device=cuda", *extra])
    for name, model in (("driver GPU default student", lambda: build_model(
            None, config.student_hidden, config.student_layers, config, config.tokenizer_vocab, 1)),
                        ("Qwen2.5-0.5B-like", lambda: qwen_like("0.5b"))):
        model = model().cuda().to(torch.bfloat16).eval()
        vocab = config.tokenizer_vocab if name.startswith("driver") else model.config.vocab_size
        batch, prompt_tokens, new = config.rows_per_micro_batch * config.micro_batches, 64, config.max_new_tokens
        prompts = torch.randint(0, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(0))
        worker = RolloutWorker(model, pad_token_id=0, device="cuda")
        sampling = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)

        def ours():
            worker.generate(prompts.tolist(), sampling)

        def plain():
            with torch.no_grad():
                model.generate(input_ids=prompts.cuda(), attention_mask=torch.ones_like(prompts).cuda(),
                               max_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                               pad_token_id=0, eos_token_id=None, use_cache=True)

        timed = {}
        for provider, call in (("plain HF generate", plain), ("rollout worker", ours)):
            call()  # warm-up
            seconds = []
            for _ in range(3):
                torch.cuda.synchronize()
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - start)
            timed[provider] = statistics.median(seconds)
        shape = dict(name=f"generation, {name}", batch=batch, prompt_tokens=prompt_tokens, new_tokens=new)
        for provider, seconds in timed.items():
            rows.append(result_row(env, BENCHMARK, shape, provider, "median of 3", 1e3 * seconds,
                                   "plain HF generate", seconds / timed["plain HF generate"], None,
                                   tokens_per_s=batch * new / seconds))
    return rows


def onpolicy_main(args, parser: argparse.ArgumentParser) -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_e2e_throughput: needs a CUDA device")
    env = environment(args.commit)
    rows = []
    if args.weight_sync:
        names = [part.strip().lower() for part in args.sync_models.split(",") if part.strip()]
        if not names or any(name not in QWEN_SHAPES for name in names):
            parser.error(f"--sync-models: expected a comma-separated list of {', '.join(QWEN_SHAPES)}, "
                         f"got {args.sync_models!r}")
        rows += weight_sync_rows(env, names)
    if args.onpolicy:
        if args.steps <= WARMUP:
            parser.error(f"--steps: expected more than the {WARMUP} warm-up steps, got {args.steps}")
        pair = ["teacher_hidden=1536", "teacher_layers=28", "student_hidden=896", "student_layers=24", "heads=16"]
        rows.append(onpolicy_driver_row(env, "on-policy, GPU default", args.steps, args.output_dir, args.set))
        rows.append(onpolicy_driver_row(env, "on-policy, 1.5B -> 0.5B-like (Qwen2.5 layers x hidden)", args.steps,
                                        args.output_dir, [*pair, *args.set]))
        rows += generation_rows(env, args.set)
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, {"shape": lambda row: row["shape"]["name"], "provider": "provider", "ms": "ms",
                       "× floor": "ratio", "GB/s": "gb_per_s", "share of floor": "share_of_floor", "cold s": "cold_seconds",
                       "tokens/s": "tokens_per_s", "generate s": "generate_seconds", "sync s": "sync_seconds",
                       "teacher s": "teacher_seconds", "student s": "student_seconds"})


if __name__ == "__main__":
    main()
