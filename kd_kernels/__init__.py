"""kd_kernels: fused kernels for large-vocabulary LLM knowledge distillation.

``import kd_kernels`` is cheap: torch, Triton and the CUDA extension load on first use.
The contract (math, numerics, bad input) is docs/SPEC.md.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "TopK": "topk",
    "TeacherSamples": "samples",
    "DivergenceOptions": "options",
    "teacher_topk": "api",
    "teacher_topk_from_logits": "api",
    "teacher_sample": "api",
    "teacher_sample_from_logits": "api",
    "topk_divergence": "api",
    "topk_divergence_from_logits": "api",
    "available_backends": "backends",
    "TopKDivergenceLoss": "nn",
}
_SUBMODULES = ("reference", "api", "backends", "nn", "options", "samples", "sampling", "support", "topk",
               "validation")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'kd_kernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__ + ["__version__"]
