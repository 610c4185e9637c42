"""Statistics every layer shares: confidence intervals of means, paired differences.

Below protocols and reports: a protocol that decides from a measured difference
(calibration) and a report that prints one use the same procedures.

* `bootstrap_mean_ci(values)`: BCa bootstrap CI of a mean (scipy.stats.bootstrap), with
  the cases scipy leaves open handled (n < 2, constant data, degenerate jackknife);
* `mean_ci(values)`: (mean, low, high) with that CI, NaNs dropped;
* `paired_mean_ci(a, b)`: the mean of the per-item differences a - b over the items both
  have, with its CI (the same items measured twice: MMLU questions, PASTA examples).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

N_RESAMPLES = 2000
CONFIDENCE = 0.95


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray,
    n_resamples: int = N_RESAMPLES,
    confidence: float = CONFIDENCE,
    rng: np.random.Generator | int | None = 0,
    chunk: int = 4_000_000,
) -> tuple[float, float]:
    """BCa bootstrap CI of the mean of `values` (NaNs dropped), by `scipy.stats.bootstrap`.

    The wrapper handles what scipy does not: (nan, nan) for n < 2, since one conversation
    says nothing about spread; (c, c) for constant data; and a percentile interval (from the
    same resamples) where BCa is undefined (its jackknife is degenerate, e.g. binary data
    with a single 1). The interval is clipped to [min, max] of the data against float noise.
    `rng` seeds the resampling; `chunk` caps the entries (resamples x n) drawn at once.
    """
    import warnings

    from scipy import stats

    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    n = x.size
    if n < 2:
        return (float("nan"), float("nan"))
    if np.ptp(x) == 0:  # every resample mean is x[0]; skip the float noise of summing
        return (float(x[0]), float(x[0]))
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)  # NaN interval, handled below
        res = stats.bootstrap(
            (x,),
            np.mean,
            n_resamples=n_resamples,
            batch=max(1, chunk // n),
            vectorized=True,
            confidence_level=confidence,
            method="BCa",
            rng=gen,
        )
    lo, hi = res.confidence_interval.low, res.confidence_interval.high
    if not (np.isfinite(lo) and np.isfinite(hi)):  # BCa undefined: percentile of the same resamples
        alpha = (1.0 - confidence) / 2
        lo, hi = np.quantile(res.bootstrap_distribution, [alpha, 1 - alpha])
    lo, hi = np.clip([lo, hi], x.min(), x.max())
    return (float(lo), float(hi))


def mean_ci(values: Iterable[float | bool], *, seed: int = 0) -> tuple[float, float, float]:
    """(mean, ci_low, ci_high): the mean with its 95% bootstrap CI (values resampled).

    NaNs are dropped; no values give NaN everywhere, one value a NaN interval (n < 2 says
    nothing about spread), constant values a zero-width interval at the value.
    """
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    x = x[np.isfinite(x)]
    mean = float(x.mean()) if x.size else float("nan")
    lo, hi = bootstrap_mean_ci(x, rng=seed)
    return mean, lo, hi


def paired_mean_ci(a: Mapping[Any, float], b: Mapping[Any, float], *, seed: int = 0) -> tuple[int, float, float, float]:
    """(n, mean, ci_low, ci_high) of a[i] - b[i] over the items i both hold, in a's order.

    Pairing first matters: with a few dozen items the two means' own CIs overlap far more
    than the CI of their paired difference does.
    """
    diff = [a[i] - b[i] for i in a if i in b]
    return (len(diff), *mean_ci(diff, seed=seed))
