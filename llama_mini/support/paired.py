"""Paired differences over seeds: the mean, its 95% confidence interval and a paired t-test.

An ablation trains each variant with the same seeds (the same initial matrices, the same
batches), so the fair comparison of two variants is seed by seed: the differences d_i = a_i - b_i
cancel what the seed does to both. Their mean over n seeds, with Student's t at n - 1 degrees of
freedom, gives the interval and the p-value (a two-sided paired t-test); the interval's half
width is the smallest difference the run could have told from none, its noise floor. Student's
t is computed here from the regularized incomplete beta function (Numerical Recipes' continued
fraction), so no statistics package is needed for two numbers.
"""

import math
import statistics
from dataclasses import dataclass
from typing import Optional

CONFIDENCE = 0.95


@dataclass
class Paired:
    """The comparison of a with b over the seeds both finished: d = a - b."""

    n: int  # seeds both finished
    mean: float
    low: Optional[float]  # the 95% interval of the mean difference; None with one seed
    high: Optional[float]
    p: Optional[float]  # two-sided paired t-test; None with one seed

    @property
    def floor(self) -> Optional[float]:
        """The noise floor: the interval's half width, the smallest difference this run could detect."""
        return None if self.low is None else (self.high - self.low) / 2

    @property
    def detected(self) -> bool:
        """Whether the interval excludes zero (p < 0.05)."""
        return self.low is not None and (self.low > 0 or self.high < 0)


def paired(a: list, b: list) -> Paired:
    """The paired comparison of a and b, values per seed in the same order (None: that seed did not finish)."""
    d = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    n = len(d)
    if n == 0:
        return Paired(0, math.nan, None, None, None)
    mean = statistics.fmean(d)
    if n == 1:
        return Paired(1, mean, None, None, None)
    se = statistics.stdev(d) / math.sqrt(n)
    if se == 0:  # every seed the same difference: certain, or no difference at all
        return Paired(n, mean, mean, mean, 1.0 if mean == 0 else 0.0)
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * se
    return Paired(n, mean, mean - half, mean + half, t_two_sided_p(mean / se, n - 1))


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return incomplete_beta(df / 2, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The q-quantile of Student's t (q > 0.5), by bisection on its distribution function."""
    low, high = 0.0, 1.0
    while 1 - t_two_sided_p(high, df) / 2 < q:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if 1 - t_two_sided_p(mid, df) / 2 < q else (low, mid)
    return (low + high) / 2


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for 0 <= x <= 1."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):  # where the continued fraction converges fast; else by symmetry
        return front * _beta_fraction(a, b, x) / a
    return 1 - front * _beta_fraction(b, a, 1 - x) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return result
