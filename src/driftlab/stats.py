"""Statistics every layer shares: intervals chosen by n, paired tests, Holm, power.

Below protocols and reports: a protocol that decides from a measured difference
(calibration) and a report that prints one use the same procedures, so a number means the
same thing in every table. Every result carries its n and the name of its method.

Why these rules (issue 22): with the few conversations or examples a CPU run affords, a
bootstrap interval is too narrow (it cannot see further than the n points it resamples) and
a paired 0/1 difference of 3 better / 0 worse out of 20 is not evidence of anything
(exact p = 0.25). So:

* **Intervals, chosen by the data and n** (`mean_interval`):
  0/1 values (a proportion) get the Wilson score interval at every n (`"wilson"`; exact
  Clopper-Pearson on request); graded values get Student's t-interval below
  `BOOTSTRAP_MIN_N` = 30 values (`"t"`) and the BCa bootstrap from 30 on (`"bca"`), where
  it has enough points to see the shape of the distribution (skew) that t assumes away.
  Graded values with n < 2 get a NaN interval (`"none"`): one value says nothing about
  spread (a single 0/1 value still bounds a proportion, so Wilson applies from n = 1).
* **Paired tests** (`paired_test`): the same items measured twice (conversations under two
  steerings, MMLU questions, PASTA examples). 0/1 outcomes get the exact McNemar test (a
  binomial test on the discordant pairs), graded scores the Wilcoxon signed-rank test
  (exact by enumerating sign flips, ties and all, up to `WILCOXON_EXACT_MAX` untied pairs;
  normal approximation beyond) or, on request, the sign test. The effect size is the mean
  difference a - b with its interval (paired 0/1 outcomes: Newcombe's square-and-add interval,
  built from the two Wilson intervals, at any n; graded differences: by the rule above) and the
  counts better / worse / tied.
* **A family** of comparisons (a sweep's points against the baseline, a table's baselines
  against zero-shot) is corrected by Holm's step-down method (`holm`, `with_holm`).
* **Power** (`pairs_needed_proportions`: the exact McNemar test's exact power;
  `pairs_needed_means`: the paired t-test's, noncentral t): how many pairs or questions a
  paired effect needs at alpha 0.05 and power 0.8, so a "no measurable difference" comes with
  the n that would have measured one.

`bootstrap_mean_ci` remains the BCa bootstrap itself (used by `mean_interval` at n >= 30).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

N_RESAMPLES = 2000
CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8
BOOTSTRAP_MIN_N = 30  # below this many values a mean gets a t-interval, not a bootstrap
WILCOXON_EXACT_MAX = 400  # untied pairs up to which the signed-rank null is enumerated exactly

IntervalMethod = Literal["wilson", "exact", "newcombe", "t", "cluster-t", "bca", "cluster-bootstrap", "constant",
                         "none"]
PairedMethod = Literal["auto", "mcnemar", "wilcoxon", "sign"]

METHOD_LABELS = {
    "wilson": "Wilson score interval", "exact": "Clopper-Pearson exact interval",
    "newcombe": "Newcombe square-and-add (Wilson) interval for paired proportions", "t": "t-interval",
    "cluster-t": "cluster-robust t-interval (one value per cluster)",
    "cluster-bootstrap": "percentile bootstrap over clusters (whole conversations or prompts resampled)",
    "bca": "BCa bootstrap", "constant": "constant values", "none": "n < 2: no interval",
}


# -- result types -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """An estimate with its interval, the n behind it and the method that made the interval."""

    estimate: float
    low: float
    high: float
    n: int
    method: IntervalMethod
    confidence: float = CONFIDENCE

    def as_tuple(self) -> tuple[float, float, float]:
        """(estimate, low, high), the shape older callers use."""
        return (self.estimate, self.low, self.high)

    def cell(self, digits: int = 3, sign: bool = False) -> str:
        """'0.42 [0.31, 0.55]' (signed with `sign`); just the estimate when there is no interval."""
        f = f"{{:+.{digits}f}}" if sign else f"{{:.{digits}f}}"
        if not math.isfinite(self.estimate):
            return "-"
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return f.format(self.estimate)
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison of a against b: the test, its p-value and the effect size.

    `diff` is the mean of a - b over the `n` pairs with its interval; `better`, `worse` and
    `tied` count pairs with a > b, a < b, a == b. `p_holm` is set once the test is corrected
    within a family (`with_holm`); `p_adjusted` is that, or `p` for a lone comparison.
    `clusters` is the number of independent clusters the pairs fall in (e.g. the dialogs MMLU
    questions were asked after; `clustered_paired_test`), 0 where every pair is its own unit;
    `clusters_differing` those whose summed difference is not zero. A test over one cluster is
    the item-level test (it can say nothing about how clusters vary: a report says so).
    """

    n: int
    better: int
    worse: int
    tied: int
    diff: Interval
    p: float
    method: str
    p_holm: float | None = None
    alpha: float = ALPHA
    clusters: int = 0
    clusters_differing: int = 0

    @property
    def untied(self) -> int:
        return self.better + self.worse

    @property
    def min_p(self) -> float:
        """The smallest two-sided p any outcome of these untied pairs could give: all of them one
        way has probability 2^-k under every test here (McNemar, sign, signed-rank; for a clustered
        test k counts the clusters whose difference is not zero)."""
        k = self.clusters_differing if self.clusters > 1 else self.untied
        return min(1.0, 2.0 ** (1 - k)) if k else 1.0

    @property
    def p_adjusted(self) -> float:
        return self.p if self.p_holm is None else self.p_holm

    @property
    def significant(self) -> bool:
        return math.isfinite(self.p_adjusted) and self.p_adjusted < self.alpha

    def warning(self) -> str | None:
        """A plain sentence when n does not support a difference, None when the test does."""
        if self.n == 0:
            return "no pairs: nothing to compare"
        if self.untied == 0:
            return f"all {self.n} pairs tied: no difference measurable"
        if self.min_p >= self.alpha and self.clusters > 1:
            return (f"too few clusters to support a difference: {self.clusters_differing} of {self.clusters} differ, "
                    f"and even all one way would give p = {self.min_p:.3g} (>= {self.alpha:g})")
        if self.min_p >= self.alpha:
            return (f"too few pairs to support a difference: {self.untied} of {self.n} differ, and even all "
                    f"{self.untied} one way would give p = {self.min_p:.3g} (>= {self.alpha:g})")
        if not self.significant:
            which = "Holm-corrected p" if self.p_holm is not None else "p"
            return f"no difference shown: {which} = {self.p_adjusted:.3g} (>= {self.alpha:g}, n = {self.n})"
        return None

    def as_dict(self, prefix: str = "") -> dict[str, Any]:
        """Flat columns for a table: n, better/worse/tied, diff with its CI and CI method, p, p_holm, method."""
        d = {"n": self.n, "better": self.better, "worse": self.worse, "tied": self.tied,
             "diff": self.diff.estimate, "diff_ci_low": self.diff.low, "diff_ci_high": self.diff.high,
             "ci_method": self.diff.method, "p": self.p,
             "p_holm": float("nan") if self.p_holm is None else self.p_holm, "method": self.method}
        return {f"{prefix}{k}": v for k, v in d.items()}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "warning": self.warning()}


