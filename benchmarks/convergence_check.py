"""A tiny student trained 200 steps with the Triton loss and with the float64 reference loss:
same data, same initialization; the loss curves must agree within noise.

usage: python benchmarks/convergence_check.py [--temperature T]
(JSD(0.5), tail mode, CE 0.5; T = 2 takes the two-pass gradient, T = 1 the one-read form)"""
import argparse
import glob
import os
import sys
import sysconfig

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kd_kernels as kd  # noqa: E402

BYTE_VOCAB = 256
PADDED_VOCAB = 264  # lm_head rows past the 256 bytes exist only as padding (vocab_size=256)


def stdlib_corpus(max_bytes: int) -> bytes:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return b"".join(open(path, "rb").read() for path in files)[:max_bytes]


class ByteLM(torch.nn.Module):
    """Embedding → 2-layer GRU → lm_head over bytes."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(BYTE_VOCAB, width)
        self.rnn = torch.nn.GRU(width, width, num_layers=2, batch_first=True)
        self.lm_head = torch.nn.Linear(width, PADDED_VOCAB, bias=False)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return out.reshape(-1, out.shape[-1])


def batches(data: torch.Tensor, rows: int, sequence: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - sequence - 1, (rows,), generator=generator)
        window = torch.stack([data[s:s + sequence + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:].reshape(-1)


def run(backend, teacher, data, temperature, steps=200):
    torch.manual_seed(1)
    student = ByteLM(96).cuda()
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    stream = batches(data, 32, 128, torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        tokens, labels = next(stream)
        tokens, labels = tokens.cuda(), labels.cuda()
        with torch.no_grad():
            top = kd.teacher_topk(teacher.hidden_states(tokens), teacher.lm_head.weight, k=32,
                                  temperature=temperature, vocab_size=BYTE_VOCAB)
        loss = kd.topk_divergence(student.hidden_states(tokens), student.lm_head.weight, top, labels,
                                  divergence="jsd", support="tail", temperature=temperature, ce_weight=0.5,
                                  vocab_size=BYTE_VOCAB, backend=backend)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperature", type=float, default=2.0)
    args = parser.parse_args()
    data = torch.frombuffer(bytearray(stdlib_corpus(1_000_000)), dtype=torch.uint8).long()
    torch.manual_seed(0)
    teacher = ByteLM(256).cuda()
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    stream = batches(data, 32, 128, torch.Generator().manual_seed(5))
    for _ in range(300):
        tokens, labels = next(stream)
        logits = teacher.lm_head(teacher.hidden_states(tokens.cuda()))[:, :BYTE_VOCAB]
        loss = torch.nn.functional.cross_entropy(logits, labels.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    teacher.eval()
    ours, reference = (run(backend, teacher, data, args.temperature) for backend in ("triton", "torch"))
    print(f"temperature {args.temperature}")
    window = 20
    print("step | triton loss | reference loss (means over 20 steps)")
    worst = 0.0
    for start in range(0, len(ours), window):
        a = sum(ours[start:start + window]) / window
        b = sum(reference[start:start + window]) / window
        worst = max(worst, abs(a - b) / b)
        print(f"{start:4d} | {a:.5f} | {b:.5f}")
    print(f"largest relative gap of windowed means: {worst:.2e}; first {ours[0]:.4f} vs {reference[0]:.4f}, "
          f"last {ours[-1]:.4f} vs {reference[-1]:.4f}")
    assert worst < 0.02, "loss curves diverge"


if __name__ == "__main__":
    main()
