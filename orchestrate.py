"""Run a small, real distillation end to end with kd_kernels, in one process.

What it does, on whatever device the machine has:
1. builds a byte-level corpus from the Python standard library's source files (every
   machine with Python has them) and splits it into train / held-out text;
2. trains a teacher LM on cross-entropy;
3. trains two identical students for the same steps on the same data: one with
   ``kd.teacher_topk`` + ``kd.topk_divergence`` (top-k forward KL + CE), one on CE alone;
4. prints both held-out CEs and writes per-step metrics to ``<output_dir>/metrics.jsonl``.

The Ray driver (teacher / student workers, zero-copy top-k transfer, checkpoints) is the
orchestration issue's work and is not here yet; this script does not pretend to be it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import time

import torch

import kd_kernels as kd

DEFAULTS = dict(
    steps=150, teacher_steps=300, batch_rows=16, sequence=64, k=16, temperature=1.0, kd_weight=1.0, ce_weight=0.5,
    teacher_width=192, student_width=48, lr=3e-3, seed=0, output_dir="runs/default", device="auto",
)
BYTE_VOCAB = 256
PADDED_VOCAB = 264  # lm_head rows past the 256 bytes exist only as padding (vocab_size=256)


def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Concatenated standard-library sources, a stable order, capped at ``max_bytes``."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as handle:
            data = handle.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteLM(torch.nn.Module):
    """Embedding → 2-layer GRU → lm_head; ``hidden_states`` gives the rows the loss needs."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(BYTE_VOCAB, width)
        self.rnn = torch.nn.GRU(width, width, num_layers=2, batch_first=True)
        self.lm_head = torch.nn.Linear(width, PADDED_VOCAB, bias=False)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, T]`` int64 → ``[B·T, width]`` final hidden states."""
        out, _ = self.rnn(self.embed(tokens))
        return out.reshape(-1, out.shape[-1])


def batches(data: torch.Tensor, rows: int, sequence: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - sequence - 1, (rows,), generator=generator)
        window = torch.stack([data[s:s + sequence + 1] for s in starts.tolist()])
        # row n of the flattened batch predicts token n + 1: the labels are shifted once, here
        yield window[:, :-1], window[:, 1:].reshape(-1)


def held_out_ce(model: ByteLM, data: torch.Tensor, config: dict, device) -> float:
    generator = torch.Generator().manual_seed(1234)
    stream = batches(data, config["batch_rows"], config["sequence"], generator)
    total = 0.0
    with torch.no_grad():
        for _ in range(8):
            tokens, labels = next(stream)
            hidden = model.hidden_states(tokens.to(device))
            teacher = kd.TopK(torch.zeros(hidden.shape[0], 1, device=device),
                              labels.to(device, torch.int32).unsqueeze(-1))  # KD weight 0: only CE counts
            total += kd.topk_divergence(hidden, model.lm_head.weight, teacher, labels.to(device), kd_weight=0.0,
                                        ce_weight=1.0, vocab_size=BYTE_VOCAB).item()
    return total / 8


def train(model: ByteLM, data: torch.Tensor, steps: int, config: dict, device, log, teacher_model=None) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    stream = batches(data, config["batch_rows"], config["sequence"], torch.Generator().manual_seed(config["seed"]))
    for step in range(steps):
        tokens, labels = next(stream)
        tokens, labels = tokens.to(device), labels.to(device)
        start = time.perf_counter()
        if teacher_model is None:
            teacher = kd.TopK(torch.zeros(labels.shape[0], 1, device=device), labels.to(torch.int32).unsqueeze(-1))
            weights = dict(kd_weight=0.0, ce_weight=1.0)
        else:
            with torch.no_grad():
                teacher = kd.teacher_topk(teacher_model.hidden_states(tokens), teacher_model.lm_head.weight,
                                          k=config["k"], temperature=config["temperature"], vocab_size=BYTE_VOCAB)
            weights = dict(kd_weight=config["kd_weight"], ce_weight=config["ce_weight"])
        loss, metrics = kd.topk_divergence(model.hidden_states(tokens), model.lm_head.weight, teacher, labels,
                                           temperature=config["temperature"], vocab_size=BYTE_VOCAB,
                                           return_metrics=True, **weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        rows = metrics["rows"].item()
        log(dict(step=step, loss=loss.item(), kd=metrics["kd_sum"].item() / rows, ce=metrics["ce_sum"].item() / rows,
                 teacher_mass=metrics["teacher_mass_sum"].item() / rows,
                 tokens_per_s=rows / (time.perf_counter() - start)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value, help=f"default: {value}")
    config = vars(parser.parse_args(argv))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config["device"] == "auto" else config["device"])
    torch.manual_seed(config["seed"])
    corpus = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8).long()
    split = int(corpus.numel() * 0.9)
    train_data, held_out = corpus[:split], corpus[split:]
    os.makedirs(config["output_dir"], exist_ok=True)
    metrics_path = os.path.join(config["output_dir"], "metrics.jsonl")
    print(f"kd_kernels {kd.__version__}: {corpus.numel():,} bytes of stdlib source, device {device}")
    print(f"backends: {kd.available_backends()}")

    with open(metrics_path, "w") as metrics_file:
        def logger(phase):
            def log(record):
                metrics_file.write(json.dumps(dict(phase=phase, **record)) + "\n")
                if record["step"] % 50 == 0:
                    print(f"  {phase:>9} step {record['step']:4d}  loss {record['loss']:.4f}  ce {record['ce']:.4f}")
            return log

        teacher = ByteLM(config["teacher_width"]).to(device)
        train(teacher, train_data, config["teacher_steps"], config, device, logger("teacher"))
        teacher.eval()
        results = {"teacher": held_out_ce(teacher, held_out, config, device)}
        for phase, teacher_model in (("distilled", teacher), ("ce_only", None)):
            torch.manual_seed(config["seed"] + 1)  # identical student initialization for both runs
            student = ByteLM(config["student_width"]).to(device)
            train(student, train_data, config["steps"], config, device, logger(phase), teacher_model)
            results[phase] = held_out_ce(student, held_out, config, device)

    print(f"held-out CE (nats/byte): teacher {results['teacher']:.4f}, "
          f"student distilled {results['distilled']:.4f}, student CE-only {results['ce_only']:.4f}")
    print(f"metrics: {metrics_path}")
    with open(os.path.join(config["output_dir"], "summary.json"), "w") as handle:
        json.dump(dict(config=config, held_out_ce=results), handle, indent=2)
    return results


if __name__ == "__main__":
    main()
