"""Hugging Face in and out: local checkpoints, final hidden states and output embedding of any
causal LM, the tokenizer check, save_pretrained → from_pretrained, the student's fused loss
and the teacher's top-k over them."""
import pytest
import torch

import kd_kernels as kd
from helpers_hf import LM_HEAD_ROWS, VOCAB, save_checkpoint, tiny_causal_lm, tiny_tokenizer
from orchestration.hf_models import (check_lm_head_covers, check_logits_from_hidden, check_same_vocabulary,
                                     export_causal_lm, final_hidden_states, load_causal_lm, load_tokenizer,
                                     output_embedding, vocab_size)


@pytest.mark.parametrize("family, tie", [("llama", False), ("qwen2", True)])
def test_a_local_checkpoint_gives_hidden_states_and_lm_head_that_make_its_logits(tmp_path, family, tie):
    path = save_checkpoint(tmp_path / family, family, tie=tie)
    model = load_causal_lm(path, attention="eager", argument="student_path")
    assert model.config._attn_implementation == "eager" and next(model.parameters()).dtype == torch.float32
    tokenizer = load_tokenizer(path)
    assert vocab_size(tokenizer) == VOCAB and tokenizer.eos_token == "<eos>"
    weight, bias = output_embedding(model)
    assert weight.shape == (LM_HEAD_ROWS, 32) and bias is None
    assert (weight is model.get_input_embeddings().weight) == tie
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        hidden = final_hidden_states(model, ids)
        logits = model(input_ids=ids).logits
    assert hidden.shape == (2, 7, 32)
    torch.testing.assert_close(hidden @ weight.T, logits, rtol=1e-5, atol=1e-5)
    check_logits_from_hidden(model)
    check_lm_head_covers(model, VOCAB)
    with pytest.raises(ValueError, match="lm_head has 96 rows, fewer than the tokenizer's 100 ids"):
        check_lm_head_covers(model, 100)
    with pytest.raises(FileNotFoundError, match="student_path: expected the directory"):
        load_causal_lm(str(tmp_path / "missing"), argument="student_path")


def test_students_load_float32_master_weights_and_gpu_teachers_bf16_from_a_bf16_checkpoint(tmp_path):
    from orchestration.config import Config
    from orchestration.models import build_model, scoring_dtype

    model = tiny_causal_lm("qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    config = Config(attention="eager")
    student = build_model(str(tmp_path / "bf16"), 32, 2, config, VOCAB, seed=0)
    assert {p.dtype for p in student.parameters()} == {torch.float32}
    teacher = build_model(str(tmp_path / "bf16"), 32, 2, config, VOCAB, seed=0,
                          dtype=scoring_dtype(torch.device("cuda")))
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    assert torch.equal(student.lm_head.weight, model.lm_head.weight.float())
    assert teacher.config._attn_implementation == "eager"
    assert scoring_dtype(torch.device("cpu")) == torch.float32


def test_models_whose_logits_are_transformed_are_refused():
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    model = tiny_causal_lm("llama")
    scaled = Scaled(model.config)
    scaled.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="logits differ from its final hidden states"):
        check_logits_from_hidden(scaled)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="sets final_logit_softcapping=30.0"):
        check_logits_from_hidden(model)


def test_tokenizers_with_other_ids_or_special_tokens_are_refused():
    base = tiny_tokenizer()
    assert check_same_vocabulary(base, tiny_tokenizer()) == VOCAB  # lm_head rows (96) beyond V* = 90 are padding
    with pytest.raises(ValueError, match=r"1 tokens with other ids|2 tokens with other ids"):
        check_same_vocabulary(base, tiny_tokenizer(swap=("w5", "w6")))
    with pytest.raises(ValueError, match=r"1 only in the teacher's \(e.g. \['w89'\]\)"):
        check_same_vocabulary(base, tiny_tokenizer(VOCAB - 1))
    other_eos = tiny_tokenizer(eos="w3")
    with pytest.raises(ValueError, match=r"special tokens differ .*'eos_token': \('<eos>', 'w3'\)"):
        check_same_vocabulary(base, other_eos)
    assert check_same_vocabulary(base, other_eos, check_special_tokens=False) == VOCAB