# -- intervals ----------------------------------------------------------------------------------
def _finite(values: Iterable[float | bool] | np.ndarray) -> np.ndarray:
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    return x[np.isfinite(x)]


def is_binary(values: np.ndarray) -> bool:
    """All values 0 or 1 (a proportion), and at least one value."""
    return bool(values.size) and bool(np.all((values == 0) | (values == 1)))


def proportion_interval(successes: int, n: int, method: Literal["wilson", "exact"] = "wilson",
                        confidence: float = CONFIDENCE) -> Interval:
    """The proportion successes/n with its Wilson score (default) or Clopper-Pearson exact interval.

    Wilson keeps its coverage near nominal at small n and at 0/n or n/n, where the normal
    (Wald) interval collapses to zero width; Clopper-Pearson never undercovers, at the cost
    of width.
    """
    if n <= 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, "none", confidence)
    from scipy import stats

    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method=method)
    return Interval(successes / n, float(ci.low), float(ci.high), int(n), method, confidence)


def t_interval(values: Iterable[float] | np.ndarray, confidence: float = CONFIDENCE) -> Interval:
    """Student's t-interval of the mean (NaNs dropped): mean +- t_{n-1} * sd / sqrt(n)."""
    from scipy import stats

    x = _finite(values)
    n = x.size
    if n < 2:
        return Interval(float(x.mean()) if n else float("nan"), float("nan"), float("nan"), n, "none", confidence)
    mean = float(x.mean())
    if np.ptp(x) == 0:
        return Interval(mean, mean, mean, n, "constant", confidence)
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return Interval(mean, mean - half, mean + half, n, "t", confidence)


