"""Which responses each training step uses: GKD's choice between student-generated samples and
the dataset's responses (Agarwal et al. 2024), as a pure function of (seed, step).

Steps come in *generation rounds* of ``steps_per_generation`` steps: one generation produces the
responses of a whole round (each step takes its share). A round is on-policy (student-generated
responses, scored by the teacher) or off-policy (the dataset's responses):

- ``off_policy``: every round off-policy;
- ``on_policy``: every round on-policy;
- ``gkd``: a round is on-policy with probability ``lmbda``, drawn from a generator seeded with
  (seed, round) alone, so a resumed run makes the same choices and ``lmbda`` 0 gives exactly the
  off-policy plans (and 1 the on-policy ones).

``sft_alpha`` weights the cross-entropy on the dataset's response tokens; an on-policy step has no
CE term (its labels are the student's own samples). ``max_staleness`` (in rounds) bounds how old
the weights generating a round may be: the responses of round ``r`` come from weights trained for
at least ``(r - max_staleness) * steps_per_generation`` steps; 0 is strictly on-policy (round
``r`` is generated only after the weights of its previous step are synced), 1 lets round ``r``
be generated while round ``r - 1`` trains.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("off_policy", "on_policy", "gkd")
_ROUND_STREAM = 2  # the round choice's random stream, distinct from other (seed, step) streams


@dataclass(frozen=True)
class StepPlan:
    """What step ``step`` does. ``on_policy``: its responses are student-generated;
    ``generate``: it is the first step of an on-policy round (the round's samples must be
    generated before it trains); ``share``: which of the round's ``steps_per_generation`` shares
    of samples it trains on; ``ce_weight``: the weight of its CE term; ``min_weights_step``: the
    least number of trained steps in the weights that generate its samples (on-policy only)."""
    step: int
    round: int
    on_policy: bool
    generate: bool
    share: int
    ce_weight: float
    min_weights_step: int


@dataclass(frozen=True)
class GkdSchedule:
    """The on-policy / off-policy choice of every step (module docstring)."""
    mode: str = "off_policy"
    lmbda: float = 0.5
    sft_alpha: float = 0.0
    steps_per_generation: int = 1
    max_staleness: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {' | '.join(MODES)}, got {self.mode!r}")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda: expected a probability in [0, 1], got {self.lmbda!r}")
        if not self.sft_alpha >= 0.0:
            raise ValueError(f"sft_alpha: expected >= 0, got {self.sft_alpha!r}")
        for name in ("steps_per_generation", "max_staleness"):
            value, least = getattr(self, name), 1 if name == "steps_per_generation" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")

    def round_is_on_policy(self, round_index: int) -> bool:
        if self.mode != "gkd":
            return self.mode == "on_policy"
        return bool(np.random.default_rng([self.seed, _ROUND_STREAM, round_index]).random() < self.lmbda)

    def plan(self, step: int) -> StepPlan:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        round_index, share = divmod(step, self.steps_per_generation)
        on_policy = self.round_is_on_policy(round_index)
        least = max(0, (round_index - self.max_staleness) * self.steps_per_generation)
        return StepPlan(step=step, round=round_index, on_policy=on_policy, generate=on_policy and share == 0,
                        share=share, ce_weight=0.0 if on_policy else self.sft_alpha,
                        min_weights_step=least if on_policy else 0)

    def may_generate(self, round_index: int, weights_step: int) -> bool:
        """Whether weights trained for ``weights_step`` steps are fresh enough to generate round
        ``round_index`` (``max_staleness``)."""
        return weights_step >= max(0, (round_index - self.max_staleness) * self.steps_per_generation)
