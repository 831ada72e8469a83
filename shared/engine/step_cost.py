"""What a step costs on this engine, learnt from its own steps, for ``--target-step-ms`` (token_budget.py).

A step's wall time is modelled as ``fixed + per_row * decode_rows + per_context * decode_context +
per_prompt_token * prompt_tokens``: the weights are read once per step whatever its size (fixed), each decode
row adds its sampling, its input building and a little compute (per_row) and reads its KV (per_context), and
each prompt token costs about a decode row of compute plus its attention (per_prompt_token). Sarathi-Serve
profiles these offline; here they are fitted online, so they follow this GPU, this model, this host and
async scheduling without a profiling run, and move when they change (a co-resident model, a hotter GPU).

The fit is exponentially weighted least squares (older steps fade with ``half_life`` steps), solved from its
running sums, with:
- a small ridge on the slopes, so the solve stays well posed where features move together (every decode at
  one context: rows and context tokens in proportion; the ridge splits their cost between them) or one never
  moved (every step with the same prompt tokens, or none: the intercept takes its cost, its slope is about 0),
  and the predictions the cap uses stay right. A prompt-token slope of 0 or less leaves the cap at its
  ceiling, the fixed cap's behaviour, until the steps say what a prompt token costs;
- residuals clipped at a few times their running mean, and never below a fifth of the prediction (Huber-like),
  so one step stalled by the host (garbage collection, a compile, another process) moves the fit by a bounded
  amount instead of by its whole outlier, while a real change of cost still moves it within a few half-lives.
The features are scaled to about 1 for a typical step, so that ridge is the same small pull on each slope.

A saturated queue fills every step to the same prompt-token cap, and steps that all hold the same prompt tokens
cannot price one: the intercept takes their cost, the slope stays about 0 and the cap stays at its ceiling,
however far over the target the steps run. So while the steps' prompt tokens barely vary and a step at the
ceiling is predicted over the target, one step in ``_PROBE_EVERY`` takes half the prompt tokens the steps have
been holding: a few such steps price the token, and the cap then comes from the fit.
"""

import dataclasses
import math

