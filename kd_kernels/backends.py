"""Which implementation runs an op: "torch" (the reference), "triton", or "cuda" (compiled).

Nothing here imports Triton or the CUDA extension until a backend is asked about, so
``import kd_kernels`` stays light. Each failure to load is recorded and shown by
`available_backends()`; ``backend="auto"`` warns once when it has to fall back on a GPU.
"""
from __future__ import annotations

import functools
import os
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
        return True, f"triton {triton.__version__} under TRITON_INTERPRET=1 (CPU, slow, tests only)"
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"


@functools.lru_cache(maxsize=None)
def _cuda_status() -> tuple[bool, str]:
    try:
        from . import _C
    except ImportError as error:
        return False, (f"the CUDA extension kd_kernels._C is not built ({error}); on a machine with nvcc and a CUDA "
                       "build of torch: KD_KERNELS_BUILD_CUDA=1 python -m pip install --no-build-isolation .")
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
