"""The student across workers (CPU, gloo): FSDP2 shards and plain replicas train like one process
on the same global batch; bf16 mixed precision keeps float32 master weights; activation
checkpointing recomputes the layers; a sharded checkpoint resumes exactly (on 2 ranks, and on
1); the gathered state dict exports a Hugging Face checkpoint."""
import os

import pytest
import torch

import kd_kernels as kd
from helpers import cpu_ranks
from helpers_hf import LM_HEAD_ROWS, VOCAB, tiny_causal_lm
from orchestration.distillation import DistillationStudent
from orchestration.fsdp import (build_optimizer, clip_gradients, full_model_state_dict, load_checkpoint,
                                parallelize_student, parameter_groups, save_checkpoint, synchronize_gradients)
from orchestration.metrics import held_out_losses
from orchestration.packing import PackedBatch

WORLD, STEPS, ROWS, TOKENS, K = 2, 4, 4, 12, 8
LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 0.1
# name: (family, tied embeddings, strategy, activation checkpointing, compute dtype)
SCENARIOS = {
    "fsdp_llama": ("llama", False, "fsdp", False, None),
    "fsdp_qwen2_tied_checkpointed": ("qwen2", True, "fsdp", True, None),
    "replicate_llama": ("llama", False, "replicate", False, None),
    "fsdp_llama_bf16": ("llama", False, "fsdp", False, torch.bfloat16),
}


def _student(family, tie, strategy=None, checkpointing=False, compute_dtype=None, seed=0):
    student = DistillationStudent(tiny_causal_lm(family, tie=tie, seed=seed), vocab_size=VOCAB, ce_weight=0.5,
                                  temperature=1.5)
    if strategy is not None:
        student = parallelize_student(student, strategy=strategy, compute_dtype=compute_dtype,
                                      activation_checkpointing=checkpointing)
    return student, build_optimizer(student, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS)