@pytest.mark.parametrize("family, tie", [("llama", False), ("qwen2", True)])
def test_export_round_trip_gives_equal_logits(tmp_path, family, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_causal_lm(family, tie=tie, seed=3)
    with torch.no_grad():  # trained weights: no longer the initialization's
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    directory = export_causal_lm(model, state, str(tmp_path / "out"), tokenizer=tiny_tokenizer())
    loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert any(path.suffix == ".safetensors" for path in (tmp_path / "out").iterdir())
    assert (tmp_path / "out" / "generation_config.json").exists()
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tie
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(directory).get_vocab() == tiny_tokenizer().get_vocab()

    bf16 = export_causal_lm(model, state, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True, dtype="auto")
    assert all(torch.equal(tensor, state[name].to(torch.bfloat16)) for name, tensor in loaded.state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        export_causal_lm(model, {k: v for k, v in state.items() if "layers.0." not in k}, str(tmp_path / "bad"))


def test_student_loss_and_teacher_topk_equal_the_full_logits_computation():
    from orchestration.distillation import DistillationStudent, score_teacher

    teacher, student = tiny_causal_lm("qwen2", seed=1), tiny_causal_lm("llama", seed=2)
    ids = torch.randint(0, VOCAB, (2, 6))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    top = score_teacher(teacher, ids, k=5, vocab_size=VOCAB, temperature=2.0)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids).logits.reshape(-1, LM_HEAD_ROWS)
    expected_top = kd.teacher_topk_from_logits(teacher_logits.double(), 5, temperature=2.0, vocab_size=VOCAB)
    torch.testing.assert_close(top.logprobs.double(), expected_top.logprobs.double(), rtol=0, atol=1e-5)
    assert torch.equal(top.indices, expected_top.indices)

    module = DistillationStudent(student, vocab_size=VOCAB, temperature=2.0, ce_weight=0.5, divergence="reverse_kl")
    loss, metrics = module(ids, labels, top, num_tokens=12)
    loss.backward()
    head = student.get_output_embeddings().weight
    reference = tiny_causal_lm("llama", seed=2)
    logits = reference(input_ids=ids).logits.reshape(-1, LM_HEAD_ROWS).double()
    expected = kd.topk_divergence_from_logits(logits, top, labels.reshape(-1), temperature=2.0, ce_weight=0.5,
                                              divergence="reverse_kl", num_tokens=12, vocab_size=VOCAB)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.grad, reference.get_output_embeddings().weight.grad, rtol=1e-4, atol=1e-6)
    assert metrics["rows"].item() == 10
    with pytest.raises(TypeError, match=r"unknown \['alpha'\]"):
        DistillationStudent(student, vocab_size=VOCAB, alpha=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpu_teacher_from_a_checkpoint_scores_in_bf16_as_the_single_process_loop(tmp_path):
    """A float32 checkpoint: the teacher worker holds it in bf16 on the GPU and its top-k equals
    the single-process loop's (the model loaded in bf16, kd.teacher_topk on its hidden states)."""
    from transformers import AutoModelForCausalLM

    from orchestration.config import Config
    from orchestration.teacher import TeacherWorker

    path = save_checkpoint(tmp_path / "teacher", "qwen2")
    # eager, as the loop it is compared with (on CUDA "auto" compiles the layers, whose fused bf16
    # kernels round differently)
    config = Config(device="cuda", teacher_path=path, k=8, attention="sdpa", compile="false")
    worker = TeacherWorker(config, VOCAB, "in_process")
    assert {(p.dtype, p.device.type) for p in worker.model.parameters()} == {(torch.bfloat16, "cuda")}
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    got = worker.entries(tokens)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = final_hidden_states(model, tokens).reshape(-1, 32)
        expected = kd.teacher_topk(hidden, output_embedding(model)[0], 8, vocab_size=VOCAB)
    assert torch.equal(got.indices, expected.indices) and torch.equal(got.logprobs, expected.logprobs)