def mean_interval(values: Iterable[float | bool] | np.ndarray, *, confidence: float = CONFIDENCE,
                  rng: np.random.Generator | int | None = 0, proportion: Literal["wilson", "exact"] = "wilson",
                  n_resamples: int = N_RESAMPLES, graded: bool = False) -> Interval:
    """The mean of `values` (NaNs dropped) with the interval the data and n support.

    0/1 values: Wilson (or `proportion="exact"`: Clopper-Pearson) at any n, unless `graded` says they
    are no proportion however they fell (a KL of exactly 0 where nothing changed); graded values:
    t below BOOTSTRAP_MIN_N, BCa bootstrap (seeded by `rng`) from there; n < 2: no interval;
    constant graded values: zero width at the value.
    """
    x = _finite(values)
    n = x.size
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, "none", confidence)
    if is_binary(x) and not graded:
        return proportion_interval(int(x.sum()), n, proportion, confidence)
    if n < BOOTSTRAP_MIN_N:
        return t_interval(x, confidence)
    mean = float(x.mean())
    if np.ptp(x) == 0:
        return Interval(mean, mean, mean, n, "constant", confidence)
    lo, hi = bootstrap_mean_ci(x, n_resamples=n_resamples, confidence=confidence, rng=rng)
    return Interval(mean, lo, hi, n, "bca", confidence)


def difference_interval(diffs: Iterable[float] | np.ndarray, *, confidence: float = CONFIDENCE,
                        rng: np.random.Generator | int | None = 0) -> Interval:
    """The mean of paired graded differences with its interval: t below BOOTSTRAP_MIN_N, BCa from there.

    Paired 0/1 outcomes get `paired_proportion_interval` instead (`paired_test` picks it); the
    test that decides is the exact one (`paired_test`), this interval describes the size.
    """
    x = _finite(diffs)
    return t_interval(x, confidence) if x.size < BOOTSTRAP_MIN_N else _bca(x, confidence, rng)


def paired_proportion_interval(a: Iterable[float] | np.ndarray, b: Iterable[float] | np.ndarray, *,
                               confidence: float = CONFIDENCE) -> Interval:
    """p_a - p_b of paired 0/1 outcomes with Newcombe's (1998) square-and-add interval, at any n.

    Why not the mean difference's t or bootstrap interval: the differences are -1/0/+1 and only
    the discordant pairs carry information, so with few of them (3 better / 0 worse of 20) a
    t-interval is symmetric, can pass +-1 and undercovers, and a bootstrap over 200 questions
    with 30 discordant ones is too narrow. Newcombe's interval combines the two marginal Wilson
    intervals with a correction for the pairing (phi, the continuity-corrected correlation of
    the 2x2 table): it stays within [-1, 1], is asymmetric where the data are, and keeps
    coverage near nominal at small n. The exact McNemar test remains what decides a difference.
    """
    xa, xb = _finite(a), _finite(b)
    n = xa.size
    if n == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, "none", confidence)
    r = int(((xa == 1) & (xb == 1)).sum())  # both right
    s = int(((xa == 1) & (xb == 0)).sum())  # a only
    t = int(((xa == 0) & (xb == 1)).sum())  # b only
    u = n - r - s - t
    p1, p2 = (r + s) / n, (r + t) / n
    w1, w2 = proportion_interval(r + s, n, confidence=confidence), proportion_interval(r + t, n, confidence=confidence)
    product = (r + s) * (t + u) * (r + t) * (s + u)
    cross = r * u - s * t
    corrected = cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)
    phi = corrected / math.sqrt(product) if product > 0 else 0.0
    lo_a, hi_b = p1 - w1.low, w2.high - p2
    lo_b, hi_a = p2 - w2.low, w1.high - p1
    low = p1 - p2 - math.sqrt(max(0.0, lo_a ** 2 - 2 * phi * lo_a * hi_b + hi_b ** 2))
    high = p1 - p2 + math.sqrt(max(0.0, lo_b ** 2 - 2 * phi * lo_b * hi_a + hi_a ** 2))
    return Interval(p1 - p2, low, high, n, "newcombe", confidence)


