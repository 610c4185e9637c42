"""Statistics shared by protocols and reports (driftlab.stats), checked against slow references."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import numpy as np
import pytest
from scipy import stats

from driftlab.stats import bootstrap_mean_ci, mean_ci, paired_mean_ci


def _quantile(sorted_vals: list[float], p: float) -> float:
    """Linear interpolation between order statistics (numpy's default), by hand."""
    h = (len(sorted_vals) - 1) * p
    i = int(h)
    j = min(i + 1, len(sorted_vals) - 1)
    return sorted_vals[i] + (h - i) * (sorted_vals[j] - sorted_vals[i])


def slow_bootstrap(x: list[float], n_resamples: int, confidence: float, seed: int):
    """The slow, obvious reference: stdlib random, one resample at a time, BCa from the textbook
    formulas (Efron & Tibshirani 1993, 14.3: z0 from the share of resample means below the mean,
    ties counted half; acceleration from the jackknife). Returns (BCa, percentile) intervals."""
    rng = random.Random(seed)
    nd = NormalDist()
    n = len(x)
    theta = sum(x) / n
    means = sorted(sum(x[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_resamples))
    below = sum(m < theta for m in means) + 0.5 * sum(m == theta for m in means)
    z0 = nd.inv_cdf(below / n_resamples)
    jack = [(sum(x) - xi) / (n - 1) for xi in x]
    jbar = sum(jack) / n
    a = sum((jbar - j) ** 3 for j in jack) / (6 * sum((jbar - j) ** 2 for j in jack) ** 1.5)
    alpha = (1 - confidence) / 2
    bca = []
    for z in (nd.inv_cdf(alpha), nd.inv_cdf(1 - alpha)):
        bca.append(_quantile(means, nd.cdf(z0 + (z0 + z) / (1 - a * (z0 + z)))))
    return tuple(bca), (_quantile(means, alpha), _quantile(means, 1 - alpha))


@pytest.mark.parametrize("dist", ["uniform", "binary", "skewed", "exponential"])
def test_bootstrap_matches_slow_bca_reference(dist: str) -> None:
    gen = np.random.default_rng(7)
    x = {
        "uniform": gen.uniform(size=25),
        "binary": (gen.uniform(size=40) < 0.3).astype(float),
        "skewed": gen.beta(0.3, 3.0, size=30),
        "exponential": gen.exponential(size=15),
    }[dist]
    lo, hi = bootstrap_mean_ci(x, n_resamples=20000, rng=1)
    (ref_lo, ref_hi), (pct_lo, pct_hi) = slow_bootstrap(list(x), 20000, 0.95, seed=3)
    width = hi - lo
    assert width > 0.05
    # Monte-Carlo error of a 2.5% quantile from 20000 resamples is ~0.7% of the width (both sides).
    assert lo == pytest.approx(ref_lo, abs=0.03 * width)
    assert hi == pytest.approx(ref_hi, abs=0.03 * width)
    assert lo < x.mean() < hi
    if dist in ("skewed", "exponential"):
        # Control: on skewed data BCa moves the interval right of the percentile one by more than
        # the tolerance above, so a percentile bootstrap would fail this test.
        assert hi - pct_hi > 0.06 * width and lo - pct_lo > 0.03 * width


def test_bootstrap_covers_the_true_mean_at_the_nominal_rate() -> None:
    """200 normal samples (n=40, mean 0.3): the 95% CI holds 0.3 in ~95% of them, the 80% CI in
    ~80%. Bands are ~4 binomial sigmas (sd 1.5% and 2.8%) plus BCa's small-n undercoverage."""
    mu, trials = 0.3, 200
    hits = {0.95: 0, 0.80: 0}
    for t in range(trials):
        x = np.random.default_rng([11, t]).normal(mu, 1.0, size=40)
        for conf in hits:
            lo, hi = bootstrap_mean_ci(x, n_resamples=2000, confidence=conf, rng=t)
            hits[conf] += lo <= mu <= hi
    assert 0.89 <= hits[0.95] / trials <= 0.99
    assert 0.70 <= hits[0.80] / trials <= 0.90


def test_bootstrap_known_cases() -> None:
    assert bootstrap_mean_ci([0.3] * 12) == (0.3, 0.3)  # constant: zero width, exactly the value
    assert all(math.isnan(v) for v in bootstrap_mean_ci([0.7]))  # n=1: undefined -> NaN
    assert all(math.isnan(v) for v in bootstrap_mean_ci([]))
    assert all(math.isnan(v) for v in bootstrap_mean_ci([0.2, float("nan")]))  # NaN dropped -> n=1
    x = [0.0, 0.0, 1.0, 1.0, 0.5]
    assert bootstrap_mean_ci(x + [float("nan")], rng=5) == bootstrap_mean_ci(x, rng=5)  # NaN dropped
    assert bootstrap_mean_ci(x, rng=5) == bootstrap_mean_ci(x, rng=5)  # seeded
    u = np.random.default_rng(0).uniform(size=25)
    assert bootstrap_mean_ci(u, rng=5) != bootstrap_mean_ci(u, rng=6)  # and the seed is used
    # A Generator is used as given: the same state gives the same CI, and it is advanced.
    g1, g2 = np.random.default_rng(9), np.random.default_rng(9)
    first = bootstrap_mean_ci(u, rng=g1)
    assert first == bootstrap_mean_ci(u, rng=g2)
    assert bootstrap_mean_ci(u, rng=g1) != first
    # `chunk` only bounds memory: a tiny chunk (many blocks) draws the same resamples.
    assert bootstrap_mean_ci(u, rng=5, chunk=7) == bootstrap_mean_ci(u, rng=5)
    # Two points {0, 1}: resample means are 0, 1/2, 1 with P = 1/4, 1/2, 1/4. The mean 1/2 sits at
    # the middle (z0 = 0) and the jackknife is symmetric (a = 0), so BCa = percentile = [0, 1].
    assert bootstrap_mean_ci([0.0, 1.0], n_resamples=4000) == (0.0, 1.0)


def test_bootstrap_falls_back_to_percentile_where_bca_is_undefined() -> None:
    # Equal up to one ulp: the jackknife means all round to the same float, BCa's acceleration
    # is 0/0 and scipy returns NaN (checked, so this test exercises the fallback).
    x = np.array([1 / 3] * 5 + [np.nextafter(1 / 3, 1)])
    with pytest.warns(stats.DegenerateDataWarning), np.errstate(invalid="ignore"):
        raw = stats.bootstrap((x,), np.mean, n_resamples=500, method="BCa", rng=0)
    assert math.isnan(raw.confidence_interval.low)
    lo, hi = bootstrap_mean_ci(x)
    assert x.min() <= lo <= hi <= x.max()


def test_mean_ci_is_the_mean_with_the_bootstrap_interval():
    values = [True, False, True, True, False, True, True, False]
    mean, lo, hi = mean_ci(values, seed=3)
    assert mean == pytest.approx(5 / 8)
    assert (lo, hi) == bootstrap_mean_ci(np.asarray(values, dtype=float), rng=3)
    assert 0.0 <= lo <= mean <= hi <= 1.0
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    m, lo1, hi1 = mean_ci([0.5])
    assert m == 0.5 and math.isnan(lo1) and math.isnan(hi1)
    assert all(math.isnan(x) for x in mean_ci([]))


def test_paired_mean_ci_pairs_items_in_the_first_mappings_order():
    a = {"x": 1.0, "y": 0.0, "z": 1.0, "w": 1.0}
    b = {"w": 0.0, "y": 0.0, "x": 1.0, "v": 5.0}  # v unpaired, z unpaired
    n, mean, lo, hi = paired_mean_ci(a, b, seed=2)
    assert n == 3 and mean == pytest.approx(1 / 3)
    assert (mean, lo, hi) == mean_ci([0.0, 0.0, 1.0], seed=2)  # x, y, w: a's order
    assert paired_mean_ci({}, b)[0] == 0 and math.isnan(paired_mean_ci({}, b)[1])
