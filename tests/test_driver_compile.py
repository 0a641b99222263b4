"""compile=true: the student's and the teacher's decoder layers run through torch.compile in
the workers, and the run trains as the eager one does."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from orchestration.compilation import compiles
from orchestration.config import load_config
from orchestration.errors import UsageError
from test_orchestration import _tiny


@pytest.fixture
def recording_ray(tmp_path):
    """A local Ray whose worker processes compile with a recording ``aot_eager`` backend
    (`compilation.BACKEND`, set by a worker setup hook). Each graph the backend receives
    appends a line to the returned file: the widest last dimension of its 3-D inputs (the
    hidden states ``[B, T, H]``: H tells the teacher's layers from the student's), the grad
    mode and its inputs' shapes.

    aot_eager, not inductor: it runs dynamo and AOT autograd (the joint forward / backward
    graph, functionalization, the checkpoint traced into the graph) as inductor does but
    executes the graph's own ATen ops instead of generating C++ kernels, which on two CPU cores
    would take minutes per graph; inductor's code generation is the GPU test's part."""
    import ray

    path = str(tmp_path / "graphs.jsonl")

    def setup():  # defined here: Ray sends the function itself to the workers
        from torch._dynamo.backends.debugging import aot_eager

        from orchestration import compilation

        def recording(graph, example_inputs):
            widths = [x.shape[-1] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 3]
            shapes = [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
            with open(path, "a") as handle:
                handle.write(json.dumps(dict(hidden=max(widths, default=0), grad=torch.is_grad_enabled(),
                                             shapes=shapes)) + "\n")
            return aot_eager(graph, example_inputs)

        compilation.BACKEND = recording

    if ray.is_initialized():  # another test's Ray (conftest.py's ray_cluster)
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"worker_process_setup_hook": setup})
    yield path
    ray.shutdown()


@pytest.mark.slow
def test_compiled_decoder_layers_train_like_eager_ones_under_fsdp2_and_checkpointing(recording_ray, tmp_path):
    """A fused FSDP2 student with activation checkpointing: the same run eager and compiled ends
    with equal parameters and held-out CE (to float32 rounding: AOT autograd's decompositions
    may reorder a sum; on this CPU they come out equal), and graphs were compiled for both
    models' layers (teacher hidden 32, student 16): a run whose layers stayed eager records
    nothing and fails. Two driver runs, the compiled one tracing its graphs."""
    from orchestration.driver import run

    options = dict(placement="fused", student_strategy="fsdp2", activation_checkpointing=True, steps=2,
                   teacher_pretrain_steps=1, micro_batches=1, checkpoint_every=0, teacher_layers=2, student_layers=2)
    eager = run(_tiny(tmp_path, "eager", **options), progress=False, return_parameters=True)
    assert not os.path.exists(recording_ray)  # compile=auto compiles nothing on the CPU
    compiled = run(_tiny(tmp_path, "compiled", compile="true", **options), progress=False, return_parameters=True)
    graphs = [json.loads(line) for line in open(recording_ray)]
    assert {graph["hidden"] for graph in graphs} == {32, 16}, graphs
    # the training graphs: one a set of input shapes, shared by both layers of a model (a graph
    # compiled for each layer would come twice); under no_grad the checkpointed layers of this
    # run compile once a layer (docs/DECISIONS.md)
    signatures = [json.dumps(graph["shapes"]) for graph in graphs if graph["grad"]]
    assert len(signatures) == 2 and len(set(signatures)) == 2, signatures
    got, expected = compiled["student_parameters"][0], eager["student_parameters"][0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert compiled["student_held_out_ce"] == pytest.approx(eager["student_held_out_ce"], rel=1e-5)


def test_bench_e2e_throughput_adds_compiled_rows(monkeypatch, tmp_path):
    """``--compile``: each loop on packed rows with compiled layers (their graphs made in the
    warm-up), and each driver row again with compile=true; ``--compile-only`` keeps only
    those. The driver is stubbed (its compiled run is the test above) and the loop compiles with
    aot_eager (see `recording_ray`)."""
    import sys

    sys.path.insert(0, "benchmarks")
    import bench_e2e_throughput as bench
    from orchestration import compilation

    monkeypatch.setattr(compilation, "BACKEND", "aot_eager")
    driven = []

    def driver(placement, strategy, paths, data, args, attention="sdpa", compiled=False):
        driven.append(compiled)
        return dict(provider=f"driver {placement} ({strategy}{', compiled' if compiled else ''})", ms=1.0,
                    tokens_per_s=1.0, peak_mib=1.0)

    monkeypatch.setattr(bench, "driver", driver)
    common = ["--tiny", "--placements", "fused", "--output-dir", str(tmp_path / "bench"),
              "--results", str(tmp_path / "rows.jsonl")]
    graphs = bench._compiled_graphs()
    rows = bench.main(common + ["--compile", "--compile-only"])
    assert bench._compiled_graphs() > graphs  # the loop's layers went through dynamo
    assert [row["provider"] for row in rows] == ["single process, full logits (PyTorch), packed, compiled",
                                                 "single process, kd_kernels, packed, compiled",
                                                 "driver fused (replica, compiled)"]
    assert all(row["tokens_per_s"] > 0 and row["first_step_s"] > 0 for row in rows[:2]) and driven == [True]
    driven.clear()
    rows = bench.main(common + ["--compile", "--skip-single"])
    assert [row["provider"] for row in rows] == ["driver fused (replica)", "driver fused (replica, compiled)"]
    assert driven == [False, True]


@pytest.mark.parametrize("setting, mode, device, named, strategy, expected", [
    ("auto", "off_policy", "cuda", True, "replica", True), ("auto", "cache", "cuda", True, "replica", False),
    ("auto", "on_policy", "cuda", True, "replica", False), ("auto", "gkd", "cuda", True, "replica", False),
    ("auto", "off_policy", "cpu", True, "replica", False), ("auto", "off_policy", "cuda", False, "replica", False),
    ("auto", "off_policy", "cuda", True, "fsdp2", False), ("true", "on_policy", "cpu", True, "fsdp2", True),
    ("false", "off_policy", "cuda", True, "replica", False)])
def test_compile_auto_compiles_off_policy_gpu_runs_of_replicas_that_name_their_layers(setting, mode, device, named,
                                                                                      strategy, expected):

    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    if not named:
        model._no_split_modules = []
    config = SimpleNamespace(compile=setting, mode=mode, student_strategy=strategy)
    assert compiles(config, torch.device(device), model) is expected


def test_compile_takes_yaml_booleans_and_refuses_other_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("compile: true\n")
    assert load_config(str(path), ["device=cpu"]).compile == "true"
    path.write_text("compile: false\n")
    assert load_config(str(path), ["device=cpu"]).compile == "false"
    assert load_config(None, ["device=cpu"]).compile == "auto"
    with pytest.raises(UsageError, match="compile.*'auto', 'true', 'false'"):
        load_config(None, ["device=cpu", "compile=yes"])
    with pytest.raises(ValueError, match="compile: expected one of"):
        compiles(SimpleNamespace(compile="yes"), torch.device("cpu"), None)
