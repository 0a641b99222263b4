"""The run configuration: defaults, a YAML file on top, ``--set key=value`` on top, GPU
defaults for what was not set on a CUDA device; every option checked before any work.

`load_config` reports every problem at once, one line each (`UsageError.lines`), each
naming the option, the value and what is expected: types, ranges and choices from the
option table (`options.OPTIONS`), the loss options through `kd_kernels.DivergenceOptions`,
cross-option rules, and what the machine and the disk must offer (paths, a writable
output_dir, checkpoints to resume, GPUs for the placement). No torch, Ray or transformers
import happens here on a CPU machine.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tempfile
from typing import Optional

import kd_kernels as kd

from . import checkpoint
from .comm_plan import CommPlan
from .errors import UsageError
from .options import GPU_DEFAULTS, LOSS_OPTION_NAMES, OPTIONS, OPTIONS_BY_NAME, UNSET
from .placement import device_type, gpu_count, resolve_layout


def _check_config(self) -> None:
    """Config.__post_init__: each value parsed by its option (floats given as ints become
    floats), then the cross-option rules; UsageError with every problem."""
    problems, bad = [], set()
    for option in OPTIONS:
        try:
            object.__setattr__(self, option.name, option.parse(getattr(self, option.name)))
        except ValueError as error:
            problems.append(f"{option.name}: expected {error}, got {getattr(self, option.name)!r}")
            bad.add(option.name)
    problems += check_rules(vars(self), bad)
    if problems:
        raise UsageError(problems)


def _loss_options(self) -> dict:
    """The keyword arguments of kd.topk_divergence that the options set (divergence,
    support, temperature, weights, beta, ...): the fields of kd.DivergenceOptions the driver
    does not own."""
    return {name: getattr(self, name) for name in LOSS_OPTION_NAMES}


Config = dataclasses.make_dataclass(
    "Config", [(option.name, option.annotation, dataclasses.field(default=option.default)) for option in OPTIONS],
    namespace=dict(__post_init__=_check_config, loss_options=_loss_options,
                   __doc__="One run's options (fields: `options.OPTIONS`); checked when built."),
    frozen=True)
Config.__module__ = __name__  # pickled by reference (Ray sends it to the workers)


# ---- cross-option rules: (the options they read, the check); skipped if one of them is bad --

def _comm_plan(values: dict) -> Optional[str]:
    try:
        CommPlan(values["teacher_workers"], values["student_workers"], values["micro_batches"])
    except ValueError as error:
        return str(error)
    return None


def _heads_divide(side: str):
    def check(values: dict) -> Optional[str]:
        hidden, heads = values[f"{side}_hidden"], values["heads"]
        if values[f"{side}_path"] is None and hidden % heads:
            return f"{side}_hidden: expected a multiple of heads ({heads}), got {hidden}"
        return None
    return check


def _k_within_trained_vocab(values: dict) -> Optional[str]:
    if values["tokenizer_path"] is None and values["k"] > values["tokenizer_vocab"]:
        return f"k: expected at most the vocab (tokenizer_vocab = {values['tokenizer_vocab']}), got {values['k']}"
    return None


def _chat_template(values: dict) -> Optional[str]:
    template = values["chat_template"]
    if template is None:
        return None
    try:
        template.format(prompt="", response="")
    except (KeyError, IndexError, ValueError) as error:
        return (f"chat_template: expected a format string with only {{prompt}} and {{response}} fields, got "
                f"{template!r} ({error.__class__.__name__}: {error})")
    if "{prompt}" not in template or "{response}" not in template:
        return f"chat_template: expected both {{prompt}} and {{response}}, got {template!r}"
    return None


def _divergence_options(values: dict) -> Optional[str]:
    """The loss options together (each one alone was checked already)."""
    try:
        kd.DivergenceOptions(**{name: values[name] for name in LOSS_OPTION_NAMES})
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def _adam_betas(values: dict) -> Optional[str]:
    bad = [f"{name}={values[name]}" for name in ("adam_beta1", "adam_beta2") if not values[name] < 1]
    return f"adam_beta1, adam_beta2: expected each in [0, 1), got {', '.join(bad)}" if bad else None


def _on_policy(values: dict) -> Optional[str]:
    """The GKD schedule and sampling options together, and a prompt + response that fits a built student."""
    from .gkd import GkdSchedule

    if values["mode"] == "cache":  # scoring, no training schedule
        return None
    try:
        GkdSchedule(values["mode"], values["lmbda"], values["sft_alpha"], values["steps_per_generation"],
                    values["max_staleness"], values["seed"])
    except ValueError as error:
        return str(error)
    if values["top_p"] > 1:
        return f"top_p: expected a value in (0, 1], got {values['top_p']}"
    if values["mode"] in ("on_policy", "gkd") and values["student_strategy"] != "replica":
        return (f"student_strategy: mode {values['mode']} trains replicas (the rollout workers sync from one whole "
                f"student), got {values['student_strategy']!r}")
    if values["teacher_cache"] and values["mode"] != "cache" and values["student_strategy"] == "fsdp2":
        return ("student_strategy: fsdp2 takes its held-out CE from the teacher's top-k, which a run from a "
                "teacher_cache has no model to compute; train replicas from a cache")
    if values["teacher_cache"] and values["mode"] != "cache" and values["eval_every"]:
        return ("eval_every: a run from a teacher_cache has no teacher model to score the held-out rows; "
                f"set eval_every=0 (the student's held-out CE is still reported at the end), got {values['eval_every']}")
    if values["mode"] in ("on_policy", "gkd") and values["teacher_cache"]:
        return f"teacher_cache: mode {values['mode']} scores the student's own samples with a live teacher; unset it"
    longest = values["max_prompt_tokens"] + values["max_new_tokens"]
    if values["mode"] != "off_policy" and values["student_path"] is None and longest > values["row_tokens"]:
        return (f"max_prompt_tokens + max_new_tokens: expected at most row_tokens ({values['row_tokens']}, the built "
                f"models' positions), got {longest}")
    return None


def _flex_attention(values: dict) -> Optional[str]:
    if values["attention"] == "flex_attention" and values["mode"] in ("on_policy", "gkd"):
        return (f"attention: flex_attention is for training on packed rows; mode {values['mode']} generates with "
                "the student's attention (Hugging Face generate, a KV cache): use sdpa or eager")
    return None


def fused_allowed(values: dict) -> bool:
    """Whether placement auto may choose fused: off-policy training from a live teacher."""
    return values["mode"] == "off_policy" and not values["teacher_cache"]


def _fused(values: dict) -> Optional[str]:
    """placement fused: off-policy from a live teacher, each micro-batch scored in its student's process."""
    if values["placement"] != "fused":
        return None
    if values["mode"] in ("on_policy", "gkd"):
        return (f"placement: fused runs mode off_policy (the on-policy loop's rollout and weight-sync workers are "
                f"separate actors); use colocated for mode {values['mode']}")
    if values["mode"] == "cache":
        return "placement: fused pairs a teacher with a student; mode cache scores with teachers alone (use auto)"
    if values["teacher_cache"]:
        return "placement: fused pairs a live teacher with each student; a run from a teacher_cache uses colocated"
    # with teacher_workers == student_workers (resolve_layout refuses others) the plan keeps each
    # micro-batch in its pair's process
    return None


