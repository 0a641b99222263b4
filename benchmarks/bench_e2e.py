"""Distillation quality of the Ray driver: at equal steps and data, the student distilled from
the teacher's top-k against the same student trained on CE alone.

Providers (protocol "equal steps"): "distilled" and "CE alone" (the floor: kd_weight = 0, its
teacher not pretrained since it is never read). Rows hold ``held_out_ce`` (nats a token on the
held-out rows), ``ratio`` = held-out CE / CE alone's, the train CE of the first and last steps,
the median ``tokens_per_s`` and ``ms`` a step, and the teacher's held-out CE. Exits 1 when
distillation does not beat CE alone. On a GPU it runs the driver's GPU default (~2 minutes on
one H200); on CPU the small default (~3 minutes on 2 cores).

With ``--onpolicy``, instead: on-policy distillation at equal steps (protocol "equal steps,
on-policy"): off-policy (mode=gkd with lmbda 0, which trains exactly as mode=off_policy, with
sft_alpha = ce_weight), GKD (lmbda 0.5, its dataset steps likewise), on-policy (lmbda 1) and CE
alone (kd_weight 0, sft_alpha 1, lmbda 0), every run with a pretrained teacher; rows add
``teacher_reverse_kl``, the teacher's reverse KL of the student's samples of held-out prompts
(nats a token; over the whole vocab, and ``teacher_reverse_kl_top_k`` over the k + 1 bins of the
teacher's top-k and tail, what ``support=tail`` trains: the gap is the divergence within the tail
that the loss cannot see). The driver's loss options apply to every run: on-policy distillation
usually runs reverse_kl or jsd (``--set divergence=reverse_kl``). ``--runs`` picks the runs and
their order (ce, off, gkd, on); each row is printed and appended to the results when its run
ends. On a GPU the runs take `ONPOLICY_GPU` (the GPU default models, 60 steps, 64 new tokens, a
teacher of 300 steps, 4 MB of corpus) under any ``--set``; on CPU the small default.

usage: python benchmarks/bench_e2e.py [--set key=value ...]   (the driver's options)
       python benchmarks/bench_e2e.py --quality [--samples 12] [--seeds 3] [--set ...]   (teacher signals compared)
       python benchmarks/bench_e2e.py --cache-read   (teacher cache read tokens/s against the student loss's)
       python benchmarks/bench_e2e.py --onpolicy [--runs ce,off,gkd,on] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kd_kernels as kd  # noqa: E402
from harness import add_results_arguments, append_rows, environment, print_table, result_row  # noqa: E402
from orchestration.cache_codec import Codec  # noqa: E402
from orchestration.config import load_config  # noqa: E402
from orchestration.data import IGNORE_INDEX, prepare_data  # noqa: E402
from orchestration.driver import run  # noqa: E402
from orchestration.hf_models import final_hidden_states  # noqa: E402
from orchestration.models import autocast, build_model, lm_head_inputs, pick_device  # noqa: E402
from orchestration.placement import device_type  # noqa: E402
from orchestration.progress import Progress  # noqa: E402
from orchestration.sampler import StepSampler  # noqa: E402
from orchestration.student import lr_factor  # noqa: E402
from orchestration.teacher import TeacherWorker  # noqa: E402

BENCHMARK = "bench_e2e"
FLOOR = "CE alone"
# CE alone never reads the teacher's top-k (kd_weight = 0): its teacher is left unpretrained
RUNS = (("distilled", []), (FLOOR, ["kd_weight=0", "ce_weight=1", "teacher_pretrain_steps=0"]))


def measure(name, overrides, output_dir) -> dict:
    config = load_config(None, overrides + [f"output_dir={output_dir}/{name.replace(' ', '_')}", "overwrite=true"])
    summary = run(config, progress=False)
    with open(summary["metrics"]) as handle:
        records = [json.loads(line) for line in handle]
    return dict(held_out_ce=summary["student_held_out_ce"], teacher_held_out_ce=summary["teacher_held_out_ce"],
                train_ce_first=records[0]["ce"], train_ce_last=records[-1]["ce"],
                tokens_per_s=statistics.median(r["tokens_per_s"] for r in records),
                ms=1e3 * statistics.median(r["tokens"] / r["tokens_per_s"] for r in records))


# ---- --quality and --cache-read ---------------------------------------------------------
# Which teacher signal recovers the most of full-vocab KD's gain per byte: one teacher (built and
# pretrained as the driver's, on the training rows only), then for each student seed one student a
# signal, all from that seed's initialization on that seed's rows at the same steps, in one process
# (no Ray), scored on the held-out rows. The driver's loss weights and temperature apply to every
# KD signal (its defaults: kd_weight 1, ce_weight 0.5, temperature 1, forward KL).
#
# Signals: CE only (the floor: kd_weight 0, ce_weight 1), full-vocab KD (the reference: the top-k
# with k = V under support "tail", whose bins are the whole vocab), top-k (k = 8, 64)
# renormalized and with the tail bin, and sampled (n Gumbel-top-n samples a token, fresh each
# step, support "sampled"); no hybrid (top-k head + sampled tail) exists to compare. Each row
# reports the mean and spread over seeds of the held-out CE and of the held-out full-vocab
# KL(teacher ‖ student) at temperature 1, the bytes a token of its signal in the cache's lossless
# encoding, the shares of full KD's CE gain and KL reduction over CE only it recovers, and the
# CE share per byte; a last row gives the teacher's own held-out CE.

CE_ONLY = "CE only"
TEACHER = "teacher (for scale)"
# the students train 50 steps, a fifth of the teacher's 250 pretraining steps (docs/DESIGN.md, quality)
QUALITY_DEFAULTS = ["steps=50"]
HELD_OUT_EVERY = 20  # every 20th packed row is held out (the driver's split holds out the corpus's last 5 %)
FULL_KD = "full KD"
EVAL_ROWS = 8  # held-out rows a forward


def signals(samples: int) -> list[tuple[str, str, int, str]]:
    """(name, entries, k (0: the vocab), support) of each signal compared."""
    rows = [(CE_ONLY, "topk", 1, "renormalized"), (FULL_KD, "topk", 0, "tail")]
    for k in (8, 64):
        rows += [(f"top-{k} renormalized", "topk", k, "renormalized"), (f"top-{k} tail", "topk", k, "tail")]
    return rows + [(f"sampled n={samples}", "samples", samples, "sampled")]


def bytes_per_token(name: str, entries: str, k: int, vocab: int) -> float:
    """The signal's bytes a token in the cache's lossless encoding (0 for CE only)."""
    if name == CE_ONLY:
        return 0.0
    fields = ("log_threshold",) if entries == "samples" else ()
    return float(Codec("lossless", vocab, k, fields).bytes_per_position)


@torch.no_grad()
def teacher_hidden_states(config, data, teacher) -> list[torch.Tensor]:
    """The teacher's lm_head inputs ``[rows · T, H]`` of each of ``config.steps`` steps' rows
    (`StepSampler` of ``config.seed``), computed once and read by every signal's student."""
    sampler = StepSampler(config.seed, data.train_tokens.shape[0], config.micro_batches, config.rows_per_micro_batch)
    teacher.model.eval()
    states = []
    for step in range(config.steps):
        tokens = data.train_tokens[torch.cat(sampler.picks(step))].to(teacher.device)
        with autocast(teacher.device):
            hidden = final_hidden_states(teacher.model, tokens).flatten(0, 1)
        states.append(lm_head_inputs(teacher.model, hidden)[0])
    return states


