"""The one definition of every option of the driver: name, type, default, allowed values,
help and GPU default. Parsing, validation, ``--help``, the Markdown table of the docs and
the `Config` dataclass all come from `OPTIONS`.

The loss options are not written here: they are the fields of the public
`kd_kernels.DivergenceOptions` (less ``vocab_size``, ``reduction`` and ``ignore_index``,
which the driver owns), with their API defaults unless `LOSS_DEFAULTS` says otherwise, and
they are validated by constructing `DivergenceOptions`. A new option of the API therefore
reaches the YAML, ``--set``, ``--help`` and the student's loss without a change here.

To add a driver option, add one `Option` row to the section it belongs to. This module
imports nothing heavy (no torch): a bad option is refused in well under a second.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import kd_kernels as kd

UNSET = object()  # no GPU default: the option keeps its default on GPUs too

# The loss options the driver sets itself: the lm_head's real row count, its own reduction
# by the step's global token count, and its own label padding.
DRIVER_OWNED_LOSS_FIELDS = ("vocab_size", "reduction", "ignore_index")
# Driver defaults that differ from the API's, and lower bounds the API does not impose.
LOSS_DEFAULTS = {"ce_weight": 0.5}
LOSS_MINIMUMS = {"kd_weight": 0.0, "ce_weight": 0.0}
# Help of the API's loss options (a new API option without an entry gets a generic line).
LOSS_HELP = {
    "divergence": "the KD divergence of kd.topk_divergence",
    "support": "renormalized: both sides softmaxed over the teacher's k ids; tail: k + 1 bins, the last one "
               "the mass outside them",
    "temperature": "distillation temperature of teacher and student",
    "kd_weight": "weight of the KD term",
    "ce_weight": "weight of the CE term",
    "beta": "jsd: the mixture m = beta p + (1 - beta) q (0 and 1 are forward and reverse KL)",
    "skew_lambda": "skewed_forward_kl / skewed_reverse_kl: the skew",
    "adaptive_alpha": "adaptive_kl: the head / tail split of the teacher's mass",
}
# Choices of the API's string options, for --help and for the check before DivergenceOptions.
LOSS_CHOICES = {"divergence": "DIVERGENCES", "support": "SUPPORTS"}  # names in kd_kernels.options


@dataclass(frozen=True)
class Option:
    """One option. ``kind`` is int, float, str or bool; ``nullable`` allows null (None);
    ``minimum`` is an inclusive and ``above`` an exclusive lower bound; ``path`` says what
    must exist on disk: "file", "dir" (read) or "output" (a directory to create or write)."""

    name: str
    kind: type
    default: Any
    help: str
    section: str
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    above: Optional[float] = None
    nullable: bool = False
    path: Optional[str] = None
    gpu_default: Any = UNSET
    api_field: bool = False  # a field of kd_kernels.DivergenceOptions

    @property
    def annotation(self):
        return Optional[self.kind] if self.nullable else self.kind

    def expected(self) -> str:
        """What a valid value looks like, in words ("an integer >= 1", "one of 'a', 'b'")."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(choice) for choice in self.choices)
        elif self.kind is bool:
            text = "true or false"
        elif self.kind is str:
            text = {"file": "the path of a file", "dir": "the path of a directory",
                    "output": "a directory path"}.get(self.path, "a string")
        else:
            text = "an integer" if self.kind is int else "a finite number"
            if self.minimum is not None:
                text += f" >= {_number(self.minimum)}"
            if self.above is not None:
                text += f" > {_number(self.above)}"
        return f"null or {text}" if self.nullable else text

    def parse(self, value, from_text: Optional[str] = None):
        """``value`` (from YAML; ``from_text``: the raw ``--set`` text it came from) as this
        option's type. Raises ValueError(what is expected) when it is not one."""
        if from_text is not None and self.kind is str:
            value = from_text  # "a: b" stays text, not a YAML mapping
        if self.kind is str and isinstance(value, bool) and self.choices and "true" in self.choices:
            value = str(value).lower()  # YAML's true / false for a choice that names them
        if self.nullable and (value is None or (isinstance(value, str) and value.strip().lower() in
                                                ("", "null", "none", "~"))):
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            if isinstance(value, str):
                try:
                    value = float(value)  # YAML reads 1e-3 (no dot) as a string
                except ValueError:
                    pass
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        else:
            ok = isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool))
            value = str(value) if ok else value
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.minimum is not None:
            ok = value >= self.minimum
        if ok and self.above is not None:
            ok = value > self.above
        if ok and self.kind is str and self.path and not value:
            ok = False
        if not ok:
            raise ValueError(self.expected())
        return value


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _annotation_kind(field: dataclasses.Field) -> tuple[type, bool]:
    """(type, nullable) of a dataclass field from its annotation (a string under
    ``from __future__ import annotations``) or, failing that, its default."""
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    nullable = text.startswith("Optional[")
    base = text[len("Optional["):-1] if nullable else text
    kinds = {"int": int, "float": float, "str": str, "bool": bool}
    if base in kinds:
        return kinds[base], nullable
    return type(field.default), nullable