RULES = (
    (("adam_beta1", "adam_beta2"), _adam_betas),
    (("teacher_workers", "student_workers", "micro_batches"), _comm_plan),
    (("teacher_hidden", "teacher_path", "heads"), _heads_divide("teacher")),
    (("student_hidden", "student_path", "heads"), _heads_divide("student")),
    (("k", "tokenizer_vocab", "tokenizer_path"), _k_within_trained_vocab),
    (("chat_template",), _chat_template),
    (LOSS_OPTION_NAMES, _divergence_options),
    (("mode", "lmbda", "sft_alpha", "steps_per_generation", "max_staleness", "seed", "top_p", "max_prompt_tokens",
      "max_new_tokens", "row_tokens", "student_path", "student_strategy", "teacher_cache", "eval_every"),
     _on_policy),
    (("attention", "mode"), _flex_attention),
    (("placement", "mode", "teacher_cache", "teacher_workers", "student_workers", "micro_batches"), _fused),
)


def check_rules(values: dict, bad: set, sources: Optional[dict] = None) -> list[str]:
    """Problems of the parsed ``values`` beyond each option's type and range: each loss
    option through kd.DivergenceOptions, then `RULES`. Options in ``bad`` are skipped."""
    problems = []
    for name in LOSS_OPTION_NAMES:
        if name in bad:
            continue
        try:
            kd.DivergenceOptions(**{name: values[name]})
        except (ValueError, TypeError) as error:
            problems.append(_sourced(str(error), name, sources))
            bad.add(name)
    for names, rule in RULES:
        if not bad.intersection(names) and (problem := rule(values)):
            problems.append(problem)
    return problems