@torch.no_grad()
def _teacher_entries(hidden, weight, entries: str, k: int, vocab: int, temperature: float, seed: int):
    if entries == "samples":
        return kd.teacher_sample(hidden, weight, k, seed=seed, temperature=temperature, vocab_size=vocab)
    return kd.teacher_topk(hidden, weight, k=k, temperature=temperature, vocab_size=vocab)


def train_student(config, data, teacher, teacher_hidden: list[torch.Tensor], entries: str, k: int, support: str,
                  kd_weight: float, ce_weight: float):
    """The student after ``config.steps`` AdamW steps (the driver's schedule, clip and rows) on
    ``kd_weight · KD + ce_weight · CE`` with the teacher signal (entries, k, support) drawn from
    ``teacher_hidden`` (`teacher_hidden_states` of this config); its median ms a step."""
    device, vocab = teacher.device, data.vocab
    teacher_weight = lm_head_inputs(teacher.model, teacher_hidden[0])[1].detach()
    student = build_model(None, config.student_hidden, config.student_layers, config, vocab, config.seed + 1).to(device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.warmup_steps, config.steps))
    sampler = StepSampler(config.seed, data.train_tokens.shape[0], config.micro_batches, config.rows_per_micro_batch)
    seconds = []
    for step in range(config.steps):
        started = time.perf_counter()
        pick = torch.cat(sampler.picks(step))
        tokens, labels = data.train_tokens[pick].to(device), data.train_labels[pick].to(device).reshape(-1)
        teacher_signal = _teacher_entries(teacher_hidden[step], teacher_weight, entries, k, vocab, config.temperature,
                                          seed=config.seed * 1_000_003 + step)
        student.train()
        with autocast(device):
            hidden = final_hidden_states(student, tokens).flatten(0, 1)
        loss = kd.topk_divergence(*lm_head_inputs(student, hidden), teacher_signal, labels, support=support,
                                  divergence="forward_kl", temperature=config.temperature, kd_weight=kd_weight,
                                  ce_weight=ce_weight, vocab_size=vocab)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return student, 1e3 * sorted(seconds)[len(seconds) // 2]


@torch.no_grad()
def held_out_scores(student, teacher_model, data, device) -> tuple[float, float]:
    """(held-out CE, held-out full-vocab KL(teacher ‖ student)), nats a token at temperature 1."""
    student.eval()
    teacher_model.eval()
    vocab, ce, kl, count = data.vocab, 0.0, 0.0, 0
    for start in range(0, data.held_tokens.shape[0], EVAL_ROWS):
        tokens = data.held_tokens[start:start + EVAL_ROWS].to(device)
        targets = data.held_labels[start:start + EVAL_ROWS].to(device).reshape(-1)
        counted = targets != IGNORE_INDEX
        with autocast(device):
            log_q = torch.log_softmax(student(input_ids=tokens).logits[..., :vocab].float(), -1).reshape(-1, vocab)
            log_p = torch.log_softmax(teacher_model(input_ids=tokens).logits[..., :vocab].float(), -1)
        log_p = log_p.reshape(-1, vocab)
        ce += F.nll_loss(log_q, targets, ignore_index=IGNORE_INDEX, reduction="sum").item()
        kl += (log_p.exp() * (log_p - log_q)).sum(-1)[counted].sum().item()
        count += int(counted.sum())
    return ce / max(count, 1), kl / max(count, 1)


def compare(config, samples: int = 12, seeds: int = 1, progress: bool = False) -> list[dict]:
    """One dict a signal, then one for the teacher: name, the mean over ``seeds`` students (the
    student seeds ``config.seed + s``: its initialization, data order and teacher-sample noise;
    one teacher for all) of held_out_ce and kl_to_teacher with their sample standard deviations
    (``*_sd``, None for one seed), bytes_per_token, ce_gain_share = mean (CE only − signal) /
    mean (CE only − full KD) of the held-out CE and kl_reduction_share the same of the KL (nan
    where full KD's mean gain is not positive), ce_gain_share_per_byte and ms a step."""
    report = Progress(progress)
    data = interleaved_split(prepare_data(config, report))
    teacher = TeacherWorker(config, data.vocab)
    teacher.set_rows(data.train_tokens, data.train_labels)
    if not config.teacher_path and config.teacher_pretrain_steps:
        with report.phase(f"teacher pretraining ({config.teacher_pretrain_steps} CE steps)"):
            teacher.pretrain(config.teacher_pretrain_steps)
    teacher.finish_pretraining()
    teacher.model.to(pick_device(config))
    teacher_ce, _ = held_out_scores(teacher.model, teacher.model, data, teacher.device)
    scores = {}  # name -> [(held-out CE, KL, ms) a seed]
    for offset in range(seeds):
        student_config = dataclasses.replace(config, seed=config.seed + offset)
        teacher_hidden = teacher_hidden_states(student_config, data, teacher)
        for name, entries, k, support in signals(samples):
            with report.phase(f"student seed {student_config.seed}: {name}"):
                k = k or data.vocab
                kd_weight, ce_weight = (0.0, 1.0) if name == CE_ONLY else (config.kd_weight, config.ce_weight)
                student, ms = train_student(student_config, data, teacher, teacher_hidden, entries, k, support,
                                             kd_weight, ce_weight)
                scores.setdefault(name, []).append((*held_out_scores(student, teacher.model, data, teacher.device),
                                                     ms))
    results = []
    for name, entries, k, _ in signals(samples):
        ce, kl, ms = zip(*scores[name])
        results.append(dict(name=name, held_out_ce=statistics.fmean(ce), held_out_ce_sd=_sd(ce),
                            kl_to_teacher=statistics.fmean(kl), kl_to_teacher_sd=_sd(kl), ms=statistics.median(ms),
                            bytes_per_token=bytes_per_token(name, entries, k or data.vocab, data.vocab)))
    floor, full = results[0], next(r for r in results if r["name"] == FULL_KD)
    for row in results:
        for share, field in (("ce_gain_share", "held_out_ce"), ("kl_reduction_share", "kl_to_teacher")):
            gain = floor[field] - full[field]
            row[share] = (floor[field] - row[field]) / gain if gain > 0 else float("nan")
        row["ce_gain_share_per_byte"] = row["ce_gain_share"] / row["bytes_per_token"] if row["bytes_per_token"] else None
    results.append(dict(name=TEACHER, held_out_ce=teacher_ce, held_out_ce_sd=None, kl_to_teacher=0.0,
                        kl_to_teacher_sd=None, ms=None, bytes_per_token=None, ce_gain_share=None,
                        kl_reduction_share=None, ce_gain_share_per_byte=None))
    return results


def interleaved_split(data, every: int = HELD_OUT_EVERY):
    """``data`` with every ``every``-th of all its rows (training then held-out, in corpus order)
    held out and the rest training rows: held-out rows from every document of the corpus rather
    than from its last ones only."""
    held = torch.zeros(data.train_tokens.shape[0] + data.held_tokens.shape[0], dtype=torch.bool)
    held[every - 1::every] = True
    parts = {}
    for field in ("tokens", "labels", "positions", "documents"):
        train, held_out = getattr(data, f"train_{field}"), getattr(data, f"held_{field}")
        if train is not None:
            rows = torch.cat([train, held_out])
            parts.update({f"train_{field}": rows[~held], f"held_{field}": rows[held]})
    return dataclasses.replace(data, **parts)


def _sd(values) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def cache_read_rate(directory: str, encoding: str, kind: str, entries: int, vocab: int = 151_936, rows: int = 256,
                    positions: int = 512, batch_rows: int = 16, device=None) -> dict:
    """Tokens a second that `TeacherCacheReader.micro_batches` delivers (decoded, on ``device``)
    from a cache of ``rows`` synthetic rows of ``positions`` tokens written to ``directory``,
    read in `shuffled_rows` order in batches of ``batch_rows`` rows; the bytes a token."""
    from orchestration.teacher_cache import CacheHeader, TeacherCacheReader, TeacherCacheWriter

    generator = torch.Generator().manual_seed(0)
    fields = ("log_threshold",) if kind == "samples" else ()
    header = CacheHeader(kind=kind, encoding=encoding, vocab_size=vocab, k=entries, temperature=1.0,
                         tokenizer_hash="synthetic", data_hash="synthetic", fields=fields, positions_per_row=positions)
    with TeacherCacheWriter(directory, header) as writer:
        for start in range(0, rows, batch_rows):
            count = min(batch_rows, rows - start) * positions
            logprobs = torch.log_softmax(3 * torch.randn(count, 4 * entries, generator=generator), -1)
            logprobs = logprobs.topk(entries, dim=-1).values
            ids = torch.randint(0, vocab, (count, entries), generator=generator, dtype=torch.int32)
            if kind == "samples":
                signal = kd.TeacherSamples(logprobs, ids, logprobs[:, -1] - 1.0, None, 1.0)
            else:
                signal = kd.TopK(logprobs, ids, None, 1.0)
            writer.add(torch.arange(start, start + min(batch_rows, rows - start)), signal)
    with TeacherCacheReader(directory) as reader:
        order = reader.shuffled_rows(seed=1)
        picks = [order[start:start + batch_rows] for start in range(0, rows, batch_rows)]
        started = time.perf_counter()
        with reader.micro_batches(picks, device=device) as batches:
            for batch in batches:
                batch.logprobs.sum().item()  # the values are on the device
        seconds = time.perf_counter() - started
        bytes_per_token = reader.codec.bytes_per_position
    return dict(tokens_per_s=rows * positions / seconds, bytes_per_token=bytes_per_token, ms=1e3 * seconds)


def student_loss_rate(n: int = 8192, hidden_size: int = 2048, vocab: int = 151_936, k: int = 64) -> float:
    """Tokens a second of the fused student loss alone (forward + backward, bf16, one CUDA device):
    an upper bound on a student's training rate at that vocab."""
    from harness import time_sustained_ms

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = (0.3 * torch.randn(n, hidden_size, device="cuda", generator=generator)).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden_size, device="cuda", generator=generator)).bfloat16().requires_grad_()
    teacher = kd.teacher_topk(hidden.detach(), weight.detach(), k)

    def step():
        kd.topk_divergence(hidden, weight, teacher).backward()

    steady, _ = time_sustained_ms({"loss": step})
    return n / (steady["loss"] / 1e3)


