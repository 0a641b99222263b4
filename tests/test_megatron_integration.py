"""Megatron-core integration on CPU with gloo, TP = 2: a GPTModel built on CPU, our loss
on its vocab-parallel output layer against the unsharded float64 reference.

Megatron's GPTModel forward needs CUDA (its attention allocates on the current CUDA
device), so the decoder's hidden states are stood in for by random ones here; the GPU
example `examples/megatron_tp2_distill.py` runs the whole model.
"""
import pytest
import torch
import torch.distributed as dist

megatron = pytest.importorskip("megatron.core")

from helpers import cpu_ranks, relative_error  # noqa: E402

WORLD, VOCAB, PADDED, HIDDEN, ROWS = 2, 100, 102, 16, 11


def _gpt(seed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=PADDED,
                    max_sequence_length=16, share_embeddings_and_output_weights=False)


def _gathered(weight):
    parts = [torch.empty_like(weight) for _ in range(WORLD)]
    dist.all_gather(parts, weight.detach().contiguous())
    return torch.cat(parts)


def _worker(rank, world, init_file):
    torch.set_num_threads(1)  # a forked rank (`cpu_ranks`)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state

        import kd_kernels as kd
        from kd_kernels.integrations import megatron as integration

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
        student, teacher_model = _gpt(0), _gpt(1)
        assert integration.check_vocab_layout(student) == (rank * PADDED // 2, (rank + 1) * PADDED // 2)
        generator = torch.Generator().manual_seed(7)  # the same hidden states on both ranks
        student_hidden = torch.randn(ROWS, HIDDEN, generator=generator, requires_grad=True)
        teacher_hidden = 3 * torch.randn(ROWS, HIDDEN, generator=generator)
        labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
        group = integration.tensor_parallel_group()
        teacher_weight = integration.output_layer_weight(teacher_model).detach()
        teacher = kd.teacher_topk(teacher_hidden, teacher_weight, k=8, temperature=2.0, vocab_size=VOCAB, group=group)
        expected_teacher = kd.reference.teacher_topk(teacher_hidden, _gathered(teacher_weight), 8, 2.0, VOCAB)
        assert torch.equal(teacher.indices, expected_teacher.indices.to(torch.int32))

        weight = integration.output_layer_weight(student)
        options = dict(divergence="jsd", support="tail", temperature=2.0, ce_weight=0.5, vocab_size=VOCAB)
        loss = kd.topk_divergence(student_hidden, weight, teacher, labels, group=group, **options)
        loss.backward()
        full_weight = _gathered(weight).double().requires_grad_()
        hidden64 = student_hidden.detach().double().requires_grad_()
        expected = kd.topk_divergence(hidden64, full_weight, teacher, labels, backend="torch", **options)
        expected.backward()
        local = PADDED // 2
        assert relative_error(loss, expected) <= 1e-6
        assert relative_error(student_hidden.grad, hidden64.grad) <= 1e-6
        assert relative_error(weight.grad, full_weight.grad[rank * local:(rank + 1) * local]) <= 1e-6

        student.config.sequence_parallel = True
        with pytest.raises(ValueError, match="sequence_parallel"):
            integration.check_vocab_layout(student)
    finally:
        dist.destroy_process_group()


def test_megatron_output_layer_tp2_matches_reference():
    cpu_ranks(_worker, WORLD)