def _sourced(line: str, name: str, sources: Optional[dict]) -> str:
    return f"{line} ({sources[name]})" if sources and name in sources else line


# ---- what the disk and the machine must offer -----------------------------------------------

def _trained_tokenizer_vocab(directory: str) -> Optional[int]:
    """The vocab of a saved tokenizer, read from its tokenizer.json or vocab.json (None: neither)."""
    try:
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as handle:
            saved = json.load(handle)
        ids = set(saved["model"]["vocab"].values()) | {token["id"] for token in saved.get("added_tokens", [])}
        return len(ids)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        with open(os.path.join(directory, "vocab.json"), encoding="utf-8") as handle:
            return len(json.load(handle))
    except (OSError, ValueError):
        return None


def _output_dir_problem(path: str) -> Optional[str]:
    if os.path.exists(path) and not os.path.isdir(path):
        return f"output_dir: expected a directory, got {path!r}, which is a file"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:  # a probe, not os.access: root passes os.access on read-only file systems too
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"output_dir: expected a writable directory, got {path!r} ({existing}: {error.strerror})"
    return None


def _path_problem(name: str, path: str, kind: str) -> Optional[str]:
    if kind == "output":
        return _output_dir_problem(path)
    if kind == "file" and not os.path.isfile(path):
        return f"{name}: expected an existing file, got {path!r}"
    if kind == "dir" and not os.path.isdir(path):
        return f"{name}: expected an existing directory, got {path!r}"
    return None


def check_machine(values: dict, bad: set, sources: Optional[dict] = None) -> list[str]:
    """Problems of the run on this machine and disk: paths, the tokenizer's vocab against k,
    checkpoints for resume (or in the way of a fresh run), the device and GPUs for the
    placement and transfer."""
    problems = []
    for option in OPTIONS:
        value = values[option.name]
        if option.path and value is not None and option.name not in bad:
            if problem := _path_problem(option.name, value, option.path):
                problems.append(_sourced(problem, option.name, sources))
                bad.add(option.name)
    if not bad.intersection(("tokenizer_path", "k")) and values["tokenizer_path"] is not None:
        vocab = _trained_tokenizer_vocab(values["tokenizer_path"])
        if vocab is not None and values["k"] > vocab:
            problems.append(f"k: expected at most the vocab of tokenizer_path ({vocab}), got {values['k']}")
    if not bad.intersection(("output_dir", "resume", "overwrite")):
        problems += _checkpoint_problems(values)
    if not bad.intersection(("device", "placement", "transfer", "teacher_workers", "student_workers")):
        device = device_type(values["device"])
        gpus = gpu_count() if device == "cuda" else 0
        if values["device"] == "cuda" and gpus == 0:
            problems.append("device: 'cuda' needs a CUDA device and torch sees none (use cpu or auto)")
        else:
            try:
                resolve_layout(values["placement"], values["transfer"], device, gpus, values["teacher_workers"],
                               values["student_workers"], fused_allowed=fused_allowed(values))
            except ValueError as error:
                problems.append(str(error))
        if "attention" not in bad and values["attention"] == "flex_attention" and device == "cpu":
            problems.append(f"attention: flex_attention trains on CUDA only (torch has no flex_attention backward on "
                            f"the CPU) and device {values['device']!r} runs on the CPU; use sdpa or eager")
    return problems


def _checkpoint_problems(values: dict) -> list[str]:
    found = checkpoint.candidates(values["output_dir"])
    where = checkpoint.directory_of(values["output_dir"])
    if values["resume"] and not found:
        return [f"resume: no checkpoint to resume from in {where} (looked for step_NNNNNNN/ directories); "
                "run without --resume to start"]
    if not values["resume"] and found and not values["overwrite"]:
        return [f"output_dir: {values['output_dir']!r} holds checkpoints of an earlier run (newest "
                f"{os.path.basename(found[0])}): pass --resume to continue it, --set overwrite=true to replace "
                "it, or another output_dir"]
    return []