def _bca(x: np.ndarray, confidence: float, rng: np.random.Generator | int | None) -> Interval:
    mean = float(x.mean())
    if np.ptp(x) == 0:
        return Interval(mean, mean, mean, x.size, "constant", confidence)
    lo, hi = bootstrap_mean_ci(x, confidence=confidence, rng=rng)
    return Interval(mean, lo, hi, x.size, "bca", confidence)


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
    Prefer `mean_interval`, which uses this only where n supports it.
    """
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


# -- paired tests -------------------------------------------------------------------------------
def mcnemar_exact(better: int, worse: int) -> float:
    """Exact McNemar p (two-sided): a binomial test of `better` successes in the better + worse
    discordant pairs at 1/2. Concordant pairs carry no information about the difference."""
    from scipy import stats

    k = better + worse
    return 1.0 if k == 0 else float(stats.binomtest(better, k, 0.5).pvalue)


def sign_test(better: int, worse: int) -> float:
    """Sign test p (two-sided) of graded pairs: the same binomial test on the signs, ties dropped."""
    return mcnemar_exact(better, worse)


def wilcoxon_signed_rank(diffs: Iterable[float] | np.ndarray) -> tuple[float, str]:
    """(two-sided p, method) of the Wilcoxon signed-rank test; zero differences dropped (Wilcoxon's rule).

    Exact up to WILCOXON_EXACT_MAX untied pairs, ties among |d| included: the statistic T+
    (sum of the mid-ranks of positive differences) is enumerated over all 2^k sign flips by
    a convolution on doubled ranks (integers), which scipy's "exact" method does not do for
    ties. Beyond that, scipy's normal approximation (tie-corrected).
    """
    from scipy import stats

    d = _finite(diffs)
    d = d[d != 0]
    k = d.size
    if k == 0:  # every pair tied: p = 1, exactly
        return 1.0, "Wilcoxon signed-rank (exact)"
    if k > WILCOXON_EXACT_MAX:
        return float(stats.wilcoxon(d, method="approx").pvalue), "Wilcoxon signed-rank (normal approx.)"
    ranks2 = np.rint(2 * stats.rankdata(np.abs(d))).astype(np.int64)  # mid-ranks are multiples of 1/2
    dist = np.zeros(int(ranks2.sum()) + 1)  # dist[t]: P(2 T+ = t)
    dist[0] = 1.0
    top = 0
    for r in ranks2:  # each rank joins T+ with probability 1/2, independently
        shifted = np.zeros_like(dist)
        shifted[r : r + top + 1] = dist[: top + 1]
        dist = 0.5 * (dist + shifted)
        top += int(r)
    t_plus = int(ranks2[d > 0].sum())
    cdf_low, cdf_high = dist[: t_plus + 1].sum(), dist[t_plus:].sum()
    return float(min(1.0, 2 * min(cdf_low, cdf_high))), "Wilcoxon signed-rank (exact)"


def _pairs(a: Mapping[Any, float] | Sequence[float], b: Mapping[Any, float] | Sequence[float],
           ) -> tuple[np.ndarray, np.ndarray]:
    """Paired arrays: by key over the keys both hold, in a's order (mappings), or by position."""
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise TypeError("pair two mappings (by key) or two sequences (by position), not one of each")
    if isinstance(a, Mapping):
        keys = [k for k in a if k in b]
        xa = np.asarray([float(a[k]) for k in keys], dtype=float)
        xb = np.asarray([float(b[k]) for k in keys], dtype=float)  # type: ignore[index]
    else:
        if len(a) != len(b):
            raise ValueError(f"paired sequences differ in length: {len(a)} vs {len(b)}")
        xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = np.isfinite(xa) & np.isfinite(xb)
    return xa[keep], xb[keep]


def paired_test(a: Mapping[Any, float] | Sequence[float], b: Mapping[Any, float] | Sequence[float], *,
                method: PairedMethod = "auto", alpha: float = ALPHA, confidence: float = CONFIDENCE,
                rng: np.random.Generator | int | None = 0) -> PairedTest:
    """Compare a with b on the same items: a paired test and the mean difference a - b.

    `a` and `b` are mappings item -> value (paired over the items both hold) or equal-length
    sequences; pairs with a NaN are dropped. `method="auto"` takes the exact McNemar test
    when every value is 0 or 1 and the Wilcoxon signed-rank test otherwise.
    """
    xa, xb = _pairs(a, b)
    d = xa - xb
    better, worse = int((d > 0).sum()), int((d < 0).sum())
    binary = is_binary(np.concatenate([xa, xb]))
    if method == "auto":
        method = "mcnemar" if binary else "wilcoxon"
    if method == "mcnemar":
        if d.size and not binary:
            raise ValueError("McNemar's test needs 0/1 outcomes; use method='wilcoxon' or 'sign' for graded scores")
        p, name = mcnemar_exact(better, worse), "exact McNemar"
    elif method == "sign":
        p, name = sign_test(better, worse), "sign test"
    elif method == "wilcoxon":
        p, name = wilcoxon_signed_rank(d)
    else:
        raise ValueError(f"unknown paired method {method!r}; use auto, mcnemar, wilcoxon or sign")
    diff = (paired_proportion_interval(xa, xb, confidence=confidence) if binary
            else difference_interval(d, confidence=confidence, rng=rng))
    return PairedTest(n=int(d.size), better=better, worse=worse, tied=int(d.size) - better - worse,
                      diff=diff, p=p, method=name, alpha=alpha)


CLUSTER_EXACT_MAX = 20  # clusters up to which a non-integer sign-flip null is enumerated (2^k sums)
CLUSTER_RESAMPLES = 200_000  # random sign flips beyond that


def sign_flip_test(sums: Iterable[float] | np.ndarray, *, rng: np.random.Generator | int | None = 0,
                   ) -> tuple[float, str]:
    """(two-sided p, method) of the randomization test of sum(sums) = 0 by sign flips of each value.

    Under "no difference", each cluster's summed paired difference is as likely negative as
    positive (the two conditions are exchangeable within a cluster), whatever the dependence
    inside it: the null distribution of the total is that of sum(+-s_j). Integer sums (paired
    0/1 outcomes) are enumerated exactly for any number of clusters by convolution; other sums
    exactly up to CLUSTER_EXACT_MAX clusters, by CLUSTER_RESAMPLES seeded random flips beyond.
    """
    x = _finite(sums)
    x = x[x != 0]
    k = x.size
    if k == 0:
        return 1.0, "cluster sign-flip (exact)"
    observed = abs(float(x.sum()))
    if np.allclose(x, np.rint(x)):
        v = np.abs(np.rint(x).astype(np.int64))
        dist = np.zeros(int(v.sum()) * 2 + 1)  # dist[t + V]: P(sum(+-v_j) = t)
        total = int(v.sum())
        dist[total] = 1.0
        for vj in v:  # each cluster adds +v_j or -v_j with probability 1/2
            dist = 0.5 * (np.roll(dist, int(vj)) + np.roll(dist, -int(vj)))
        t = np.arange(-total, total + 1)
        p = float(dist[np.abs(t) >= round(observed)].sum())
        return min(1.0, p), "cluster sign-flip (exact)"
    tolerance = 1e-9 * max(1.0, observed)
    if k <= CLUSTER_EXACT_MAX:
        signs = 1 - 2 * ((np.arange(2 ** k)[:, None] >> np.arange(k)) & 1)
        totals = np.abs(signs @ x)
        return float(np.mean(totals >= observed - tolerance)), "cluster sign-flip (exact)"
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    totals = np.abs(gen.choice((-1.0, 1.0), size=(CLUSTER_RESAMPLES, k)) @ x)
    p = (1 + np.count_nonzero(totals >= observed - tolerance)) / (1 + CLUSTER_RESAMPLES)
    return float(p), f"cluster sign-flip ({CLUSTER_RESAMPLES} random flips)"


def cluster_difference_interval(sums: Sequence[float] | np.ndarray, sizes: Sequence[int] | np.ndarray, *,
                                confidence: float = CONFIDENCE) -> Interval:
    """The mean paired difference over clustered items, sum(s_j) / sum(n_j), with a cluster-robust
    t-interval on k - 1 degrees of freedom.

    Why: items of one cluster share something (MMLU questions asked after one dialog share its
    text), so they are not independent and an item-level interval is too narrow. The ratio
    estimator's variance is estimated from the clusters' residuals e_j = s_j - mean * n_j (the
    usual linearisation, with the k / (k - 1) small-sample factor); with equal cluster sizes this
    is the t-interval of the k cluster means. Paired 0/1 items keep it within [-1, 1].
    """
    from scipy import stats

    s, n = np.asarray(sums, dtype=float), np.asarray(sizes, dtype=float)
    k, total = s.size, float(n.sum())
    if k == 0 or total == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, "none", confidence)
    mean = float(s.sum() / total)
    if k < 2:
        return Interval(mean, float("nan"), float("nan"), int(total), "none", confidence)
    resid = s - mean * n
    se = math.sqrt(k / (k - 1) * float((resid ** 2).sum())) / total
    if se == 0:
        return Interval(mean, mean, mean, int(total), "constant", confidence)
    half = float(stats.t.ppf((1 + confidence) / 2, k - 1)) * se
    return Interval(mean, max(-1.0, mean - half), min(1.0, mean + half), int(total), "cluster-t", confidence)