def publish(args, env: dict, rows: list[dict], columns: dict) -> None:
    """The environment line, the rows appended to the results file, and their table."""
    print(f"environment: {env}")
    append_rows(args.results, rows)
    print()
    print_table(rows, columns)


def quality(args) -> None:
    """The --quality part: the teacher signals at equal steps and data (`compare`), under
    `QUALITY_DEFAULTS` unless ``--set`` says otherwise."""
    base = load_config(None, QUALITY_DEFAULTS + args.set)
    env = environment(args.commit)
    shape = dict(name="signal quality", device=base.device, steps=base.steps, seed=base.seed, seeds=args.seeds,
                 tokens_per_step=base.row_tokens * base.rows_per_micro_batch * base.micro_batches,
                 vocab=base.tokenizer_vocab, samples=args.samples, temperature=base.temperature,
                 kd_weight=base.kd_weight, ce_weight=base.ce_weight, lr=base.lr,
                 teacher_pretrain_steps=base.teacher_pretrain_steps)
    measured = compare(base, args.samples, args.seeds, progress=True)
    rows = [result_row(env, "bench_e2e_quality", shape, m.pop("name"), "equal steps", m.pop("ms"), CE_ONLY,
                       m["ce_gain_share"], None, **m) for m in measured]
    publish(args, env, rows, {"signal": "provider", "B/token": "bytes_per_token", "held-out CE": "held_out_ce",
                              "± sd": "held_out_ce_sd", "KL to teacher": "kl_to_teacher", "± sd ": "kl_to_teacher_sd",
                              "share of CE gain": "ce_gain_share", "share of KL reduction": "kl_reduction_share",
                              "CE share per byte": "ce_gain_share_per_byte", "ms/step": "ms"})


