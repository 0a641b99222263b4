"""The frozen options that travel from the public API through autograd to the kernels."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DIVERGENCES = (
    "forward_kl",
    "reverse_kl",
    "jsd",
    "skewed_forward_kl",
    "skewed_reverse_kl",
    "adaptive_kl",
    "tvd",
)
SUPPORTS = ("renormalized", "tail", "sampled")
REDUCTIONS = ("mean", "sum", "none")

# Floors of the SPEC: a tail bin never drops below this mass (a divergence stays finite),
# and adaptive KL divides by (g_head + g_tail + ADAPTIVE_EPS).
TAIL_FLOOR = 1e-8
ADAPTIVE_EPS = 1e-8


@dataclass(frozen=True)
class DivergenceOptions:
    """Everything about the student loss that is not a tensor.

    ``temperature`` is the student temperature τ_s; ``vocab_size`` is the global V*
    (None: every column of the lm_head / logits exists).
    """

    divergence: str = "forward_kl"
    support: str = "renormalized"
    temperature: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    beta: float = 0.5
    skew_lambda: float = 0.1
    adaptive_alpha: float = 0.5
    ignore_index: int = -100
    reduction: str = "mean"
    vocab_size: Optional[int] = None

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_choice("support", self.support, SUPPORTS)
        check_choice("reduction", self.reduction, REDUCTIONS)
        if self.support == "sampled" and self.divergence == "adaptive_kl":
            raise ValueError("divergence: 'adaptive_kl' has no unbiased sampled form (its head/tail split sorts the "
                             "whole vocab), so support='sampled' refuses it; use forward_kl, reverse_kl, jsd, "
                             "skewed_forward_kl, skewed_reverse_kl or tvd, or support='tail'")
        check_temperature(self.temperature)
        for name in ("beta", "skew_lambda", "adaptive_alpha"):
            check_unit_interval(name, getattr(self, name))
        for name in ("kd_weight", "ce_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index: expected an int, got {type(self.ignore_index).__name__}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"vocab_size: expected None or an int >= 1, got {self.vocab_size!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def check_temperature(temperature) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")


def check_unit_interval(name: str, value) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