# ---- loading -------------------------------------------------------------------------------

def _unknown(key, where: str) -> str:
    close = difflib.get_close_matches(str(key), OPTIONS_BY_NAME, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else " (see --help)"
    return f"{where}: unknown option {key!r}{hint}"


def _read_yaml(path: str) -> tuple[dict, list[str]]:
    """(the file's mapping, problems) for a YAML config file."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle)
    except FileNotFoundError:
        return {}, [f"config: no such file: {path!r}"]
    except IsADirectoryError:
        return {}, [f"config: expected a YAML file, got the directory {path!r}"]
    except OSError as error:
        return {}, [f"config: cannot read {path!r} ({error.strerror})"]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or error.__class__.__name__
        return {}, [f"config: {path!r} is not valid YAML{where}: {problem}"]
    if loaded is None:
        return {}, []
    if not isinstance(loaded, dict):
        return {}, [f"config: expected a mapping of option: value at the top level of {path!r}, got a "
                    f"{type(loaded).__name__}"]
    return loaded, []


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, resume: bool = False) -> Config:
    """Defaults, then the YAML file ``path``, then ``key=value`` ``overrides``, then
    ``resume``; on a CUDA device the GPU default of every option not set. Raises UsageError
    with every problem (one line each): the values (`check_rules`), the disk and the machine
    (`check_machine`)."""
    import yaml

    values = {option.name: option.default for option in OPTIONS}
    sources, bad, problems = {}, set(), []
    given = []  # (name, value, raw text or None, source)
    if path:
        loaded, problems = _read_yaml(path)
        for key, value in loaded.items():
            if key in OPTIONS_BY_NAME:
                given.append((key, value, None, path))
            else:
                problems.append(_unknown(key, path))
    for override in overrides or []:
        key, separator, text = override.partition("=")
        key = key.strip()
        if not separator:
            problems.append(f"--set {override!r}: expected KEY=VALUE")
        elif key not in OPTIONS_BY_NAME:
            problems.append(_unknown(key, f"--set {override}"))
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
            given.append((key, value, text, f"--set {override}"))
    if resume:
        given.append(("resume", True, None, "--resume"))
    for name, value, text, source in given:
        sources[name] = source
        try:
            values[name] = OPTIONS_BY_NAME[name].parse(value, text)
            bad.discard(name)
        except ValueError as error:
            shown = text if text is not None else value
            problems.append(f"{name}: expected {error}, got {shown!r} ({source})")
            bad.add(name)
    if "device" not in bad and device_type(values["device"]) == "cuda":
        values.update({name: value for name, value in GPU_DEFAULTS.items() if name not in sources})
    problems += check_rules(values, bad, sources)
    problems += check_machine(values, bad, sources)
    if problems:
        raise UsageError(problems)
    return Config(**values)


# ---- help and docs -------------------------------------------------------------------------

def _shown(value) -> str:
    """A value as YAML spells it (null, true) or as Python does (strings quoted)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def help_text() -> str:
    """Every option with its allowed values, default and GPU default, by section."""
    lines = ["options (YAML keys, or --set key=value; on a CUDA device an option not set takes its GPU default):"]
    section = None
    for option in OPTIONS:
        if option.section != section:
            section = option.section
            lines.append(f" {section}:")
        gpu = f", GPU {_shown(option.gpu_default)}" if option.gpu_default is not UNSET else ""
        lines.append(f"  {option.name} = {_shown(option.default)}{gpu}  ({option.expected()}) {option.help}")
    return "\n".join(lines)


def options_markdown() -> str:
    """The option table as Markdown, for the docs."""
    lines = ["| option | allowed | default | GPU default | what |", "| --- | --- | --- | --- | --- |"]
    for option in OPTIONS:
        gpu = f"`{_shown(option.gpu_default)}`" if option.gpu_default is not UNSET else ""
        lines.append(f"| `{option.name}` | {option.expected()} | `{_shown(option.default)}` | {gpu} | "
                     f"{option.help.replace('|', '/')} |")
    return "\n".join(lines)
