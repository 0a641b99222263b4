"""The run configuration: an embedded default, a YAML file on top, ``--set key=value`` on top."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import yaml


def _option(default, help_text):
    return field(default=default, metadata={"help": help_text})


@dataclass
class Config:
    output_dir: str = _option("runs/default", "where metrics.jsonl, checkpoints/ and the tokenizer go")
    seed: int = _option(0, "seed of models, data order and sampling")
    device: str = _option("auto", "auto | cpu | cuda")
    data_path: Optional[str] = _option(None, "JSONL (prompt/response or text) or a text file; none: the Python "
                                             "standard library's sources, which every machine has")
    chat_template: Optional[str] = _option(None, "format string with {prompt} and {response}; prompt tokens are "
                                                 "not trained")
    tokenizer_path: Optional[str] = _option(None, "a saved Hugging Face tokenizer; none: train a byte-level BPE "
                                                  "on the data")
    tokenizer_vocab: int = _option(1024, "vocab size of the trained tokenizer")
    max_corpus_bytes: int = _option(1_500_000, "read at most this much of the default corpus")
    row_tokens: int = _option(128, "tokens per packed row")
    rows_per_micro_batch: int = _option(8, "rows per micro-batch")
    micro_batches: int = _option(2, "micro-batches per optimizer step")
    teacher_path: Optional[str] = _option(None, "a local Hugging Face causal LM; none: build one from the "
                                                "teacher_* sizes and pretrain it")
    teacher_hidden: int = _option(128, "teacher hidden size when built from a config")
    teacher_layers: int = _option(4, "teacher layers when built from a config")
    teacher_pretrain_steps: int = _option(250, "CE steps for a teacher built from a config")
    teacher_lr: Optional[float] = _option(None, "the teacher pretraining's LR after its warm-up (none: lr)")
    student_path: Optional[str] = _option(None, "a local Hugging Face causal LM; none: build one")
    student_hidden: int = _option(64, "student hidden size when built from a config")
    student_layers: int = _option(2, "student layers when built from a config")
    heads: int = _option(4, "attention heads of built models")
    attention: str = _option("sdpa", "sdpa | eager: the models' attention (eager has a deterministic backward on "
                                     "GPUs, for runs compared bit for bit; sdpa's fused kernels may accumulate "
                                     "with atomics)")
    steps: int = _option(100, "student optimizer steps")
    lr: float = _option(3e-3, "AdamW peak learning rate")
    warmup_steps: int = _option(10, "linear warm-up steps, then cosine decay to 10 %")
    grad_clip: float = _option(1.0, "gradient norm clip")
    k: int = _option(32, "teacher top-k entries per token")
    temperature: float = _option(1.0, "distillation temperature (teacher and student)")
    divergence: str = _option("forward_kl", "forward_kl | reverse_kl | jsd | skewed_forward_kl | "
                                            "skewed_reverse_kl | adaptive_kl | tvd")
    support: str = _option("renormalized", "renormalized | tail")
    kd_weight: float = _option(1.0, "weight of the KD term")
    ce_weight: float = _option(0.5, "weight of the CE term")
    teacher_workers: int = _option(1, "teacher data-parallel workers (one must divide the other with "
                                      "student_workers, and both must divide micro_batches)")
    student_workers: int = _option(1, "student data-parallel workers (gradients summed with gloo / NCCL; the loss "
                                      "is normalized by the step's global token count)")
    placement: str = _option("auto", "auto | colocated | disaggregated: on GPUs, teacher and student workers "
                                     "share each GPU (colocated) or get their own (disaggregated; auto picks it "
                                     "when there are teacher_workers + student_workers GPUs)")
    transfer: str = _option("auto", "auto | object_store | cuda_ipc | nccl: how teacher top-k reaches the student "
                                    "(auto: CUDA IPC when colocated, NCCL when disaggregated, the object store on "
                                    "CPU)")
    teacher_offload: bool = _option(False, "keep the teacher's weights on the CPU between its scoring calls "
                                           "(colocated runs short of GPU memory)")
    overlap: bool = _option(True, "score step i + 1 on the teacher while the student trains step i")
    checkpoint_every: int = _option(40, "save the student every N steps (0: only at the end)")
    resume: bool = _option(False, "continue from the latest checkpoint in output_dir")
    stop_after: Optional[int] = _option(None, "stop after this step (for tests of resume)")
    fail_student_at_step: Optional[int] = _option(None, "fault injection for tests: the student worker's process "
                                                        "exits at this step")

    def __post_init__(self):
        if self.micro_batches < 1 or self.rows_per_micro_batch < 1 or self.row_tokens < 2:
            raise ValueError("micro_batches, rows_per_micro_batch: expected >= 1; row_tokens: expected >= 2")
        if self.transfer not in ("auto", "object_store", "cuda_ipc", "nccl"):
            raise ValueError(f"transfer: expected auto, object_store, cuda_ipc or nccl, got {self.transfer!r}")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention: expected sdpa or eager, got {self.attention!r}")
        if self.placement not in ("auto", "colocated", "disaggregated"):
            raise ValueError(f"placement: expected auto, colocated or disaggregated, got {self.placement!r}")


# The embedded default on a GPU: larger models, longer rows, more data (options not set
# explicitly take these when the run's device is CUDA). One micro-batch of 32 rows a step:
# these small models are bound by kernel launches, which two micro-batches would double.
GPU_DEFAULTS = dict(max_corpus_bytes=30_000_000, tokenizer_vocab=8192, row_tokens=512, rows_per_micro_batch=32,
                    micro_batches=1, teacher_hidden=768, teacher_layers=8, teacher_pretrain_steps=800, teacher_lr=1e-3,
                    student_hidden=384, student_layers=4, heads=8, steps=300, warmup_steps=30, k=64,
                    checkpoint_every=100)


def help_text() -> str:
    lines = ["options (YAML keys, or --set key=value; on a CUDA device, options not set take the GPU default "
             "in brackets):"]
    for option in dataclasses.fields(Config):
        gpu = f" [GPU {GPU_DEFAULTS[option.name]!r}]" if option.name in GPU_DEFAULTS else ""
        lines.append(f"  {option.name} (default {option.default!r}{gpu}): {option.metadata['help']}")
    return "\n".join(lines)


def _runs_on_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return device == "cuda" or torch.cuda.is_available()


def _parse_value(option: dataclasses.Field, text: str):
    value = yaml.safe_load(text)
    default = option.default
    if value is None:
        return value
    if default is None:  # Optional[...]: the annotation names the type (YAML reads "1e-3" as a string)
        kind = {"Optional[float]": float, "Optional[int]": int}.get(str(option.type))
        if kind is None:
            return value
        try:
            return kind(value)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{option.name}: expected a {kind.__name__} or null, got {text!r}") from error
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{option.name}: expected true or false, got {text!r}")
        return value
    try:
        return type(default)(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{option.name}: expected a {type(default).__name__}, got {text!r}") from error


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides; unknown keys are errors."""
    fields = {option.name: option for option in dataclasses.fields(Config)}
    values = {}
    if path:
        with open(path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle) or {}
        for key, value in loaded.items():
            if key not in fields:
                raise ValueError(f"{path}: unknown option {key!r} (see --help)")
            values[key] = _parse_value(fields[key], yaml.safe_dump(value))
    for override in overrides or []:
        key, separator, text = override.partition("=")
        if not separator or key not in fields:
            raise ValueError(f"--set {override!r}: expected key=value with a known key (see --help)")
        values[key] = _parse_value(fields[key], text)
    if _runs_on_cuda(values.get("device", Config.device)):
        values = {**{key: value for key, value in GPU_DEFAULTS.items() if key not in values}, **values}
    return Config(**values)