def cache_read(args) -> None:
    """The --cache-read part: the teacher cache's read rate (tokens/s, decoded) against the fused
    student loss's tokens/s at V = 151,936 (on CUDA; the loss alone bounds a student's rate)."""
    import tempfile

    env = environment(args.commit)
    device = "cuda" if torch.cuda.is_available() else None
    student = student_loss_rate() if device else None
    rows = []
    for encoding, kind, entries in (("lossless", "topk", 64), ("compact", "topk", 64), ("lossless", "samples", 12),
                                    ("compact", "samples", 12)):
        with tempfile.TemporaryDirectory() as directory:
            measured = cache_read_rate(directory, encoding, kind, entries, device=device)
        shape = dict(name="cache read", vocab=151_936, kind=kind, entries=entries, encoding=encoding)
        ratio = measured["tokens_per_s"] / student if student else None
        rows.append(result_row(env, "bench_e2e_cache_read", shape, f"{kind} {entries} {encoding}", "once",
                               measured.pop("ms"), "student loss tokens/s", ratio, None, student_tokens_per_s=student,
                               **measured))
    publish(args, env, rows, {"cache": "provider", "tokens/s": "tokens_per_s", "B/token": "bytes_per_token",
                       "× student": "ratio"})


ONPOLICY_RUNS = {"ce": (FLOOR, ["mode=gkd", "lmbda=0", "kd_weight=0", "ce_weight=1", "sft_alpha=1"]),
                 "off": ("off-policy (lmbda 0)", ["mode=gkd", "lmbda=0"]),
                 "gkd": ("GKD (lmbda 0.5)", ["mode=gkd", "lmbda=0.5"]),
                 "on": ("on-policy (lmbda 1)", ["mode=on_policy"])}