def clustered_paired_test(a: Mapping[Any, float], b: Mapping[Any, float], clusters: Mapping[Any, Any], *,
                          alpha: float = ALPHA, confidence: float = CONFIDENCE,
                          rng: np.random.Generator | int | None = 0) -> PairedTest:
    """Compare a with b on the same items when items come in clusters (`clusters`: item -> cluster).

    The unit of evidence is the cluster: the exact sign-flip test of the clusters' summed
    differences (`sign_flip_test`) and the cluster-robust interval of the mean difference
    (`cluster_difference_interval`). Items of one cluster (questions asked after one dialog)
    are correlated, and a test that counts them as independent (McNemar over questions)
    overstates the evidence; this one does not. With a single cluster nothing can be said
    about how the clusters vary: the item-level `paired_test` is returned, marked as resting
    on one cluster (`clusters` = 1), for the report to say so.
    """
    keys = [k for k in a if k in b and k in clusters]
    missing = [k for k in keys if clusters[k] is None]
    if missing:
        raise ValueError(f"items {missing[:3]} have no cluster")
    groups: dict[Any, list[float]] = {}
    for key in keys:
        da, db = float(a[key]), float(b[key])
        if math.isfinite(da) and math.isfinite(db):
            groups.setdefault(clusters[key], []).append(da - db)
    if len(groups) < 2:
        base = paired_test({k: a[k] for k in keys}, {k: b[k] for k in keys}, alpha=alpha, confidence=confidence,
                           rng=rng)
        return replace(base, clusters=len(groups), clusters_differing=int(any(sum(g) != 0 for g in groups.values())))
    sums = np.asarray([sum(g) for g in groups.values()])
    sizes = np.asarray([len(g) for g in groups.values()])
    d = np.concatenate([np.asarray(g) for g in groups.values()])
    p, name = sign_flip_test(sums, rng=rng)
    better, worse = int((d > 0).sum()), int((d < 0).sum())
    return PairedTest(n=int(d.size), better=better, worse=worse, tied=int(d.size) - better - worse,
                      diff=cluster_difference_interval(sums, sizes, confidence=confidence), p=p,
                      method=f"{name}, {len(groups)} clusters", alpha=alpha, clusters=len(groups),
                      clusters_differing=int(np.count_nonzero(sums)))


