"""Which teacher signal recovers the most of full-vocab KD's gain per byte: one teacher (built and
pretrained as the driver's), one student trained from the same initialization on the same steps
and rows for each signal, in one process (no Ray), scored on the held-out rows.

Signals: CE only (the floor: kd_weight 0, ce_weight 1), full-vocab KD (the reference: the top-k
with k = V under support "tail", whose bins are the whole vocab), top-k (k = 8, 64)
renormalized and with the tail bin, and sampled (n Gumbel-top-n samples a token, fresh each
step, support "sampled"). Each row reports held-out CE, the held-out full-vocab KL(teacher ‖
student) at temperature 1, the bytes a token of its signal in the cache's lossless encoding, the
fraction of full KD's CE gain over CE only it recovers and that fraction per byte.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import kd_kernels as kd
from orchestration.cache_codec import Codec
from orchestration.data import IGNORE_INDEX, prepare_data
from orchestration.models import autocast, build_model, final_hidden_states, lm_head_inputs, pick_device
from orchestration.progress import Progress
from orchestration.sampler import StepSampler
from orchestration.student import lr_factor
from orchestration.teacher import TeacherWorker

CE_ONLY = "CE only"
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
def _teacher_entries(teacher, tokens, entries: str, k: int, vocab: int, temperature: float, seed: int):
    with autocast(teacher.device):
        hidden = final_hidden_states(teacher.model, tokens)
    inputs = lm_head_inputs(teacher.model, hidden)
    if entries == "samples":
        return kd.teacher_sample(*inputs, k, seed=seed, temperature=temperature, vocab_size=vocab)
    return kd.teacher_topk(*inputs, k=k, temperature=temperature, vocab_size=vocab)


def train_student(config, data, teacher, entries: str, k: int, support: str, kd_weight: float, ce_weight: float):
    """The student after ``config.steps`` AdamW steps (the driver's schedule, clip and rows) on
    ``kd_weight · KD + ce_weight · CE`` with the teacher signal (entries, k, support); its
    median ms a step."""
    device, vocab = teacher.device, data.vocab
    student = build_model(None, config.student_hidden, config.student_layers, config, vocab, config.seed + 1).to(device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.warmup_steps, config.steps))
    sampler = StepSampler(config.seed, data.train_tokens.shape[0], config.micro_batches, config.rows_per_micro_batch)
    seconds = []
    for step in range(config.steps):
        started = time.perf_counter()
        pick = torch.cat(sampler.picks(step))
        tokens, labels = data.train_tokens[pick].to(device), data.train_labels[pick].to(device).reshape(-1)
        teacher_signal = _teacher_entries(teacher, tokens, entries, k, vocab, config.temperature,
                                          seed=config.seed * 1_000_003 + step)
        student.train()
        with autocast(device):
            hidden = final_hidden_states(student, tokens)
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


def compare(config, samples: int = 12, progress: bool = False) -> list[dict]:
    """One dict a signal: name, held_out_ce, kl_to_teacher, bytes_per_token, gain_recovered
    (the fraction of full KD's held-out CE gain over CE only), recovered_per_byte, ms a step."""
    report = Progress(progress)
    data = prepare_data(config, report)
    teacher = TeacherWorker(config, data.vocab)
    teacher.set_rows(data.train_tokens, data.train_labels)
    if not config.teacher_path and config.teacher_pretrain_steps:
        teacher.pretrain(config.teacher_pretrain_steps)
    teacher.finish_pretraining()
    teacher.model.to(pick_device(config))
    results = []
    for name, entries, k, support in signals(samples):
        k = k or data.vocab
        kd_weight, ce_weight = (0.0, 1.0) if name == CE_ONLY else (config.kd_weight, config.ce_weight)
        student, ms = train_student(config, data, teacher, entries, k, support, kd_weight, ce_weight)
        ce, kl = held_out_scores(student, teacher.model, data, teacher.device)
        results.append(dict(name=name, held_out_ce=ce, kl_to_teacher=kl, ms=ms,
                            bytes_per_token=bytes_per_token(name, entries, k, data.vocab)))
    floor = results[0]["held_out_ce"]
    gain = floor - next(r["held_out_ce"] for r in results if r["name"] == FULL_KD)
    for row in results:
        row["gain_recovered"] = (floor - row["held_out_ce"]) / gain if gain > 0 else float("nan")
        row["recovered_per_byte"] = row["gain_recovered"] / row["bytes_per_token"] if row["bytes_per_token"] else None
    return results


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