def _global_batch(step):
    """The step's rows ``[ROWS, TOKENS]``, shifted labels (a few ignored) and teacher top-k."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, TOKENS), generator=generator)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, :3] = -100
    logits = 3 * torch.randn(ROWS * TOKENS, VOCAB, generator=generator)
    return ids, labels, kd.teacher_topk_from_logits(logits, K, temperature=1.5)


def _rows(top, rows):
    return kd.TopK(top.logprobs[rows], top.indices[rows], top.lse[rows], top.temperature)


def _train(student, optimizer, steps, rank=0, world=1):
    """Each step: this rank's share of the global batch in two micro-batches; returns
    ``[(global loss, gradient norm)]`` a step."""
    import torch.distributed as dist

    history = []
    per_rank = ROWS // world
    for step in steps:
        ids, labels, top = _global_batch(step)
        num_tokens = int((labels != -100).sum())
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for half in range(2):
            rows = slice(rank * per_rank + half * per_rank // 2, rank * per_rank + (half + 1) * per_rank // 2)
            tokens = slice(rows.start * TOKENS, rows.stop * TOKENS)
            loss, _ = student(ids[rows], labels[rows], _rows(top, tokens), num_tokens=num_tokens)
            loss.backward()
            total += loss.detach().double()
        synchronize_gradients(student)
        norm = clip_gradients(student, 1.0)
        optimizer.step()
        if world > 1:
            dist.all_reduce(total)
        history.append((total.item(), norm.item()))
    return history


def _count_layer_calls(student):
    """Counts the forwards of the layers' MLPs: inside the checkpointed region, so a recomputation
    counts again (the layers' own hooks, FSDP2's among them, stay outside it)."""
    from orchestration.fsdp import decoder_layers

    calls = [0]
    for layer in decoder_layers(student.causal_lm):
        layer.mlp.register_forward_pre_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def _worker(rank, world, init_file, directory):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, (family, tie, strategy, checkpointing, compute_dtype) in SCENARIOS.items():
        student, optimizer = _student(family, tie, strategy, checkpointing, compute_dtype)
        calls = _count_layer_calls(student)
        history = _train(student, optimizer, range(STEPS), rank, world)
        head = student.causal_lm.get_output_embeddings().weight
        if strategy == "fsdp":  # parameters and AdamW state are float32 shards
            assert isinstance(head, DTensor) and head.to_local().shape == (LM_HEAD_ROWS // world, 32)
            assert head.dtype == torch.float32
            state = optimizer.state[head]["exp_avg"]
            assert isinstance(state, DTensor) and state.to_local().shape == (LM_HEAD_ROWS // world, 32)
        results[name] = dict(history=history, layer_calls=calls[0], state=full_model_state_dict(student))
        if name == "fsdp_llama":  # held-out sums over the ranks' rows; the root is resharded after it
            ids, labels, top = _global_batch(STEPS)
            share = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
            batch = PackedBatch(ids[share], labels[share], None, None)
            tokens = slice(share.start * TOKENS, share.stop * TOKENS)
            results["held_out"] = held_out_losses(student, [batch], [_rows(top, tokens)], group=dist.group.WORLD)
            assert isinstance(student.causal_lm.get_output_embeddings().weight, DTensor)

    student, optimizer = _student("llama", False, "fsdp")
    _train(student, optimizer, range(2), rank, world)
    save_checkpoint(os.path.join(directory, "dcp"), student, optimizer, extra={"step": 2, "data": (0, 8)})
    continued = _train(student, optimizer, range(2, STEPS), rank, world)
    fresh, fresh_optimizer = _student("llama", False, "fsdp", seed=7)  # other weights: the load replaces them
    extra = load_checkpoint(os.path.join(directory, "dcp"), fresh, fresh_optimizer)
    assert extra == {"step": 2, "data": (0, 8)}
    resumed = _train(fresh, fresh_optimizer, range(2, STEPS), rank, world)
    results["resume"] = dict(continued=continued, continued_state=full_model_state_dict(student),
                             resumed=resumed, resumed_state=full_model_state_dict(fresh))
    if rank == 0:
        from orchestration.hf_models import export_causal_lm

        export_causal_lm(student.causal_lm, results["resume"]["continued_state"], os.path.join(directory, "export"))
        torch.save(results, os.path.join(directory, "results.pt"))
    else:
        assert results["fsdp_llama"]["state"] == {}  # gathered on rank 0 only
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp"))
    for family in ("llama", "qwen2"):  # their modules imported once, here, not in each forked rank
        tiny_causal_lm(family)
    cpu_ranks(_worker, WORLD, directory)
    return directory, torch.load(os.path.join(directory, "results.pt"), weights_only=False)


def _reference(family, tie, steps=range(STEPS)):
    student, optimizer = _student(family, tie)
    return student, optimizer, _train(student, optimizer, steps)


def _close_states(got, expected, atol):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


# AdamW divides by sqrt(v): a gradient entry near 0 whose float32 rounding differs between the
# sharded and the single sum moves by up to ~lr / 1000 after a few steps; everything else agrees
# to ~1e-7
PARAMETER_ATOL = 3e-5


@pytest.mark.parametrize("name", ["fsdp_llama", "fsdp_qwen2_tied_checkpointed", "replicate_llama"])
def test_two_workers_train_like_one_on_the_same_global_batch(distributed, name):
    family, tie, _, checkpointing, _ = SCENARIOS[name]
    result = distributed[1][name]
    student, _, history = _reference(family, tie)
    for (loss, norm), (expected_loss, expected_norm) in zip(result["history"], history):
        assert loss == pytest.approx(expected_loss, rel=1e-5) and norm == pytest.approx(expected_norm, rel=1e-5)
    _close_states(result["state"], student.causal_lm.state_dict(), PARAMETER_ATOL)
    layer_calls = 2 * STEPS * 2  # 2 layers, 2 micro-batches a step
    assert result["layer_calls"] == (2 * layer_calls if checkpointing else layer_calls)  # recomputed in backward


def test_held_out_losses_sum_over_the_ranks(distributed):
    student, _, _ = _reference("llama", False)
    ids, labels, top = _global_batch(STEPS)
    expected = held_out_losses(student, [PackedBatch(ids, labels, None, None)], [top])
    result = distributed[1]["held_out"]
    assert result["held_out_tokens"] == expected["held_out_tokens"] == int((labels != -100).sum())
    for key in ("held_out_ce", "held_out_kd"):
        assert result[key] == pytest.approx(expected[key], rel=1e-4)


def test_bf16_mixed_precision_keeps_float32_master_weights_close_to_float32_training(distributed):
    result = distributed[1]["fsdp_llama_bf16"]
    _, _, history = _reference("llama", False)
    assert all(tensor.dtype == torch.float32 for tensor in result["state"].values())
    for (loss, _), (expected_loss, _) in zip(result["history"], history):
        assert loss == pytest.approx(expected_loss, rel=2e-2)
    assert result["history"][0][0] != history[0][0]  # bf16 compute, not float32


def test_a_sharded_checkpoint_resumes_exactly_on_two_ranks_and_on_one(distributed):
    directory, results = distributed
    resume = results["resume"]
    assert resume["resumed"] == resume["continued"]
    _close_states(resume["resumed_state"], resume["continued_state"], atol=0)
    # the 2-rank checkpoint onto a single process (no process group), then the same steps
    student, optimizer = _student("llama", False, seed=7)
    assert load_checkpoint(os.path.join(directory, "dcp"), student, optimizer) == {"step": 2, "data": (0, 8)}
    history = _train(student, optimizer, range(2, STEPS))
    for (loss, norm), (expected_loss, expected_norm) in zip(history, resume["continued"]):
        assert loss == pytest.approx(expected_loss, rel=1e-5) and norm == pytest.approx(expected_norm, rel=1e-5)
    _close_states(student.causal_lm.state_dict(), resume["continued_state"], PARAMETER_ATOL)


def test_the_gathered_state_exports_a_loadable_checkpoint(distributed):
    from transformers import AutoModelForCausalLM

    directory, results = distributed
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(directory, "export"), local_files_only=True)
    _close_states(exported.state_dict(), results["resume"]["continued_state"], atol=0)


def test_parameter_groups_exempt_norms_and_biases_from_weight_decay():
    model = tiny_causal_lm("qwen2", tie=True)  # q/k/v biases, tied embeddings
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    exempt = sorted(names[id(p)] for p in no_decay["params"])
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(name.endswith("bias") or "norm" in name for name in exempt) and "model.norm.weight" in exempt
    assert "model.layers.0.self_attn.q_proj.bias" in exempt and "model.embed_tokens.weight" in decayed
    assert len(decayed) + len(exempt) == len(list(model.parameters()))  # the tied lm_head counted once
    with pytest.raises(ValueError, match="betas"):
        build_optimizer(model, lr=1e-3, betas=(0.9, 1.0))


def test_bad_strategies_are_refused():
    student = DistillationStudent(tiny_causal_lm("llama"), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="strategy: expected one of \\('fsdp', 'replicate'\\), got 'ddp'"):
        parallelize_student(student, strategy="ddp")
    with pytest.raises(RuntimeError, match="join a process group first"):
        parallelize_student(student, strategy="fsdp")
    with pytest.raises(ValueError, match="compute_dtype"):
        parallelize_student(student, strategy="replicate", compute_dtype=torch.int8)


# ---- GPU: NCCL, bf16 mixed precision, the fused Triton loss ------------------------------------

def _gpu_worker(rank, world, init_file):
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    vocab, rows, tokens = 32_000, 4 * world, 256
    config = LlamaConfig(vocab_size=32_064, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         attn_implementation="sdpa")

    def built(strategy):
        torch.manual_seed(0)
        student = DistillationStudent(LlamaForCausalLM(config).cuda(), vocab_size=vocab, ce_weight=0.5,
                                      compute_dtype=torch.bfloat16)
        if strategy:
            student = parallelize_student(student, strategy=strategy, compute_dtype=torch.bfloat16,
                                          activation_checkpointing=True)
        return student, build_optimizer(student, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))

    def batch(step):
        generator = torch.Generator(device="cuda").manual_seed(step)
        ids = torch.randint(0, vocab, (rows, tokens), device="cuda", generator=generator)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        logits = 4 * torch.randn(rows * tokens, vocab, device="cuda", generator=generator)
        return ids, labels, kd.teacher_topk_from_logits(logits, 64)

    def train(student, optimizer, share, world_size, sharded):
        losses = []
        for step in range(3):
            ids, labels, top = batch(step)
            picked = slice(share * rows // world_size, (share + 1) * rows // world_size)
            token_rows = slice(picked.start * tokens, picked.stop * tokens)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not sharded):  # FSDP2 casts by itself
                loss, _ = student(ids[picked], labels[picked], _rows(top, token_rows),
                                  num_tokens=int((labels != -100).sum()))
            loss.backward()
            clip_gradients(student, 1.0)
            optimizer.step()
            total = loss.detach().double()
            if world_size > 1:
                dist.all_reduce(total)
            losses.append(total.item())
        return losses

    student, optimizer = built("fsdp")
    assert all(p.dtype == torch.float32 for p in student.parameters()) and optimizer.defaults["fused"]
    sharded = train(student, optimizer, rank, world, sharded=True)
    if rank == 0:  # one process, the whole batch, autocast bf16 instead of FSDP's mixed precision
        whole = train(*built(None), 0, 1, sharded=False)
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(sharded, whole)), (sharded, whole)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpu
def test_fsdp_bf16_with_the_fused_loss_trains_like_one_gpu():
    from helpers import spawn_ranks

    spawn_ranks(_gpu_worker, min(2, torch.cuda.device_count()))