# -- a family of comparisons --------------------------------------------------------------------
def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order; NaNs stay NaN and are not counted.

    Sorted ascending, p_(i) is multiplied by (m - i) (i from 0), made non-decreasing, capped at
    1. It controls the family-wise error at alpha for any dependence between the tests, and
    is uniformly more powerful than Bonferroni.
    """
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = idx.size
    if m:
        order = idx[np.argsort(p[idx], kind="stable")]
        adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
        out[order] = adjusted
    return [float(v) for v in out]


def with_holm(tests: Sequence[PairedTest | None]) -> list[PairedTest | None]:
    """The tests of one family, each with its Holm-corrected p (None entries pass through)."""
    adjusted = holm([t.p if t is not None else float("nan") for t in tests])
    return [None if t is None else replace(t, p_holm=q) for t, q in zip(tests, adjusted, strict=True)]


# -- power ------------------------------------------------------------------------------------
def _z(q: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(q))


def mcnemar_power(n: int, p_better: float, p_worse: float, alpha: float = ALPHA) -> float:
    """Exact power of the exact McNemar test with n pairs, when a pair is better with probability
    `p_better` and worse with `p_worse`: the discordant count k ~ Binomial(n, psi), psi = p_better +
    p_worse; given k, the better count ~ Binomial(k, p_better / psi), and the test rejects where
    its two-sided binomial p is below alpha (x <= c_k or x >= k - c_k)."""
    from scipy import stats

    psi = p_better + p_worse
    if n < 1 or psi <= 0:
        return 0.0
    k = np.arange(1, n + 1)
    c = stats.binom.ppf(alpha / 2, k, 0.5) - 1  # the largest x with 2 P(X <= x) < alpha
    q = p_better / psi
    reject = stats.binom.cdf(c, k, q) + stats.binom.sf(k - c - 1, k, q)
    return float(np.sum(stats.binom.pmf(k, n, psi) * reject))


def pairs_needed_proportions(effect: float, discordant: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Pairs (e.g. MMLU questions asked twice) the exact McNemar test needs to detect a difference
    in paired proportions of `effect` (p_better - p_worse) when a share `discordant` (p_better +
    p_worse) of the pairs differ, two-sided at `alpha` with `power`.

    Connor's (1987) normal approximation gives a start,

        n = (z_{1-alpha/2} sqrt(psi) + z_power sqrt(psi - delta^2))^2 / delta^2,

    but the exact test is conservative (about 0.76 power there for a nominal 0.8), so n grows
    from there to the first n whose exact power (`mcnemar_power`) reaches `power`. (Exact power
    is a sawtooth in n: a slightly larger n can dip just below again.) The discordant share must
    be at least |effect|: every difference is a discordant pair.
    """
    delta, psi = abs(effect), discordant
    if not 0 < delta <= 1:
        raise ValueError(f"effect must be a nonzero difference in proportions within [-1, 1], got {effect}")
    if not delta <= psi <= 1:
        raise ValueError(f"the discordant share must lie in [|effect|, 1] = [{delta:g}, 1], got {psi}")
    approx = (_z(1 - alpha / 2) * math.sqrt(psi) + _z(power) * math.sqrt(max(psi - delta**2, 0.0))) ** 2 / delta**2
    n = max(1, math.ceil(approx - 1e-9))
    p_better, p_worse = (psi + delta) / 2, (psi - delta) / 2
    for _ in range(10 * n + 100):  # the exact power reaches the target well within this
        if mcnemar_power(n, p_better, p_worse, alpha) >= power:
            return n
        n += 1
    raise ValueError(f"no n up to {n} reaches power {power} for effect {effect} at discordant share {discordant}")


