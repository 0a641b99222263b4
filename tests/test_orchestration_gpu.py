"""The Ray driver on GPUs: top-k through CUDA IPC (teacher and student sharing one GPU) and
through NCCL (two GPUs) give the same training as the object store, and the fused placement
(both in one process) as colocated; the teacher can be offloaded between its calls. Runs on
the GPU machine (skipped without CUDA or Ray)."""
import json

import pytest
import torch

from helpers import HAS_CUDA
from orchestration.config import Config

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ray_cluster():
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    if ray.is_initialized():  # conftest.py's CPU-sized one, left by another module's test
        ray.shutdown()
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def _small(tmp_path, name, **overrides):
    values = dict(output_dir=str(tmp_path / name), device="cuda", max_corpus_bytes=200_000, tokenizer_vocab=1000,
                  row_tokens=128, rows_per_micro_batch=8, micro_batches=2, teacher_hidden=128, teacher_layers=2,
                  teacher_pretrain_steps=20, student_hidden=64, student_layers=2, heads=4, steps=8, k=16,
                  warmup_steps=2, checkpoint_every=0, attention="eager", compile="false")
    values.update(overrides)
    return Config(**values)


def _losses(summary):
    with open(summary["metrics"]) as handle:
        return torch.tensor([json.loads(line)["loss"] for line in handle], dtype=torch.float64)


def _same_training(reference, other):
    """Identical teacher top-k in, so the same student out (up to GPU reduction order; eager
    attention: sdpa's backward on the GPU may accumulate with atomics, and 20 AdamW steps of the
    teacher then 8 of the student can grow that noise past the tolerance: at `b32a1d2` the
    offload test failed once after the student tests in the same process and passed alone)."""
    assert torch.allclose(_losses(other), _losses(reference), rtol=1e-4, atol=1e-5)
    expected = reference["student_parameters"][0]
    got = other["student_parameters"][0]
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4


def test_colocated_cuda_ipc_equals_the_object_store(ray_cluster, tmp_path):
    from orchestration.driver import run

    by_store = run(_small(tmp_path, "store", placement="colocated", transfer="object_store"), progress=False,
                   return_parameters=True)
    by_ipc = run(_small(tmp_path, "ipc", placement="colocated", transfer="cuda_ipc"), progress=False,
                 return_parameters=True)
    assert (by_ipc["placement"], by_ipc["transfer"]) == ("colocated", "cuda_ipc")
    _same_training(by_store, by_ipc)


def test_colocated_teacher_offload_trains_the_same(ray_cluster, tmp_path):
    from orchestration.driver import run

    plain = run(_small(tmp_path, "plain", placement="colocated"), progress=False, return_parameters=True)
    offloaded = run(_small(tmp_path, "offload", placement="colocated", teacher_offload=True), progress=False,
                    return_parameters=True)
    assert offloaded["transfer"] == "cuda_ipc"
    _same_training(plain, offloaded)


@pytest.mark.parametrize("strategy", ["replica", "fsdp2"])
def test_fused_trains_like_colocated_in_one_process_per_gpu(ray_cluster, tmp_path, strategy):
    from orchestration.driver import run

    colocated = run(_small(tmp_path, f"pair_{strategy}", placement="colocated", student_strategy=strategy),
                    progress=False, return_parameters=True)
    fused = run(_small(tmp_path, f"fused_{strategy}", placement="fused", student_strategy=strategy), progress=False,
                return_parameters=True)
    assert (fused["placement"], fused["transfer"]) == ("fused", "in_process")
    with open(tmp_path / f"fused_{strategy}" / "workers.json") as handle:
        workers = json.load(handle)
    assert workers["teacher-0"]["pid"] == workers["student-0"]["pid"]
    _same_training(colocated, fused)


