"""The GKD step schedule: lmbda 0 / 1 reproduce off- / on-policy exactly, the choice is a function
of (seed, round), rounds of steps_per_generation steps, sft_alpha on dataset steps, staleness."""
import math

import pytest

from orchestration.gkd import GkdSchedule, StepPlan

STEPS = range(200)


@pytest.mark.parametrize("steps_per_generation, sft_alpha", [(1, 0.0), (3, 0.5)])
def test_lmbda_zero_is_off_policy_and_one_is_on_policy(steps_per_generation, sft_alpha):
    def plans(**options):
        schedule = GkdSchedule(steps_per_generation=steps_per_generation, sft_alpha=sft_alpha, seed=11, **options)
        return [schedule.plan(step) for step in STEPS]

    off = plans(mode="off_policy")
    assert plans(mode="gkd", lmbda=0.0) == off
    assert all(not p.on_policy and not p.generate and p.ce_weight == sft_alpha for p in off)
    on = plans(mode="on_policy")
    assert plans(mode="gkd", lmbda=1.0) == on
    assert all(p.on_policy and p.ce_weight == 0.0 for p in on)
    assert [p.step for p in on if p.generate] == list(range(0, len(STEPS), steps_per_generation))


def test_the_choice_is_a_function_of_seed_and_round():
    schedule = GkdSchedule(mode="gkd", lmbda=0.3, steps_per_generation=4, seed=5)
    forward = [schedule.plan(step) for step in STEPS]
    backward = [GkdSchedule(mode="gkd", lmbda=0.3, steps_per_generation=4, seed=5).plan(step)
                for step in reversed(STEPS)][::-1]
    assert forward == backward  # a resumed run at any step makes the same choices
    for plan in forward:  # a round's steps share its choice; each takes its share of the samples
        assert plan.round == plan.step // 4 and plan.share == plan.step % 4
        assert plan.on_policy == forward[plan.round * 4].on_policy
        assert plan.generate == (plan.on_policy and plan.share == 0)
    other_seed = [GkdSchedule(mode="gkd", lmbda=0.3, steps_per_generation=4, seed=6).plan(s).on_policy for s in STEPS]
    assert other_seed != [plan.on_policy for plan in forward]


@pytest.mark.parametrize("lmbda", [0.2, 0.5, 0.9])
def test_a_round_is_on_policy_with_probability_lmbda(lmbda):
    rounds = 4000
    schedule = GkdSchedule(mode="gkd", lmbda=lmbda, seed=1)
    share = sum(schedule.round_is_on_policy(r) for r in range(rounds)) / rounds
    assert abs(share - lmbda) < 4 * math.sqrt(lmbda * (1 - lmbda) / rounds)


def test_staleness_bounds_the_weights_that_generate_a_round():
    strict = GkdSchedule(mode="on_policy", steps_per_generation=2)
    relaxed = GkdSchedule(mode="on_policy", steps_per_generation=2, max_staleness=1)
    assert [strict.plan(s).min_weights_step for s in (0, 1, 2, 3, 4)] == [0, 0, 2, 2, 4]
    assert [relaxed.plan(s).min_weights_step for s in (0, 1, 2, 3, 4)] == [0, 0, 0, 0, 2]
    assert strict.may_generate(2, 4) and not strict.may_generate(2, 3)
    assert relaxed.may_generate(2, 2) and not relaxed.may_generate(2, 1)
    assert GkdSchedule(mode="off_policy").plan(7) == StepPlan(7, 7, False, False, 0, 0.0, 0)


@pytest.mark.parametrize("options, message", [
    (dict(mode="online"), "mode: expected one of off_policy | on_policy | gkd, got 'online'"),
    (dict(lmbda=1.5), "lmbda: expected a probability in \\[0, 1\\], got 1.5"),
    (dict(sft_alpha=-1.0), "sft_alpha: expected >= 0, got -1.0"),
    (dict(steps_per_generation=0), "steps_per_generation: expected an int >= 1, got 0"),
    (dict(max_staleness=-1), "max_staleness: expected an int >= 0, got -1"),
    (dict(max_staleness=True), "max_staleness: expected an int >= 0, got True"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GkdSchedule(**options)
    with pytest.raises(ValueError, match="step: expected an int >= 0, got -1"):
        GkdSchedule().plan(-1)
