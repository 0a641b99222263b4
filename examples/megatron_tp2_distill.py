"""Distill a Megatron-core GPTModel student from a GPTModel teacher, both tensor-parallel
(TP = 2), with the fused top-k KD loss on their vocab-parallel output layers.

    torchrun --nproc_per_node 2 examples/megatron_tp2_distill.py [--steps 30]

Data: byte-level text of the Python standard library (every machine has it). Prints the
loss every few steps and fails if it did not decrease.
"""
import argparse
import glob
import os
import sys
import sysconfig

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too
from kd_kernels.integrations import megatron as integration  # noqa: E402

VOCAB = 256  # bytes; divisible by the TP size, so no padded rows


def byte_batches(batch, sequence, seed):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    data = torch.frombuffer(bytearray(b"".join(open(f, "rb").read() for f in files)), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - sequence - 1, (batch,), generator=generator)
        window = torch.stack([data[s:s + sequence + 1] for s in starts.tolist()]).cuda()
        yield window[:, :-1], window[:, 1:]  # labels shifted once: position s predicts token s + 1


def gpt(layers, hidden, heads, sequence):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=sequence, share_embeddings_and_output_weights=False).cuda()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=128)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    teacher = gpt(4, 256, 8, args.sequence).eval()
    student = gpt(2, 128, 4, args.sequence)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    position_ids = torch.arange(args.sequence, device="cuda").unsqueeze(0).expand(args.batch, -1)
    mask = torch.ones(1, 1, args.sequence, args.sequence, dtype=torch.bool, device="cuda").triu(1)  # True: masked
    losses = []
    for step, (tokens, labels) in zip(range(args.steps), byte_batches(args.batch, args.sequence, seed=0)):
        top = integration.teacher_topk(teacher, tokens, position_ids, mask, k=32, temperature=1.0)
        loss = integration.topk_divergence(student, tokens, position_ids, mask, top, labels, ce_weight=0.5)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(f"mean loss of the first 5 steps {first:.4f}, of the last 5 {last:.4f}")
        assert last < first, "the KD loss did not decrease"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