# --onpolicy on a GPU: the driver's GPU default models, fewer steps and shorter responses, a
# teacher pretrained for less and a tokenizer trained on less text (the four runs within one
# device call); every run sees the same options but its mode's
ONPOLICY_GPU = ("steps=60", "max_new_tokens=64", "teacher_pretrain_steps=300", "max_corpus_bytes=4000000",
                "checkpoint_every=0")
ONPOLICY_COLUMNS = {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                    "teacher reverse KL of samples": "teacher_reverse_kl", "its top-k bins": "teacher_reverse_kl_top_k",
                    "teacher held-out CE": "teacher_held_out_ce", "run s": "run_seconds"}


def onpolicy_rows(args, env: dict) -> list[dict]:
    """The on-policy comparison (module docstring): the runs of ``--runs`` at equal steps, in
    that order, each printed and appended to the results as soon as it is done (× CE alone when
    CE alone ran before it). The runs after the first read the tokenizer the first one trained."""
    chosen = [part.strip() for part in args.runs.split(",") if part.strip()]
    if not chosen or any(name not in ONPOLICY_RUNS for name in chosen):
        sys.exit(f"bench_e2e: --runs: expected a comma-separated list of {', '.join(ONPOLICY_RUNS)}, got {args.runs!r}")
    options = list(args.set)
    base = load_config(None, options)
    if device_type(base.device) == "cuda":
        options = [*ONPOLICY_GPU, *options]
        base = load_config(None, options)
    shape = dict(name="driver default, on-policy", device=base.device, steps=base.steps, seed=base.seed, k=base.k,
                 divergence=base.divergence, samples_per_step=base.rows_per_micro_batch * base.micro_batches,
                 max_new_tokens=base.max_new_tokens, vocab=base.tokenizer_vocab,
                 teacher_pretrain_steps=base.teacher_pretrain_steps, options=" ".join(options))
    rows, floor, tokenizer = [], None, []
    for key in chosen:
        name, overrides = ONPOLICY_RUNS[key]
        if key in ("off", "gkd"):  # their dataset steps train as mode=off_policy does
            overrides = [*overrides, f"sft_alpha={base.ce_weight}"]
        config = load_config(None, options + overrides + tokenizer + [f"output_dir={base.output_dir}/onpolicy_{key}",
                                                                      "overwrite=true"])
        started = time.perf_counter()
        summary = run(config, progress=False)
        measured = dict(held_out_ce=summary["student_held_out_ce"], teacher_held_out_ce=summary["teacher_held_out_ce"],
                        teacher_reverse_kl=summary["teacher_reverse_kl"],
                        teacher_reverse_kl_top_k=summary["teacher_reverse_kl_top_k"], mode=config.mode,
                        lmbda={"off_policy": 0.0, "on_policy": 1.0}.get(config.mode, config.lmbda),
                        run_seconds=time.perf_counter() - started)
        if key == "ce":
            floor = measured["held_out_ce"]
        trained = os.path.join(config.output_dir, "tokenizer")
        if not tokenizer and base.tokenizer_path is None and os.path.isdir(trained):
            tokenizer = [f"tokenizer_path={trained}"]  # the same tokenizer: trained once, read by the others
        row = result_row(env, BENCHMARK, shape, name, "equal steps, on-policy", None, FLOOR,
                         None if floor is None else measured["held_out_ce"] / floor, None, **measured)
        publish(args, env, [row], ONPOLICY_COLUMNS)
        sys.stdout.flush()
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a driver option for both runs (python orchestrate.py --help lists them)")
    parser.add_argument("--onpolicy", action="store_true", help="the on-policy comparison instead (see above)")
    parser.add_argument("--runs", default=",".join(ONPOLICY_RUNS),
                        help=f"--onpolicy: which runs, in order (comma): {', '.join(ONPOLICY_RUNS)}")
    add_results_arguments(parser, BENCHMARK)
    signal_quality = parser.add_argument_group("signal quality (--quality: CE only, full-vocab KD, top-k, sampled)")
    signal_quality.add_argument("--quality", action="store_true",
                                help="compare the teacher signals at equal steps and data instead")
    signal_quality.add_argument("--samples", type=int, default=12, help="teacher samples a token of the sampled "
                                "signal")
    signal_quality.add_argument("--seeds", type=int, default=3, help="student seeds a signal (mean and spread)")
    cache = parser.add_argument_group("teacher cache read rate (--cache-read)")
    cache.add_argument("--cache-read", action="store_true", help="time reading a synthetic teacher cache instead")
    args = parser.parse_args()
    if args.cache_read:
        cache_read(args)
        return
    if args.quality:
        quality(args)
        return
    if args.onpolicy:
        env = environment(args.commit)
        rows = onpolicy_rows(args, env)
        print()
        print_table(rows, ONPOLICY_COLUMNS)
        return
    base = load_config(None, args.set)
    env = environment(args.commit)
    shape = dict(name="driver default", device=base.device, steps=base.steps, seed=base.seed, k=base.k,
                 divergence=base.divergence, tokens_per_step=base.row_tokens * base.rows_per_micro_batch
                 * base.micro_batches, vocab=base.tokenizer_vocab)
    measured = {name: measure(name, args.set + weights, base.output_dir) for name, weights in RUNS}
    measured[FLOOR]["teacher_held_out_ce"] = None  # that run's teacher was not trained
    floor = measured[FLOOR]["held_out_ce"]
    rows = [result_row(env, BENCHMARK, shape, name, "equal steps", m.pop("ms"), FLOOR, m["held_out_ce"] / floor,
                       None, **m) for name, m in measured.items()]
    publish(args, env, rows, {"student": "provider", "held-out CE": "held_out_ce", "× CE alone": "ratio",
                       "teacher held-out CE": "teacher_held_out_ce", "train CE first": "train_ce_first",
                       "last": "train_ce_last", "tokens/s": "tokens_per_s"})
    if measured["distilled"]["held_out_ce"] >= floor:
        sys.exit("distillation did not beat CE alone")


if __name__ == "__main__":
    main()
