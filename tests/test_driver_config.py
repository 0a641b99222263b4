"""The driver's options: one table (`orchestration.options`), the loss options taken whole
from kd_kernels.DivergenceOptions, every bad option refused before any work (exit 2, one
line each, within seconds, no traceback), and a non-default beta reaching the loss."""
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import kd_kernels as kd
from helpers import python_path
from orchestration import config as config_module
from orchestration import options as options_module
from orchestration import placement
from orchestration.config import Config, help_text, load_config, options_markdown
from orchestration.errors import UsageError
from orchestration.options import GPU_DEFAULTS, LOSS_OPTION_NAMES, OPTIONS, UNSET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the table ------------------------------------------------------------------------------

def test_the_loss_options_are_the_api_options_less_the_driver_owned_ones():
    api = [field.name for field in dataclasses.fields(kd.DivergenceOptions)]
    assert list(LOSS_OPTION_NAMES) == [name for name in api if name not in ("vocab_size", "reduction", "ignore_index")]
    for name in ("beta", "skew_lambda", "adaptive_alpha", "support", "temperature", "kd_weight", "ce_weight"):
        assert name in LOSS_OPTION_NAMES
    defaults = kd.DivergenceOptions()
    assert Config().loss_options() == {name: 0.5 if name == "ce_weight" else getattr(defaults, name)
                                       for name in LOSS_OPTION_NAMES}