def paired_t_power(n: int, effect_size: float, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test with n pairs at a standardized effect d = mean/sd of the differences."""
    from scipy import stats

    if n < 2:
        return 0.0
    df, nc = n - 1, effect_size * math.sqrt(n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def pairs_needed_means(effect: float, sd: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Pairs a paired comparison of means needs to detect a mean difference `effect` when the
    paired differences have standard deviation `sd`: the smallest n whose paired t-test power
    (noncentral t) reaches `power`. The signed-rank test needs about 5% more (its asymptotic
    relative efficiency is 3/pi = 0.955 under normality)."""
    if not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"sd of the paired differences must be positive, got {sd}")
    if effect == 0 or not math.isfinite(effect):
        raise ValueError(f"effect must be a nonzero finite difference, got {effect}")
    d = abs(effect) / sd
    n = max(2, math.ceil((_z(1 - alpha / 2) + _z(power)) ** 2 / d**2))  # normal approximation: a lower bound
    while paired_t_power(n, d, alpha) < power:
        n += 1
    while n > 2 and paired_t_power(n - 1, d, alpha) >= power:
        n -= 1
    return n


# -- agreement of two raters ------------------------------------------------------------------
@dataclass(frozen=True)
class Agreement:
    """How well two scorers of the same items agree (a judge model and a deterministic measure).

    `spearman`: rank correlation of the scores (NaN when either is constant), with its p-value;
    `agree`: the share of items both put on the same side of `threshold` (Wilson interval);
    `kappa`: Cohen's kappa of those pass/fail calls (agreement beyond chance; NaN when both
    raters call every item alike); `mad`: the mean absolute difference of the scores.
    """

    n: int
    spearman: float
    spearman_p: float
    agree: Interval
    kappa: float
    mad: float
    threshold: float


def agreement(a: Sequence[float], b: Sequence[float], threshold: float = 0.5) -> Agreement:
    """`Agreement` of paired scores a[i], b[i] in [0, 1] (scipy's Spearman, scikit-learn's kappa)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"agreement needs paired scores; got {x.size} and {y.size}")
    n = int(x.size)
    passed_x, passed_y = x >= threshold, y >= threshold
    same = int((passed_x == passed_y).sum())
    rho = p = kappa = float("nan")
    if n >= 2 and np.ptp(x) > 0 and np.ptp(y) > 0:
        from scipy import stats

        res = stats.spearmanr(x, y)
        rho, p = float(res.statistic), float(res.pvalue)
    if n and len(set(passed_x.tolist()) | set(passed_y.tolist())) > 1:
        from sklearn.metrics import cohen_kappa_score

        kappa = float(cohen_kappa_score(passed_x, passed_y))
    mad = float(np.abs(x - y).mean()) if n else float("nan")
    return Agreement(n, rho, p, proportion_interval(same, n), kappa, mad, threshold)


# -- compatibility ------------------------------------------------------------------------------
def mean_ci(values: Iterable[float | bool], *, seed: int = 0) -> tuple[float, float, float]:
    """(mean, ci_low, ci_high) by `mean_interval`'s rule (Wilson / t / BCa by data and n)."""
    return mean_interval(values, rng=seed).as_tuple()


