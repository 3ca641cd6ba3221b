"""Statistics over seeds, for reproduce.py's tables and the study: mean and sample std, the paired
difference of two methods with its 95 % t interval, and a table cell "mean +- sd"."""
import functools
import math

import numpy as np


def mean_std(values):
    """(mean, sample std with ddof=1) of the finite values (None and nan skipped); std None for one
    value, both None for none. [0.5, 0.6, None] -> (0.55, 0.0707)."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


@functools.lru_cache(maxsize=None)   # 120,000 density values a call, asked for the same df many times
def t_quantile(df, p=0.975):
    """Student's t quantile (p in (0.5, 1)): the t-density integrated by Simpson's rule, inverted by
    bisection (numpy has none, and scipy is not a requirement). df 4 -> 2.7764."""
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    density = lambda x: const * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731

    def cdf(x, n=2000):   # P(T <= x) for x >= 0
        h = x / n
        odd, even = sum(density((2 * i - 1) * h) for i in range(1, n // 2 + 1)), \
            sum(density(2 * i * h) for i in range(1, n // 2))
        return 0.5 + h / 3 * (density(0) + 4 * odd + 2 * even + density(x))
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired(a, b):
    """The paired difference b - a over the seeds both have ({seed: x}; None skipped): per seed, its mean
    and a 95 % t interval (mean +- t(0.975, n - 1) * sd / sqrt(n)); None where fewer than two seeds
    have both."""
    seeds = [s for s in a if s in b and a[s] is not None and b[s] is not None]
    diffs = {s: b[s] - a[s] for s in seeds}
    if len(diffs) < 2:
        return None
    mean, sd = mean_std(list(diffs.values()))
    pm = t_quantile(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return dict(per_seed=diffs, mean=mean, lo=mean - pm, hi=mean + pm, pm=pm, n=len(diffs))


def cell(mean, sd):
    """A table's "0.512 +- 0.034"; "0.512" without an sd, "-" without a mean."""
    return "-" if mean is None else f"{mean:.3f}" + ("" if sd is None else f" +- {sd:.3f}")