# scales that make each feature about 1 in a busy step; only the conditioning of the solve depends on them
_SCALES = (1.0, 64.0, 65536.0, 512.0)
_RIDGE = 1e-5  # times the running weight (~half_life / ln 2 steps): felt only where the data says nothing
_CLIP = 4.0  # residuals beyond this many running mean absolute residuals are clipped
_SPREAD_MIN = 0.1  # prompt tokens varying less than this (std / mean) across the fit's steps cannot be priced
_PROBE_EVERY = 4  # steps: while they cannot be, one step in this many takes half the prompt tokens


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What a step computed, in the terms of the cost model (counted when it was scheduled)."""

    decode_rows: int = 0
    decode_context: int = 0  # KV tokens the decode rows attend to, summed over the rows
    prompt_tokens: int = 0

    def features(self) -> tuple[float, ...]:
        values = (1.0, self.decode_rows, self.decode_context, self.prompt_tokens)
        return tuple(v / s for v, s in zip(values, _SCALES, strict=True))

    @property
    def empty(self) -> bool:
        return not (self.decode_rows or self.prompt_tokens)


class StepCost:
    """The running fit. ``observe`` each step's shape and seconds; ``prompt_tokens_within`` gives the prompt
    tokens a step may add to its decodes to stay within a target. ``warm_steps``: steps observed before the
    fit is trusted (until then ``prompt_tokens_within`` gives its ceiling)."""

    def __init__(self, half_life: float = 64.0, warm_steps: int = 16):
        self.decay = 0.5 ** (1.0 / half_life)
        self.warm_steps = warm_steps
        self.forget()

    def forget(self) -> None:
        """Drop every observation (warm-up's steps are compiles, not the steps traffic will see)."""
        n = len(_SCALES)
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._weight = 0.0
        self._spread = 0.0  # running mean absolute residual, seconds
        self._coef: list[float] | None = None
        self.steps = 0
        self._asks = 0  # prompt_tokens_within's calls that would have probed: every _PROBE_EVERY-th does

    @property
    def warm(self) -> bool:
        return self.steps >= self.warm_steps

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.empty or not seconds >= 0:
            return
        x = shape.features()
        if self.warm:
            predicted = self._predict(x)
            residual = seconds - predicted
            limit = _CLIP * max(self._spread, 0.05 * abs(predicted), 1e-6)
            clipped = max(-limit, min(limit, residual))
            self._spread = self.decay * self._spread + (1 - self.decay) * abs(clipped)
            seconds = predicted + clipped
        d = self.decay
        for i, xi in enumerate(x):
            row = self._xx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            self._xy[i] = d * self._xy[i] + xi * seconds
        self._weight = d * self._weight + 1.0
        self._coef = None
        self.steps += 1
        if self.steps == self.warm_steps:  # the spread starts from the first trusted fit's residuals
            self._spread = abs(seconds - self._predict(x))

    def coefficients(self) -> tuple[float, float, float, float]:
        """Seconds: fixed, per decode row, per decode context token, per prompt token (the current fit)."""
        coef = self._solve()
        return tuple(c / s for c, s in zip(coef, _SCALES, strict=True))  # type: ignore[return-value]

    def seconds(self, shape: StepShape) -> float:
        """The fit's prediction of a step of this shape."""
        return self._predict(shape.features())

    def prompt_tokens_within(self, target_s: float, decode_rows: int, decode_context: int,
                             floor: int, ceiling: int) -> int:
        """Prompt tokens a step of these decodes may add and still be predicted within ``target_s``: at least
        ``floor`` (prompts never starve), at most ``ceiling``; ``ceiling`` until the fit is warm, and while it
        says prompt tokens cost nothing; a probe's half of the usual prompt tokens while the fit cannot price
        one and the ceiling is predicted over the target (see the module's docstring)."""
        floor = min(floor, ceiling)
        if not self.warm:
            return ceiling
        per_token = self.coefficients()[3]
        tokens = ceiling
        if per_token > 0:
            left = target_s - self.seconds(StepShape(decode_rows, decode_context))
            tokens = max(floor, min(ceiling, int(left / per_token)))
        if (tokens == ceiling and self.prompt_spread() < _SPREAD_MIN
                and self.seconds(StepShape(decode_rows, decode_context, ceiling)) > target_s):
            self._asks += 1
            if self._asks % _PROBE_EVERY == 0:
                usual = self._xx[0][3] / self._weight * _SCALES[3]
                return max(floor, int(min(ceiling, usual)) // 2)
        return tokens

    def prompt_spread(self) -> float:
        """How much the prompt tokens of the fit's steps vary: their weighted standard deviation over their
        mean (0 with none)."""
        if not self._weight:
            return 0.0
        mean = self._xx[0][3] / self._weight
        square = self._xx[3][3] / self._weight
        return math.sqrt(max(square - mean * mean, 0.0)) / mean if mean > 0 else 0.0

    def _predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self._solve(), x, strict=True))

    def _solve(self) -> list[float]:
        if self._coef is None:
            n = len(_SCALES)
            ridge = _RIDGE * max(self._weight, 1.0)
            a = [[self._xx[i][j] + (ridge if i == j and i else 0.0) for j in range(n)] + [self._xy[i]]
                 for i in range(n)]
            self._coef = _gauss(a) if self._weight else [0.0] * n
        return self._coef


def _gauss(a: list[list[float]]) -> list[float]:
    """Solve the augmented system ``a`` (n rows of n + 1) by elimination with partial pivoting; a pivot of 0
    (no data in a direction the ridge does not cover) gives that unknown 0."""
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        if abs(p) < 1e-12:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / p
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        p = a[i][i]
        if abs(p) >= 1e-12:
            x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / p
    return x