def test_a_new_api_option_reaches_the_driver_without_a_change_there(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class WithGamma(kd.DivergenceOptions):
        gamma: float = 0.25

    monkeypatch.setattr(kd, "DivergenceOptions", WithGamma)
    gamma = {option.name: option for option in options_module.loss_options()}["gamma"]
    assert (gamma.kind, gamma.default, gamma.section) == (float, 0.25, "loss")
    assert gamma.parse(0.5, "0.5") == 0.5
    with pytest.raises(ValueError, match="finite number"):
        gamma.parse("abc", "abc")


def test_config_fields_help_and_markdown_come_from_the_table():
    assert [field.name for field in dataclasses.fields(Config)] == [option.name for option in OPTIONS]
    text, markdown = help_text(), options_markdown()
    for option in OPTIONS:
        gpu = f", GPU {option.gpu_default!r}" if option.gpu_default is not UNSET else ""
        default = ("null" if option.default is None else str(option.default).lower()
                   if isinstance(option.default, bool) else repr(option.default))
        assert f"  {option.name} = {default}{gpu}  ({option.expected()}) " in text
        assert f"| `{option.name}` |" in markdown
    assert "tokenizer_vocab = 1024, GPU 8192" in text and "steps = 100, GPU 300" in text


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 7\nk: 16\nlr: 1e-3\nchat_template: 'Q: {prompt} A: {response}'\n")
    config = load_config(str(path), [f"output_dir={tmp_path}/x", "lr=0.01", "overlap=false", "k=8",
                                     "teacher_lr=1e-3", "stop_after=5", "teacher_path=null", "divergence=jsd",
                                     "beta=0.3"])
    assert (config.steps, config.k, config.lr, config.overlap) == (7, 8, 0.01, False)
    assert (config.teacher_lr, config.stop_after, config.teacher_path) == (1e-3, 5, None)
    assert isinstance(config.teacher_lr, float) and config.chat_template == "Q: {prompt} A: {response}"
    assert config.loss_options()["divergence"] == "jsd" and config.loss_options()["beta"] == 0.3
    assert load_config(None, [f"output_dir={tmp_path}/y", "chat_template=Q: {prompt}\\nA: {response}"]
                       ).chat_template == "Q: {prompt}\\nA: {response}"  # --set text is not parsed as YAML
    assert load_config(None, [f"output_dir={tmp_path}/z"], resume=False).resume is False


def test_gpu_defaults_apply_on_cuda_only_where_not_set(monkeypatch, tmp_path):
    monkeypatch.setattr(placement, "cuda_available", lambda: True)
    monkeypatch.setattr(config_module, "gpu_count", lambda: 1)
    on_gpu = load_config(None, ["steps=5", f"output_dir={tmp_path}"])
    assert on_gpu.steps == 5  # set explicitly: kept
    for name, value in GPU_DEFAULTS.items():
        if name != "steps":
            assert getattr(on_gpu, name) == value
    on_cpu = load_config(None, ["device=cpu", f"output_dir={tmp_path}"])
    assert (on_cpu.teacher_hidden, on_cpu.row_tokens) == (Config().teacher_hidden, Config().row_tokens)


def test_config_objects_check_themselves():
    with pytest.raises(UsageError,
                       match=r"^attention: expected one of 'sdpa', 'eager', 'flex_attention', got 'flash'$"):
        Config(attention="flash")
    with pytest.raises(UsageError) as caught:
        Config(k=1.5, steps=0, teacher_workers=2, student_workers=3)
    assert caught.value.lines == ["steps: expected an integer >= 1, got 0", "k: expected an integer >= 1, got 1.5",
                                  "teacher_workers, student_workers: expected one to divide the other (integer "
                                  "ratios only), got 2 and 3"]
    assert Config(lr=1).lr == 1.0 and isinstance(Config(lr=1).lr, float)


def test_a_run_from_a_teacher_cache_refuses_what_needs_a_teacher_model(tmp_path):
    cache = str(tmp_path)
    with pytest.raises(UsageError, match=r"^student_strategy: fsdp2 takes its held-out CE from the teacher's top-k"):
        Config(teacher_cache=cache, student_strategy="fsdp2")
    with pytest.raises(UsageError, match=r"^eval_every: a run from a teacher_cache has no teacher model"):
        Config(teacher_cache=cache, eval_every=5)
    with pytest.raises(UsageError, match=r"^teacher_cache: mode gkd scores the student's own samples"):
        Config(teacher_cache=cache, mode="gkd")
    assert Config(teacher_cache=cache, mode="cache", student_strategy="fsdp2").student_strategy == "fsdp2"


def test_flex_attention_is_refused_where_the_student_generates():
    with pytest.raises(UsageError, match=r"^attention: flex_attention is for training on packed rows; mode gkd"):
        Config(attention="flex_attention", mode="gkd")
    assert Config(attention="flex_attention", mode="off_policy").attention == "flex_attention"


def test_the_attention_option_builds_that_attention():
    from orchestration.models import build_model

    for attention in ("eager", "sdpa", "flex_attention"):
        model = build_model(None, 32, 1, Config(heads=4, attention=attention), 100, seed=0)
        assert model.config._attn_implementation == attention


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: -5\nstepz: 3\nk: 1.5\n")
    with pytest.raises(UsageError) as caught:
        load_config(str(path), ["divergence=foo", "beta=2", f"output_dir={tmp_path}"])
    assert caught.value.lines == [
        f"{path}: unknown option 'stepz' (did you mean 'steps'?)",
        f"steps: expected an integer >= 1, got -5 ({path})",
        f"k: expected an integer >= 1, got 1.5 ({path})",
        "divergence: expected one of 'forward_kl', 'reverse_kl', 'jsd', 'skewed_forward_kl', 'skewed_reverse_kl', "
        "'adaptive_kl', 'tvd', got 'foo' (--set divergence=foo)",
        "beta: expected a number in [0, 1], got 2.0 (--set beta=2)",
    ]


def test_checkpoints_of_an_earlier_run_are_not_resumed_by_accident(tmp_path):
    from orchestration import checkpoint

    checkpoint.write(checkpoint.path_of(str(tmp_path), 3), 3, {"a": lambda p: open(p, "w").write("x")}, {})
    with pytest.raises(UsageError, match="holds checkpoints of an earlier run .newest step_0000003.: pass --resume"):
        load_config(None, [f"output_dir={tmp_path}"])
    assert load_config(None, [f"output_dir={tmp_path}", "overwrite=true"]).overwrite
    assert load_config(None, [f"output_dir={tmp_path}"], resume=True).resume


def test_k_is_checked_against_a_saved_tokenizers_vocab(tmp_path):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(json.dumps(
        {"model": {"vocab": {f"t{i}": i for i in range(40)}}, "added_tokens": [{"id": 40}, {"id": 3}]}))
    with pytest.raises(UsageError, match=r"k: expected at most the vocab of tokenizer_path \(41\), got 64"):
        load_config(None, [f"output_dir={tmp_path}/run", f"tokenizer_path={tokenizer}", "k=64"])
    assert load_config(None, [f"output_dir={tmp_path}/run", f"tokenizer_path={tokenizer}", "k=41"]).k == 41


# ---- the student's loss ----------------------------------------------------------------------

def test_divergence_and_beta_from_set_reach_the_students_loss(tmp_path):
    from orchestration.hf_models import final_hidden_states
    from orchestration.models import lm_head_inputs
    from orchestration.student import StudentWorker

    vocab = 50
    sizes = [f"output_dir={tmp_path}", "device=cpu", "student_hidden=16", "student_layers=1", "heads=2",
             "row_tokens=8", "temperature=2", "ce_weight=0.25"]
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 8))
    labels = torch.randint(0, vocab, (16,))
    labels[::5] = -100
    teacher = kd.teacher_topk(torch.randn(16, 12), torch.randn(vocab, 12), k=6, temperature=2.0)

    def loss_of(overrides):
        worker = StudentWorker(load_config(None, sizes + overrides), vocab)
        return worker, worker.loss(tokens, labels, teacher, num_tokens=13)[0]

    worker, jsd_03 = loss_of(["divergence=jsd", "beta=0.3"])
    hidden = final_hidden_states(worker.model, tokens).reshape(16, -1)
    expected = kd.topk_divergence(*lm_head_inputs(worker.model, hidden), teacher, labels, divergence="jsd",
                                  beta=0.3, temperature=2.0, ce_weight=0.25, num_tokens=13, vocab_size=vocab)
    assert torch.equal(jsd_03, expected)
    _, jsd_05 = loss_of(["divergence=jsd"])
    _, forward = loss_of(["beta=0.3"])
    assert not torch.isclose(jsd_03, jsd_05, rtol=1e-4) and not torch.isclose(jsd_03, forward, rtol=1e-4)