def test_disaggregated_nccl_equals_the_object_store(ray_cluster, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from orchestration.driver import run

    by_store = run(_small(tmp_path, "store2", placement="disaggregated", transfer="object_store"), progress=False,
                   return_parameters=True)
    by_nccl = run(_small(tmp_path, "nccl", placement="disaggregated"), progress=False, return_parameters=True)
    assert (by_nccl["placement"], by_nccl["transfer"]) == ("disaggregated", "nccl")
    _same_training(by_store, by_nccl)


def test_a_colocated_gkd_run_syncs_the_rollout_worker_by_cuda_ipc(ray_cluster, tmp_path):
    """mode=gkd on one GPU: the rollout worker shares the student's GPU, so student-0 pushes into
    its buffer mapped by CUDA IPC; every on-policy step's samples come from the weights of that
    step (max_staleness 0) and each sync writes the whole model into the bf16 rollout copy."""
    from orchestration.driver import run

    summary = run(_small(tmp_path, "gkd", placement="colocated", mode="gkd", lmbda=0.5, max_new_tokens=16,
                         max_prompt_tokens=100), progress=False)
    assert summary["weight_sync"] == "cuda_ipc" and summary["weight_version"] == 8
    with open(summary["metrics"]) as handle:
        rows = [json.loads(line) for line in handle]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    on_policy = [row for row in rows if row["on_policy"]]
    assert on_policy and all(row["weight_version"] == row["step"] for row in on_policy)
    synced = [row for row in rows if "sync_bytes" in row]
    assert synced and len({row["sync_bytes"] for row in synced}) == 1 and synced[0]["sync_gb_per_s"] > 0
    assert all(row["sync_buckets"] == 1 and "sync_lock_wait_seconds" in row for row in synced)
    assert summary["teacher_reverse_kl"] >= 0


def test_flex_attention_trains_packed_documents_like_sdpa(ray_cluster, tmp_path):
    """Pre-tokenized documents packed into rows of 256 (two flex tiles, several documents a row,
    some split across rows): the colocated driver with attention=flex_attention (block masks,
    compiled flex_attention in both workers) trains like sdpa with the dense mask, up to bf16."""
    import numpy as np

    from orchestration.driver import run
    from orchestration.packing import from_lists, save_token_documents

    generator = np.random.default_rng(0)
    documents = [generator.integers(3, 1000, int(generator.integers(20, 400))) for _ in range(120)]
    data = save_token_documents(str(tmp_path / "documents.npy"), from_lists(documents))
    runs = {attention: run(_small(tmp_path, attention, data_path=data, attention=attention, row_tokens=256,
                                  placement="colocated", eval_every=4), progress=False)
            for attention in ("sdpa", "flex_attention")}
    losses = {attention: _losses(summary) for attention, summary in runs.items()}
    assert torch.isfinite(losses["flex_attention"]).all() and losses["flex_attention"].shape == (8,)
    assert torch.allclose(losses["flex_attention"], losses["sdpa"], rtol=2e-2, atol=1e-3)
    for key in ("teacher_held_out_ce", "student_held_out_ce"):
        assert abs(runs["flex_attention"][key] - runs["sdpa"][key]) <= 2e-2 * runs["sdpa"][key], key


@pytest.mark.parametrize("strategy", ["replica", "fsdp2"])
def test_fused_run_with_compiled_layers_trains(ray_cluster, tmp_path, strategy):
    """compile=true (auto's choice for replicas off-policy): inductor compiles both models'
    decoder layers in the fused worker (the teacher's pretraining and scoring, the student's
    forward and backward; under FSDP2 with activation checkpointing too); the student's loss is
    finite at every step and falls."""
    from orchestration.driver import run

    options = dict(student_strategy="fsdp2", activation_checkpointing=True) if strategy == "fsdp2" else {}
    summary = run(_small(tmp_path, "compiled", placement="fused", attention="sdpa", compile="true", steps=12,
                         **options), progress=False)
    losses = _losses(summary)
    assert losses.shape == (12,) and torch.isfinite(losses).all()
    assert losses[-3:].mean() < losses[:3].mean(), losses
    assert torch.isfinite(torch.tensor([summary["teacher_held_out_ce"], summary["student_held_out_ce"]])).all()