def loss_options() -> list[Option]:
    """The driver's loss options: the fields of kd_kernels.DivergenceOptions less the
    driver-owned ones, in the API's order."""
    rows = []
    for field in dataclasses.fields(kd.DivergenceOptions):
        if field.name in DRIVER_OWNED_LOSS_FIELDS:
            continue
        kind, nullable = _annotation_kind(field)
        choices = getattr(kd.options, LOSS_CHOICES[field.name]) if field.name in LOSS_CHOICES else None
        help_text = field.metadata.get("help") or LOSS_HELP.get(field.name, f"kd.topk_divergence's {field.name}")
        rows.append(Option(field.name, kind, LOSS_DEFAULTS.get(field.name, field.default), help_text, "loss",
                           choices=tuple(choices) if choices else None, minimum=LOSS_MINIMUMS.get(field.name),
                           nullable=nullable, api_field=True))
    return rows


def _rows(section: str, *rows: tuple) -> list[Option]:
    """Options of one section: (name, kind, default, help, keyword arguments of `Option`)."""
    return [Option(name, kind, default, help_text, section, **(extra[0] if extra else {}))
            for name, kind, default, help_text, *extra in rows]


OPTIONS: tuple[Option, ...] = tuple([
    *_rows("run",
           ("output_dir", str, "runs/default", "where metrics.jsonl, checkpoints/, the tokenizer and summary.json go",
            dict(path="output")),
           ("seed", int, 0, "seed of models, data order and sampling", dict(minimum=0)),
           ("device", str, "auto", "the workers' device (auto: cuda when torch sees one)",
            dict(choices=("auto", "cpu", "cuda")))),
    *_rows("data",
           ("data_path", str, None, "JSONL (prompt/response or text; input_ids: pre-tokenized, packed with EOS "
            "and per-document positions), NAME.npy token ids with NAME.offsets.npy, or a text file; null: the Python "
            "standard library's sources, which every machine has", dict(nullable=True, path="file")),
           ("chat_template", str, None, "format string with {prompt} and {response}; prompt tokens are not trained",
            dict(nullable=True)),
           ("tokenizer_path", str, None, "a saved Hugging Face tokenizer; null: train a byte-level BPE on the data",
            dict(nullable=True, path="dir")),
           ("tokenizer_vocab", int, 1024, "vocab size of the trained tokenizer (the 256 bytes and 2 special tokens "
            "at least)", dict(minimum=258, gpu_default=8192)),
           ("max_corpus_bytes", int, 1_500_000, "read at most this much of the default corpus",
            dict(minimum=1, gpu_default=30_000_000)),
           ("row_tokens", int, 128, "tokens per packed row", dict(minimum=2, gpu_default=512)),
           ("rows_per_micro_batch", int, 8, "rows per micro-batch", dict(minimum=1, gpu_default=32)),
           # one micro-batch a step on GPUs: these small models are bound by kernel launches, which two would double
           ("micro_batches", int, 2, "micro-batches per optimizer step", dict(minimum=1, gpu_default=1))),
    *_rows("models",
           ("teacher_path", str, None, "a local Hugging Face causal LM; null: build one from the teacher_* sizes "
            "and pretrain it", dict(nullable=True, path="dir")),
           ("teacher_hidden", int, 128, "teacher hidden size when built (a multiple of heads)",
            dict(minimum=1, gpu_default=768)),
           ("teacher_layers", int, 4, "teacher layers when built", dict(minimum=1, gpu_default=8)),
           ("teacher_pretrain_steps", int, 250, "CE steps for a teacher built from a config",
            dict(minimum=0, gpu_default=800)),
           ("teacher_lr", float, None, "the teacher pretraining's LR after its warm-up (null: lr)",
            dict(nullable=True, above=0, gpu_default=1e-3)),
           ("student_path", str, None, "a local Hugging Face causal LM; null: build one from the student_* sizes",
            dict(nullable=True, path="dir")),
           ("student_hidden", int, 64, "student hidden size when built (a multiple of heads)",
            dict(minimum=1, gpu_default=384)),
           ("student_layers", int, 2, "student layers when built", dict(minimum=1, gpu_default=4)),
           ("heads", int, 4, "attention heads of built models", dict(minimum=1, gpu_default=8)),
           ("attention", str, "sdpa", "the models' attention (eager has a deterministic backward on GPUs, for runs "
            "compared bit for bit; sdpa's fused kernels may accumulate with atomics; flex_attention skips the "
            "tiles across packed documents, CUDA only: torch has no flex_attention backward on CPU)",
            dict(choices=("sdpa", "eager", "flex_attention")))),
    *_rows("training",
           ("steps", int, 100, "student optimizer steps (epochs > 0 sets them from the data)",
            dict(minimum=1, gpu_default=300)),
           ("epochs", int, 0, "passes over the training rows, each row once a pass in an order drawn from (seed, "
            "pass); steps = ceil(epochs * training rows / (micro_batches * rows_per_micro_batch)). 0: train `steps` "
            "steps (rows drawn with replacement; pre-tokenized data in passes)", dict(minimum=0)),
           ("lr", float, 3e-3, "AdamW peak learning rate", dict(above=0)),
           ("warmup_steps", int, 10, "linear warm-up steps, then cosine decay to 10 %",
            dict(minimum=0, gpu_default=30)),
           ("grad_clip", float, 1.0, "gradient norm clip", dict(above=0)),
           ("k", int, 32, "teacher top-k entries per token (at most the vocab)", dict(minimum=1, gpu_default=64))),
    *loss_options(),
    *_rows("workers",
           ("teacher_workers", int, 1, "teacher data-parallel workers (one of teacher_workers and student_workers "
            "must divide the other, and both must divide micro_batches)", dict(minimum=1)),
           ("student_workers", int, 1, "student data-parallel workers (gradients summed with gloo / NCCL; the loss is "
            "normalized by the step's global token count)", dict(minimum=1)),
           ("placement", str, "auto", "on GPUs: fused (each teacher / student pair in one process, one GPU a pair; "
            "off_policy from a live teacher, teacher_workers == student_workers; also on the CPU when asked for), "
            "colocated (a teacher and a student worker sharing each GPU) or disaggregated (a GPU each). auto: fused "
            "or, for the other modes, colocated when teacher_workers == student_workers <= GPUs, else disaggregated",
            dict(choices=("auto", "colocated", "disaggregated", "fused"))),
           ("transfer", str, "auto", "how teacher top-k reaches the student (auto: CUDA IPC when colocated, NCCL "
            "when disaggregated, in process when fused, else the object store)",
            dict(choices=("auto", "object_store", "cuda_ipc", "nccl", "in_process"))),
           ("teacher_offload", bool, False, "keep the teacher's weights on the CPU between its scoring calls "
            "(colocated runs short of GPU memory)"),
           ("overlap", bool, True, "score step i + 1 on the teacher while the student trains step i (off-policy; "
            "on-policy generation overlaps training only as max_staleness allows; fused runs its calls one at a "
            "time, so there it only queues the next scoring)")),
    # on-policy distillation (GKD): rollout workers, weight sync, the lmbda schedule (orchestration/onpolicy.py)
    *_rows("on-policy",
           ("mode", str, "off_policy", "off_policy: dataset rows only; on_policy: the student's own samples scored by "
            "the teacher; gkd: a generation round is on-policy with probability lmbda (seeded), else the dataset's "
            "rows (on-policy distillation usually runs divergence reverse_kl or jsd); cache: score the training "
            "rows with the teacher into teacher_cache and stop (resumable: run it again to continue)",
            dict(choices=("off_policy", "on_policy", "gkd", "cache"))),
           ("lmbda", float, 0.5, "gkd: the probability that a round's responses are student-generated (0 to 1)",
            dict(minimum=0)),
           ("sft_alpha", float, 0.0, "gkd / on_policy: the CE weight of dataset-response steps (on-policy steps have "
            "none; ce_weight applies in off_policy mode only)", dict(minimum=0)),
           ("steps_per_generation", int, 1, "optimizer steps trained on the samples of one generation round",
            dict(minimum=1)),
           ("max_staleness", int, 0, "rounds the generating weights may lag: 0 strictly on-policy, 1 generates round "
            "r + 1 while round r trains", dict(choices=(0, 1))),
           ("rollout_workers", int, 1, "rollout workers (Ray actors holding a copy of the student; on GPUs each "
            "shares a student worker's GPU, at most student_workers)", dict(minimum=1)),
           ("weight_sync_bucket_mb", int, 512, "MiB per flattened bucket of the trainer -> rollout weight broadcast",
            dict(minimum=1)),
           ("gen_temperature", float, 1.0, "sampling temperature of the rollouts (0: greedy)", dict(minimum=0)),
           ("top_p", float, 1.0, "nucleus sampling of the rollouts (1: off; at most 1)", dict(above=0)),
           ("top_k", int, 0, "top-k sampling of the rollouts (0: off)", dict(minimum=0)),
           ("max_new_tokens", int, 48, "tokens sampled per response", dict(minimum=1, gpu_default=128)),
           ("max_prompt_tokens", int, 80, "prompts longer than this are skipped and another one drawn (with "
            "max_new_tokens at most row_tokens when the student is built)", dict(minimum=1, gpu_default=384)),
           ("prompts_path", str, None, "JSONL of messages (chat) or prompt/response records (optional "
            "teacher_prompt / teacher_messages for OPSD) whose prompts the student completes; null: the standard "
            "library's functions (signature and docstring). Dataset steps train on data_path's rows (point it at "
            "the same JSONL for GKD's dataset responses)", dict(nullable=True, path="file"))),
    # the offline teacher cache (orchestration/cache_run.py)
    *_rows("teacher cache",
           ("teacher_cache", str, None, "a teacher cache directory: written by mode=cache, read by training (no "
            "teacher model; refused unless made for this tokenizer, data, temperature, k / cache_samples)",
            dict(nullable=True)),
           ("cache_encoding", str, "lossless", "the cache's entries: lossless (bf16 log-probs, 4.25 B an entry at "
            "V = 152k) or compact (3 B an entry all told from k = 8 on at V = 152k, log-probs quantized from the "
            "row's maximum)",
            dict(choices=("lossless", "compact"))),
           ("cache_samples", int, 0, "0: the cache holds the top-k (k a position); n > 0: n teacher samples a "
            "position (train them with support=sampled)", dict(minimum=0)),
           ("cache_rows_per_shard", int, 64, "rows a cache shard holds (a killed write resumes at a shard)",
            dict(minimum=1))),
    *_rows("checkpoints",
           ("checkpoint_every", int, 40, "save the student every N steps (0: only at the end and on Ctrl-C)",
            dict(minimum=0, gpu_default=100)),
           ("resume", bool, False, "continue from the newest checkpoint in output_dir that verifies (also: "
            "--resume)"),
           ("overwrite", bool, False, "a fresh run in an output_dir that holds checkpoints deletes them (false: "
            "refused, so a later resume never picks another run's checkpoint)")),
    # real checkpoints at scale: sharded students, HF export, evaluation, monitoring, a Ray cluster
    *_rows("scale",
           ("student_strategy", str, "replica", "replica: every student worker holds the whole model and its AdamW "
            "state (tiny models); fsdp2: the student sharded over the student workers (FSDP2, bf16 compute with "
            "float32 master weights on GPUs)", dict(choices=("replica", "fsdp2"))),
           ("activation_checkpointing", bool, False, "recompute each student decoder layer in the backward"),
           ("compile", str, "auto", "torch.compile each decoder layer of the student and of the teacher (inductor, "
            "in place: checkpoints and exports unchanged; not the on-policy rollout copy); the first step pays the "
            "compilation, and each new shape (a held-out chunk) again. auto: off-policy runs on GPUs with a replica "
            "student (measured faster, benchmarks/RESULTS.md) of models that name their decoder layers; eager on "
            "the CPU, on-policy, in cache runs and with fsdp2",
            dict(choices=("auto", "true", "false"))),
           ("weight_decay", float, 0.01, "AdamW weight decay of the student's matrices (none on norms and biases)",
            dict(minimum=0)),
           ("adam_beta1", float, 0.9, "AdamW beta1", dict(minimum=0)),
           ("adam_beta2", float, 0.999, "AdamW beta2", dict(minimum=0)),
           ("eval_every", int, 0, "held-out CE and KD of the student every N steps and at the last (0: only the "
            "end-of-run CE)", dict(minimum=0)),
           ("tensorboard", bool, False, "also write TensorBoard event files beside metrics.jsonl (needs the "
            "tensorboard package)"),
           ("export", bool, False, "save the final student with save_pretrained into output_dir/final (with the "
            "tokenizer)"),
           ("ray_address", str, None, "join a running Ray cluster ('auto' or HOST:PORT; also: --address); null: "
            "start a local Ray", dict(nullable=True))),
    *_rows("testing",
           ("stop_after", int, None, "stop after this step (tests of resume)", dict(nullable=True, minimum=0)),
           ("fail_student_at_step", int, None, "fault injection: the student worker's process exits at this step",
            dict(nullable=True, minimum=0))),
])

OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}
LOSS_OPTION_NAMES = tuple(option.name for option in OPTIONS if option.api_field)
GPU_DEFAULTS = {option.name: option.gpu_default for option in OPTIONS if option.gpu_default is not UNSET}
