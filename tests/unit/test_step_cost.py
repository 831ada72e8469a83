"""The step-cost fit behind ``--target-step-ms`` (shared/engine/step_cost.py): it recovers a known linear cost
from steps timed by that cost, stays near it when the times are noisy and some steps stall, gives the prompt
tokens a target leaves between its floor and its ceiling, and trusts nothing before it is warm. Times are
made up from the model, never measured: nothing here sleeps or reads a clock."""

import random

import pytest

from kvrelay.shared.engine.step_cost import StepCost, StepShape

TRUE = (4e-3, 3e-5, 2e-8, 2.5e-5)  # seconds: fixed, per decode row, per decode context token, per prompt token


def cost(shape: StepShape, coef=TRUE) -> float:
    fixed, per_row, per_context, per_prompt = coef
    return fixed + per_row * shape.decode_rows + per_context * shape.decode_context + per_prompt * shape.prompt_tokens


def shapes(n: int, seed: int = 0) -> list[StepShape]:
    """Steps as unified serving makes them: a batch of decodes whose size and contexts drift, with a prompt
    chunk of varying size in some steps and none in others."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = rng.randint(1, 96)
        out.append(StepShape(rows, rows * rng.randint(200, 2048), rng.choice((0, 0, rng.randint(1, 512)))))
    return out


def test_exact_linear_steps_give_back_the_coefficients():
    fit = StepCost()
    for shape in shapes(300):
        fit.observe(shape, cost(shape))
    assert fit.coefficients() == pytest.approx(TRUE, rel=2e-3)
    # the prompt tokens a 20 ms target leaves beside 32 decodes of 1,000 tokens each, as the cost says
    decodes = StepShape(32, 32_000)
    want = int((20e-3 - cost(decodes)) / TRUE[3])
    assert abs(fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=2048) - want) <= 2


def test_noise_and_stalled_steps_move_the_fit_a_bounded_amount():
    rng = random.Random(1)
    fit = StepCost()
    for i, shape in enumerate(shapes(600, seed=2)):
        seconds = cost(shape) * rng.uniform(0.9, 1.1)
        if i % 25 == 7:  # a step stalled by the host: a collection, another process
            seconds += 0.25
        fit.observe(shape, seconds)
    for shape in (StepShape(32, 32_000), StepShape(32, 32_000, 512), StepShape(96, 150_000, 256)):
        assert fit.seconds(shape) == pytest.approx(cost(shape), rel=0.1)
    assert fit.coefficients()[3] == pytest.approx(TRUE[3], rel=0.2)


def test_slow_steps_shrink_the_tokens_to_the_floor_and_fast_ones_grow_them_to_the_ceiling():
    slow, fast = StepCost(), StepCost()
    for shape in shapes(100):
        slow.observe(shape, cost(shape, (30e-3, *TRUE[1:])))  # decodes alone already past the target
        fast.observe(shape, cost(shape, (1e-3, 1e-6, 0.0, 1e-6)))
    assert slow.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=512) == 16
    assert fast.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=512) == 512
    assert slow.prompt_tokens_within(20e-3, 32, 32_000, floor=1024, ceiling=512) == 512  # a floor above the ceiling


def test_the_fit_follows_a_change_of_cost():
    """Another model starts sharing the GPU: prompt tokens cost twice as much, and the tokens a target leaves
    halve within a few half-lives."""
    fit = StepCost(half_life=32)
    doubled = (TRUE[0], TRUE[1], TRUE[2], 2 * TRUE[3])
    for shape in shapes(200):
        fit.observe(shape, cost(shape))
    before = fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=4096)
    for shape in shapes(400, seed=3):
        fit.observe(shape, cost(shape, doubled))
    after = fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=4096)
    assert after == pytest.approx(before / 2, rel=0.05)


def test_untrusted_fits_give_the_ceiling():
    fit = StepCost(warm_steps=16)
    for shape in shapes(15):
        fit.observe(shape, cost(shape, (30e-3, *TRUE[1:])))
    assert not fit.warm and fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=512) == 512
    fit.observe(StepShape(), 1.0)  # an empty step (swap copies alone) says nothing of the cost
    assert not fit.warm
    fit.observe(StepShape(8, 8000), cost(StepShape(8, 8000), (30e-3, *TRUE[1:])))
    assert fit.warm and fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=512) == 16
    fit.forget()  # warm-up's steps are compiles: they are dropped before traffic
    assert not fit.warm and fit.prompt_tokens_within(20e-3, 32, 32_000, floor=16, ceiling=512) == 512


def test_decodes_all_at_one_context_still_price_a_prompt_token():
    """Every decode at the same context, so rows and context move together and the fit cannot split their cost
    (the ridge settles it): the decodes' cost and a prompt token's still come out right, and so does the cap."""
    fit = StepCost()
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randint(1, 64)
        shape = StepShape(rows, rows * 1000, rng.choice((0, 0, rng.randint(1, 512))))
        fit.observe(shape, cost(shape) * rng.uniform(0.95, 1.05))
    assert fit.coefficients()[3] == pytest.approx(TRUE[3], rel=0.02)
    assert fit.seconds(StepShape(32, 32_000)) == pytest.approx(cost(StepShape(32, 32_000)), rel=0.02)
    want = (15e-3 - cost(StepShape(32, 32_000))) / TRUE[3]
    assert fit.prompt_tokens_within(15e-3, 32, 32_000, floor=16, ceiling=2048) == pytest.approx(want, rel=0.03)


def test_steps_all_at_one_prompt_size_are_probed_until_a_prompt_token_is_priced():
    """A saturated queue fills every step to the cap, so no two steps differ in prompt tokens and the fit alone
    cannot price one (the intercept takes it): the cap would stay at its ceiling, every step over the target.
    While that lasts, one step in four takes half the usual prompt tokens; a few such steps price the token and
    the cap comes from the fit. Steps within the target at the ceiling are never probed."""
    def run(coef, target_s, steps=80):
        fit, asked = StepCost(), []
        for _ in range(steps):
            tokens = fit.prompt_tokens_within(target_s, 32, 32_000, floor=16, ceiling=512)
            asked.append(tokens)
            fit.observe(StepShape(32, 32_000, tokens), cost(StepShape(32, 32_000, tokens), coef))
        return asked

    want = (15e-3 - cost(StepShape(32, 32_000))) / TRUE[3]  # 376 of the ceiling's 512
    asked = run(TRUE, 15e-3)
    assert asked[:16] == [512] * 16  # not yet warm
    assert 256 in asked[16:24]  # a probe: half the usual
    assert all(abs(t - want) <= 0.02 * want for t in asked[-40:])
    assert run(TRUE, 30e-3) == [512] * 80  # the ceiling is within the target: nothing to find out