# -- rank statistics over clustered items -------------------------------------------------------
def resample_counts(n_items: int, clusters: Sequence[Any] | None, n_resamples: int,
                    rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """[n_resamples, n_items]: how many times each item is drawn in each bootstrap resample of whole
    clusters (items are their own clusters without `clusters`). A resample as counts, not as a list
    of indices: a statistic of every resample is then a few array operations (`auroc_resamples`,
    `rho_resamples`), and several statistics on the same counts give paired intervals (a measure's
    AUROC against a baseline's on the same dialogs)."""
    keys = range(n_items) if clusters is None else clusters
    first: dict[Any, int] = {}  # clusters numbered in order of first appearance (the draws' order)
    cluster = np.array([first.setdefault(key, len(first)) for key in keys], dtype=np.int64)
    k = len(first)
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    drawn = np.zeros((n_resamples, k), dtype=np.int64)
    for r in range(n_resamples):
        drawn[r] = np.bincount(gen.integers(0, k, k), minlength=k)
    return drawn[:, cluster]


def _tie_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the order that sorts x, where each run of equal values starts in that order, each item's run)."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new = np.r_[True, xs[1:] != xs[:-1]]
    group = np.empty(len(x), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return order, np.flatnonzero(new), group


def _weighted_mid_ranks(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[R, n]: each item's mid-rank (1-based, ties given their mean rank, as scipy's rankdata) in the
    sample where item i appears counts[r, i] times."""
    order, starts, group = _tie_groups(x)
    per_group = np.add.reduceat(counts[:, order], starts, axis=1)
    below = np.cumsum(per_group, axis=1) - per_group
    return (below + (per_group + 1) / 2)[:, group]


def auroc_resamples(scores: np.ndarray, labels: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[R]: AUROC of `scores` for `labels` (True above False) in each resample (`resample_counts`):
    the Mann-Whitney U of the positives over n1 * n0, ties counted half, which is scikit-learn's
    roc_auc_score of the sample with each item repeated its count (U and n1 * n0 are whole numbers of
    halves, so the quotient is exact to one rounding). NaN where a resample lacks a class."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    counts = np.atleast_2d(counts)
    if not len(scores):
        return np.full(len(counts), np.nan)
    order, starts, _ = _tie_groups(scores)
    pos = np.add.reduceat((counts * labels)[:, order], starts, axis=1).astype(float)
    neg = np.add.reduceat((counts * ~labels)[:, order], starts, axis=1).astype(float)
    below = np.cumsum(neg, axis=1) - neg
    twice_u = (pos * (2 * below + neg)).sum(axis=1)
    n1, n0 = pos.sum(axis=1), neg.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((n1 > 0) & (n0 > 0), twice_u / (2 * n1 * n0), np.nan)


def rho_resamples(a: np.ndarray, b: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[R]: Spearman's rho of a and b in each resample (`resample_counts`): the Pearson correlation of
    mid-ranks, what scipy's spearmanr computes on the sample with each item repeated its count. NaN
    where a resample has fewer than 3 items or a constant a or b."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    counts = np.atleast_2d(counts).astype(float)
    if not len(a):
        return np.full(len(counts), np.nan)
    w = counts.sum(axis=1, keepdims=True)
    ra, rb = _weighted_mid_ranks(a, counts), _weighted_mid_ranks(b, counts)
    ca, cb = ra - (counts * ra).sum(1, keepdims=True) / w, rb - (counts * rb).sum(1, keepdims=True) / w
    cov, va, vb = (counts * ca * cb).sum(1), (counts * ca * ca).sum(1), (counts * cb * cb).sum(1)
    # A constant a or b has one mid-rank, its weighted mean exactly (whole counts times halves): va or vb is 0.
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((w[:, 0] >= 3) & (va > 0) & (vb > 0), cov / np.sqrt(va * vb), np.nan)


def percentile_interval(values: Sequence[float], n_resamples: int, confidence: float) -> tuple[float, float]:
    """The percentile interval of bootstrap `values` (the finite ones); NaNs where fewer than half of
    the `n_resamples` gave one."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < n_resamples // 2:
        return float("nan"), float("nan")
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(finite, [alpha, 1 - alpha])
    return float(low), float(high)


def auroc_interval(scores: Sequence[float] | np.ndarray, labels: Sequence[bool] | np.ndarray,
                   clusters: Sequence[Any] | None = None, *, n_resamples: int = N_RESAMPLES,
                   rng: np.random.Generator | int | None = 0, confidence: float = CONFIDENCE) -> Interval:
    """How well `scores` separate `labels` (True above False): scikit-learn's AUROC, with a
    percentile bootstrap interval over whole `clusters` (e.g. conversations, whose items are not
    independent), or over items without. NaN where one class is missing. The resamples are
    `auroc_resamples`, all at once: a directions run takes thousands of intervals."""
    from sklearn.metrics import roc_auc_score

    x, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    if not 0 < y.sum() < len(y):
        return Interval(float("nan"), float("nan"), float("nan"), len(x), "none", confidence)
    estimate = float(roc_auc_score(y, x))
    counts = resample_counts(len(x), clusters, n_resamples, rng)
    low, high = percentile_interval(auroc_resamples(x, y, counts), n_resamples, confidence)
    return Interval(estimate, low, high, len(x), "cluster-bootstrap", confidence)


def spearman_interval(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray,
                      clusters: Sequence[Any] | None = None, *, n_resamples: int = N_RESAMPLES,
                      rng: np.random.Generator | int | None = 0, confidence: float = CONFIDENCE) -> Interval:
    """Spearman's rank correlation of x and y (scipy), with a percentile bootstrap interval over
    whole `clusters`; NaN where either is constant."""
    from scipy.stats import spearmanr

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return Interval(float("nan"), float("nan"), float("nan"), len(a), "none", confidence)
    estimate = float(spearmanr(a, b).statistic)
    counts = resample_counts(len(a), clusters, n_resamples, rng)
    low, high = percentile_interval(rho_resamples(a, b, counts), n_resamples, confidence)
    return Interval(estimate, low, high, len(a), "cluster-bootstrap", confidence)