# ---- the command line: exit 2 within seconds, one line per problem ------------------------------

def _orchestrate(*arguments, cwd=ROOT, timeout=30):
    """orchestrate.py in a child that sees no GPU: the messages and defaults are a CPU machine's on
    every machine."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "orchestrate.py"), *arguments], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=python_path(ROOT), CUDA_VISIBLE_DEVICES=""))
    return done, time.perf_counter() - started


@pytest.fixture(scope="module")
def at_once():
    """Seconds an answer "at once" may take: a child's torch import on this machine now (the most any
    usage error's path loads) and 3 s more, far under a Ray start or a model build; a fixed 5 s
    bound failed at 5.0–5.5 s on a loaded GPU machine."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=60,
                   env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    return time.perf_counter() - started + 3.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "malformed.yaml").write_text("steps: [1, 2\n")
    (root / "list.yaml").write_text("- steps\n- 3\n")
    (root / "unknown.yaml").write_text("stepz: 3\n")
    (root / "a_file").write_text("")
    return root


BAD = [  # (arguments, the start of each expected line)
    (["--set", "steps=-5"], ["steps: expected an integer >= 1, got '-5'"]),
    (["--set", "k=1.5"], ["k: expected an integer >= 1, got '1.5'"]),
    (["--set", "k=abc"], ["k: expected an integer >= 1, got 'abc'"]),
    (["--set", "k=5000"], ["k: expected at most the vocab (tokenizer_vocab = 1024), got 5000"]),
    (["--set", "overlap=maybe"], ["overlap: expected true or false, got 'maybe'"]),
    (["--set", "divergence=foo"], ["divergence: expected one of 'forward_kl',"]),
    (["--set", "support=foo"], ["support: expected one of 'renormalized', 'tail', 'sampled', got 'foo'"]),
    (["--set", "lr=-1"], ["lr: expected a finite number > 0, got '-1'"]),
    (["--set", "temperature=0"], ["temperature: expected a finite number > 0, got 0.0"]),
    (["--set", "ce_weight=-3"], ["ce_weight: expected a finite number >= 0, got '-3'"]),
    (["--set", "beta=1.5"], ["beta: expected a number in [0, 1], got 1.5"]),
    (["--set", "checkpoint_every=-1"], ["checkpoint_every: expected an integer >= 0, got '-1'"]),
    (["--set", "placement=sideways"], ["placement: expected one of 'auto', 'colocated', 'disaggregated'"]),
    (["--set", "transfer=nccl"], ["transfer: 'nccl' needs CUDA devices"]),
    (["--set", "placement=disaggregated"], ["placement: 'disaggregated' needs CUDA devices"]),
    (["--set", "device=tpu"], ["device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'"]),
    (["--set", "attention=flash"], ["attention: expected one of 'sdpa', 'eager', 'flex_attention', got 'flash'"]),
    (["--set", "attention=flex_attention", "--set", "device=cpu"], ["attention: flex_attention trains on CUDA only"]),
    (["--set", "micro_batches=3", "--set", "student_workers=2"], ["micro_batches: expected a multiple of 2"]),
    (["--set", "student_hidden=30"], ["student_hidden: expected a multiple of heads (4), got 30"]),
    (["--set", "data_path=/nonexistent.jsonl"], ["data_path: expected an existing file, got '/nonexistent.jsonl'"]),
    (["--set", "stepz=3"], ["--set stepz=3: unknown option 'stepz' (did you mean 'steps'?)"]),
    (["--set", "steps"], ["--set 'steps': expected KEY=VALUE"]),
    (["missing.yaml"], ["config: no such file: 'missing.yaml'"]),
    (["{files}/malformed.yaml"], ["config: '{files}/malformed.yaml' is not valid YAML at line 2"]),
    (["{files}/list.yaml"], ["config: expected a mapping of option: value at the top level of "
                             "'{files}/list.yaml', got a list"]),
    (["{files}/unknown.yaml"], ["{files}/unknown.yaml: unknown option 'stepz'"]),
    (["--set", "output_dir={files}/a_file"], ["output_dir: expected a directory, got '{files}/a_file', which is "
                                              "a file"]),
    (["--set", "output_dir=/sys/kd_kernels_test/run"], ["output_dir: expected a writable directory, got "
                                                        "'/sys/kd_kernels_test/run'"]),
    (["--resume", "--set", "output_dir={files}/empty"], ["resume: no checkpoint to resume from in "
                                                         "{files}/empty/checkpoints (looked for"]),
    (["--set", "k=0", "--set", "lr=0", "--set", "support=x"], ["k: expected", "lr: expected", "support: expected"]),
]


@pytest.mark.parametrize("arguments, lines", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_each_bad_option_exits_2_at_once_with_one_line_each(files, tmp_path, at_once, arguments, lines):
    arguments = [argument.format(files=files) for argument in arguments]
    if not any(argument.startswith("output_dir=") for argument in arguments):
        arguments += ["--set", f"output_dir={tmp_path}/run"]
    done, seconds = _orchestrate(*arguments, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    got = done.stderr.splitlines()
    assert len(got) == len(lines) and "Traceback" not in done.stderr, done.stderr
    for line, expected in zip(got, lines):
        assert line.startswith("orchestrate.py: error: " + expected.format(files=files)), line
    assert seconds < at_once, f"{seconds:.1f} s"
    assert not os.path.exists(tmp_path / "run")  # nothing was started


def test_debug_shows_the_traceback_and_help_lists_every_option(tmp_path, at_once):
    done, _ = _orchestrate("--set", "steps=0", "--debug", "--set", f"output_dir={tmp_path}")
    assert done.returncode == 2 and "Traceback" in done.stderr and "steps: expected" in done.stderr
    done, seconds = _orchestrate("--help")
    assert done.returncode == 0 and seconds < at_once
    assert all(f"  {option.name} = " in done.stdout for option in OPTIONS)
