"""Which implementation runs an op: "torch" (the reference), "triton", or "cuda" (compiled).

Nothing here imports Triton or the CUDA extension until a backend is asked about, so
``import kd_kernels`` stays light. Each failure to load is recorded and shown by
`available_backends()`; ``backend="auto"`` warns once when it has to fall back on a GPU.
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import os
import sys
import warnings

import torch

BACKENDS = ("auto", "cuda", "triton", "torch")

# The largest k of the CUDA top-k kernel (csrc/topk_candidates.h kMaxTopK; a GPU test checks they agree).
CUDA_MAX_TOPK = 1024

# The ops each compiled backend implements; the torch reference implements all of them.
_IMPLEMENTED = {
    "triton": frozenset({"topk_divergence", "topk_divergence_from_logits", "teacher_topk",
                         "teacher_topk_from_logits", "teacher_sample", "teacher_sample_from_logits"}),
    "cuda": frozenset({"teacher_topk", "teacher_topk_from_logits"}),
}


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _triton_status() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as error:  # ImportError, or a broken install raising anything else
        return False, f"triton failed to import: {error!r}"
    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} on CUDA"
    if triton_interpreter_enabled():
        return True, (f"triton {triton.__version__} under TRITON_INTERPRET=1 (CPU, slow, tests only; bf16 teacher_topk "
                      "refused: the interpreter's bf16 tl.dot is wrong; it takes effect when set before Python starts)")
    return False, ("no CUDA device (to run the kernels on CPU, slowly, set TRITON_INTERPRET=1 before Python starts: "
                   "the kernels read it when they are defined, and this status is cached)")


# the documented GPU install: kd_kernels/_C*.so built in place, so that the source tree has it
GPU_INSTALL = 'KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation -e ".[triton]"'


def _extension_files(package_dir: str) -> list[str]:
    """The compiled ``_C`` modules (any of this Python's extension suffixes) in ``package_dir``."""
    names = ["_C" + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    return [os.path.join(package_dir, name) for name in names if os.path.isfile(os.path.join(package_dir, name))]


def _installed_extensions_elsewhere(package_dir: str) -> list[str]:
    """Built ``kd_kernels/_C*`` modules of other copies of the package than ``package_dir``: the
    installed distribution's files (importlib.metadata) and every ``kd_kernels`` folder on
    sys.path; none of them is imported."""
    found = []
    try:
        distribution = importlib.metadata.distribution("kd_kernels")
        found += [str(distribution.locate_file(file)) for file in distribution.files or ()
                  if file.parent.name == "kd_kernels" and file.name.startswith("_C.")]
    except importlib.metadata.PackageNotFoundError:
        pass
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec("kd_kernels", [entry or os.getcwd()])
        for location in (spec.submodule_search_locations or []) if spec else []:
            found += _extension_files(location)
    here = os.path.realpath(package_dir)
    elsewhere = [path for path in found if os.path.isfile(path) and os.path.realpath(os.path.dirname(path)) != here]
    return list(dict.fromkeys(os.path.realpath(path) for path in elsewhere))


def _extension_missing_reason(package_dir: str, error: ImportError) -> str:
    """Why ``from kd_kernels import _C`` failed for the package in ``package_dir``, and what to do."""
    built_here = _extension_files(package_dir)
    if built_here:
        return (f"kd_kernels._C at {built_here[0]} failed to load ({error}); rebuild it against this torch: "
                f"{GPU_INSTALL} from the repository root")
    elsewhere = _installed_extensions_elsewhere(package_dir)
    if elsewhere:
        return (f"the kd_kernels imported ({package_dir}) has no CUDA extension, but an installed kd_kernels has it "
                f"({elsewhere[0]}): this source tree shadows the installed package. Run from another directory, or "
                f"build the extension in place with the editable install: {GPU_INSTALL}")
    return (f"the CUDA extension kd_kernels._C is not built in {package_dir} ({error}); on a machine with nvcc and a "
            f"CUDA build of torch, from the repository root: {GPU_INSTALL}")


@functools.lru_cache(maxsize=None)
def _cuda_status() -> tuple[bool, str]:
    try:
        from . import _C
    except ImportError as error:
        return False, _extension_missing_reason(os.path.dirname(os.path.abspath(__file__)), error)
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built but there is no CUDA device"
    return True, f"kd_kernels._C built for torch {torch.__version__}, top-k up to k = {_C.MAX_TOPK}"


def available_backends() -> dict[str, str]:
    """``{backend: "available: ..." | "unavailable: <reason>"}`` for torch, triton and cuda."""
    report = {"torch": "available: reference PyTorch, float64, materializes logits"}
    for name, status in (("triton", _triton_status()), ("cuda", _cuda_status())):
        ok, reason = status
        ops = ", ".join(sorted(_IMPLEMENTED[name])) or "none"
        report[name] = f"{'available' if ok else 'unavailable'}: {reason}; ops: {ops}"
    return report


def _usable(backend: str, op: str) -> tuple[bool, str]:
    ok, reason = (_triton_status() if backend == "triton" else _cuda_status())
    if ok and op not in _IMPLEMENTED[backend]:
        return False, f"{op} is not implemented by the {backend} backend"
    return ok, reason


def resolve_backend(requested: str, op: str, device: torch.device, skip_cuda: bool = False) -> str:
    """The backend that runs ``op`` on ``device``: the one requested, or for "auto" the best
    available (cuda, then triton, on a GPU; torch on CPU). Raises if a requested one cannot.
    ``skip_cuda``: "auto" passes over cuda (its kernel does not take these arguments)."""
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {requested!r}")
    if requested == "torch":
        return "torch"
    if requested != "auto":
        ok, reason = _usable(requested, op)
        if not ok:
            raise RuntimeError(f"backend={requested!r} cannot run {op}: {reason}")
        if device.type == "cpu" and not triton_interpreter_enabled():
            raise ValueError(f"backend={requested!r}: inputs are on the CPU; move them to a CUDA device")
        return requested
    if device.type != "cuda":
        return "torch"
    reasons = []
    for candidate in ("cuda", "triton"):
        if candidate == "cuda" and skip_cuda:
            reasons.append("cuda: does not take these arguments")
            continue
        ok, reason = _usable(candidate, op)
        if ok:
            return candidate
        reasons.append(f"{candidate}: {reason}")
    _warn_fallback(op, "; ".join(reasons))
    return "torch"


@functools.lru_cache(maxsize=None)
def _warn_fallback(op: str, reasons: str) -> None:
    warnings.warn(f"kd_kernels: {op} on CUDA falls back to the float64 torch reference ({reasons})", RuntimeWarning,
                  stacklevel=3)
