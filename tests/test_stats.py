"""Statistics shared by protocols and reports (driftlab.stats), checked against slow references."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import numpy as np
import pytest
from scipy import stats

from driftlab import stats as ds
from driftlab.stats import (
    BOOTSTRAP_MIN_N,
    bootstrap_mean_ci,
    holm,
    mean_ci,
    mean_interval,
    paired_t_power,
    paired_test,
    pairs_needed_means,
    pairs_needed_proportions,
    proportion_interval,
    t_interval,
    wilcoxon_signed_rank,
    with_holm,
)


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


def test_mean_ci_is_mean_interval_as_a_tuple():
    values = [True, False, True, True, False, True, True, False]
    assert mean_ci(values) == mean_interval(values).as_tuple()
    m, lo1, hi1 = mean_ci([0.5])
    assert m == 0.5 and math.isnan(lo1) and math.isnan(hi1)
    assert all(math.isnan(x) for x in mean_ci([]))


# -- intervals chosen by n ------------------------------------------------------------------------
def test_the_interval_rule_picks_by_data_and_n() -> None:
    gen = np.random.default_rng(4)
    assert mean_interval([1, 0, 1, 1]).method == "wilson"  # 0/1 values: a proportion, at any n
    assert mean_interval((gen.uniform(size=200) < 0.4).astype(float)).method == "wilson"
    assert mean_interval(gen.uniform(size=BOOTSTRAP_MIN_N - 1)).method == "t"
    assert mean_interval(gen.uniform(size=BOOTSTRAP_MIN_N)).method == "bca"
    assert mean_interval([0.3]).method == "none" and math.isnan(mean_interval([0.3]).low)
    assert mean_interval([]).n == 0 and math.isnan(mean_interval([]).estimate)
    assert mean_interval([0.4] * 5).as_tuple() == (0.4, 0.4, 0.4)  # constant graded values
    # docs/report.md's conventions: a single 0 and three 0s keep their Wilson width.
    assert mean_interval([0.0]).high == pytest.approx(0.79, abs=5e-3) and mean_interval([0.0]).low == 0.0
    assert mean_interval([0.0] * 3).high == pytest.approx(0.56, abs=5e-3)
    # Twelve of twelve right is not certainty: Wilson keeps width where a bootstrap has none.
    all_right = mean_interval([1.0] * 12)
    assert all_right.high == 1.0 and all_right.low == pytest.approx(0.7575, abs=1e-4)
    assert mean_interval([1.0, float("nan"), 0.0]).n == 2  # NaN dropped
    x = gen.uniform(size=40)
    assert mean_interval(x, rng=3).as_tuple()[1:] == bootstrap_mean_ci(x, rng=3)


@pytest.mark.parametrize("n", [2, 4, 9, 29])
def test_t_interval_matches_scipy(n: int) -> None:
    x = np.random.default_rng(n).normal(0.3, 0.2, size=n)
    iv = t_interval(x)
    lo, hi = stats.t.interval(0.95, n - 1, loc=x.mean(), scale=stats.sem(x))
    assert (iv.low, iv.high) == pytest.approx((lo, hi), rel=1e-12) and iv.n == n and iv.method == "t"


def test_t_interval_of_qwen_papers_four_conversations() -> None:
    """Issue 22's example: qwen-paper's 4 conversations (overall agent stability, committed records)
    have a bootstrap CI of [0.07, 0.45] but a t-interval of [-0.05, 0.63]; their paired
    difference from the empty-user ablation has a t-interval of [-0.22, +0.64]."""
    persona = {0: 0.0, 1: 0.28965745236617696, 2: 0.375, 3: 0.5}
    empty = {0: 0.5, 1: 0.6361017145378838, 2: 0.5, 3: 0.375}
    iv = mean_interval(list(persona.values()))
    assert iv.method == "t" and (round(iv.low, 2), round(iv.high, 2)) == (-0.05, 0.63)
    t = paired_test(empty, persona)
    assert (round(t.diff.low, 2), round(t.diff.high, 2)) == (-0.22, 0.64)
    assert (t.better, t.worse, t.method) == (3, 1, "Wilcoxon signed-rank (exact)")
    assert t.p == pytest.approx(0.375)  # ranks 1..4, T- = 1 (the 0.125 drop): P(T- <= 1) * 2 = 3/16 * 2
    assert "too few pairs" in t.warning()


@pytest.mark.parametrize("k, n", [(0, 10), (3, 20), (7, 12), (12, 12), (40, 100)])
def test_proportion_intervals_match_statsmodels(k: int, n: int) -> None:
    from statsmodels.stats.proportion import proportion_confint

    wilson = proportion_interval(k, n)
    exact = proportion_interval(k, n, method="exact")
    assert (wilson.low, wilson.high) == pytest.approx(proportion_confint(k, n, method="wilson"), abs=1e-10)
    assert (exact.low, exact.high) == pytest.approx(proportion_confint(k, n, method="beta"), abs=1e-10)
    assert wilson.estimate == k / n and wilson.method == "wilson" and exact.method == "exact"
    assert exact.high - exact.low >= wilson.high - wilson.low  # exact never undercovers: it is wider


# -- paired tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("better, worse, tied, p", [(3, 0, 17, 0.25), (5, 0, 7, 0.0625), (4, 0, 6, 0.125),
                                                     (0, 0, 5, 1.0), (9, 1, 10, 0.021484375)])
def test_exact_mcnemar_hand_checked_and_against_statsmodels(better: int, worse: int, tied: int, p: float) -> None:
    """Issue 22's cases: CounterFact 3 better / 0 worse of 20 -> p = 0.25; pronouns 5 vs 0 of 12 ->
    0.0625; the smoke sweep's 4 vs 0 -> 0.125 (2 * 0.5^k when every discordant pair goes one way)."""
    from statsmodels.stats.contingency_tables import mcnemar

    a = [1.0] * better + [0.0] * worse + [1.0] * (tied // 2) + [0.0] * (tied - tied // 2)
    b = [0.0] * better + [1.0] * worse + [1.0] * (tied // 2) + [0.0] * (tied - tied // 2)
    t = paired_test(a, b)
    assert t.method == "exact McNemar" and (t.better, t.worse, t.tied, t.n) == (better, worse, tied, len(a))
    assert t.p == pytest.approx(p, rel=1e-12)
    table = [[tied // 2, better], [worse, tied - tied // 2]]
    assert t.p == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-12)
    assert t.diff.estimate == pytest.approx((better - worse) / len(a))


def _paired_table(r: int, s: int, t: int, u: int) -> tuple[np.ndarray, np.ndarray]:
    """0/1 outcomes of a paired 2x2 table: r both right, s only a, t only b, u neither."""
    a = np.array([1.0] * (r + s) + [0.0] * (t + u))
    b = np.array([1.0] * r + [0.0] * s + [1.0] * t + [0.0] * u)
    return a, b


def test_paired_proportions_get_newcombes_interval_as_published() -> None:
    """Fagerland, Lydersen & Laake's contingencytables (R; tests/testthat/test-ch8.R): the table
    [[59, 6], [16, 80]] gives -0.0621 (95% CI -0.1186 to -0.0046) by Newcombe's square-and-add."""
    a, b = _paired_table(59, 6, 16, 80)
    t = paired_test(a, b)
    assert t.diff.method == "newcombe" and t.method == "exact McNemar"
    assert (round(t.diff.estimate, 4), round(t.diff.low, 4), round(t.diff.high, 4)) == (-0.0621, -0.1186, -0.0046)
    far = paired_test([1.0] * 18 + [0.0] * 2, [0.0] * 20)  # a t-interval of these differences reaches past 1
    assert stats.t.interval(0.95, 19, loc=0.9, scale=stats.sem([1.0] * 18 + [0.0] * 2))[1] > 1.0
    assert -1.0 <= far.diff.low < 0.9 < far.diff.high <= 1.0
    graded = paired_test([2.0, 3.5, 4.0], [0.1, 0.2, 0.0])  # graded scores: the rule for means, no bound
    assert graded.diff.method == "t" and graded.diff.high > 3.0


def _coverage(n: int, probs: tuple[float, float, float, float], interval) -> float:
    """Exact coverage by enumerating every paired 2x2 table of n pairs (the slow reference)."""
    true, covered = probs[1] - probs[2], 0.0
    for r in range(n + 1):
        for s in range(n + 1 - r):
            for t in range(n + 1 - r - s):
                weight = stats.multinomial.pmf([r, s, t, n - r - s - t], n, probs)
                if weight > 1e-12:
                    low, high = interval(*_paired_table(r, s, t, n - r - s - t))
                    covered += weight * (low - 1e-12 <= true <= high + 1e-12)
    return covered


def test_newcombes_paired_interval_keeps_its_coverage_where_a_t_interval_does_not() -> None:
    """Few discordant pairs, mostly one way (a PASTA table's 3 better / 0 worse of 20): the
    t-interval of the -1/0/+1 differences covers the true difference 88% of the time, Newcombe's
    at least the nominal 95% (exact over all tables)."""
    from driftlab.stats import paired_proportion_interval, t_interval

    def newcombe(a, b):
        iv = paired_proportion_interval(a, b)
        return iv.low, iv.high

    def t_int(a, b):
        iv = t_interval(a - b)
        return (iv.low, iv.high) if np.isfinite(iv.low) else (iv.estimate, iv.estimate)

    probs = (0.4, 0.1, 0.02, 0.48)
    assert _coverage(20, probs, newcombe) >= 0.95 > 0.9 > _coverage(20, probs, t_int)
    assert _coverage(20, (0.6, 0.15, 0.05, 0.2), newcombe) >= 0.95


def test_sign_test_of_the_sweeps_cfg_claim() -> None:
    """Issue 22: CFG vs plain over 10 pairs, 4 constant, 5 better / 1 worse: sign test p = 0.22."""
    cfg = [0.6, 0.7, 0.5, 0.9, 0.8, 0.2, 0.5, 0.5, 0.5, 0.5]
    plain = [0.5, 0.6, 0.4, 0.3, 0.7, 0.4, 0.5, 0.5, 0.5, 0.5]
    t = paired_test(cfg, plain, method="sign")
    assert (t.better, t.worse, t.tied, t.method) == (5, 1, 4, "sign test")
    assert t.p == pytest.approx(0.21875) and round(t.p, 2) == 0.22
    from statsmodels.stats.descriptivestats import sign_test as sm_sign

    assert t.p == pytest.approx(sm_sign(np.subtract(cfg, plain))[1])


@pytest.mark.parametrize("n", [5, 9, 20, 45])
def test_wilcoxon_without_ties_matches_scipys_exact(n: int) -> None:
    gen = np.random.default_rng(n)
    d = gen.normal(0.2, 1.0, size=n)
    p, name = wilcoxon_signed_rank(d)
    assert name == "Wilcoxon signed-rank (exact)"
    assert p == pytest.approx(stats.wilcoxon(d, method="exact").pvalue, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_wilcoxon_with_ties_and_zeros_matches_scipys_full_permutation(seed: int) -> None:
    """Graded scores (probe means in steps of 1/8) tie often; scipy's "exact" ignores ties, its
    full sign-flip permutation does not: ours must equal the permutation, zeros dropped."""
    gen = np.random.default_rng(seed)
    d = np.round(gen.normal(0.1, 0.3, size=12) * 8) / 8
    nz = d[d != 0]
    assert len(np.unique(np.abs(nz))) < len(nz)  # there are ties (the case under test)
    p, _ = wilcoxon_signed_rank(d)
    ref = stats.wilcoxon(nz, method=stats.PermutationMethod(n_resamples=np.inf)).pvalue
    assert p == pytest.approx(ref, rel=1e-9)


def test_wilcoxon_beyond_the_exact_limit_is_scipys_normal_approximation(monkeypatch) -> None:
    d = np.random.default_rng(1).normal(0.1, 1.0, size=60)
    monkeypatch.setattr(ds, "WILCOXON_EXACT_MAX", 50)
    p, name = wilcoxon_signed_rank(d)
    assert "normal approx" in name and p == pytest.approx(stats.wilcoxon(d, method="approx").pvalue)


def test_paired_test_pairs_by_key_and_checks_its_inputs() -> None:
    a = {"x": 1.0, "y": 0.0, "z": 1.0, "w": 1.0}
    b = {"w": 0.0, "y": 0.0, "x": 1.0, "v": 5.0}  # v and z unpaired
    t = paired_test(a, b)
    assert (t.n, t.better, t.worse, t.tied, t.method) == (3, 1, 0, 2, "exact McNemar")
    assert t.diff.estimate == pytest.approx(1 / 3)
    assert paired_test([0.2, float("nan")], [0.1, 0.3]).n == 1  # a pair with a NaN is dropped
    with pytest.raises(ValueError, match="McNemar"):
        paired_test([0.5, 1.0], [0.0, 1.0], method="mcnemar")
    with pytest.raises(ValueError, match="length"):
        paired_test([1.0], [1.0, 0.0])
    with pytest.raises(TypeError):
        paired_test({"a": 1.0}, [1.0])
    empty = paired_test({}, b)
    assert empty.n == 0 and empty.p == 1.0 and empty.warning() == "no pairs: nothing to compare"


def test_warnings_say_when_n_cannot_support_a_difference() -> None:
    assert "all 5 pairs tied" in paired_test([1.0] * 5, [1.0] * 5).warning()
    few = paired_test([1.0] * 5 + [0.0] * 7, [0.0] * 12)
    assert few.min_p == 0.0625 and "even all 5 one way would give p = 0.0625" in few.warning()
    enough = paired_test([1.0] * 9 + [0.0] * 11, [0.0] * 9 + [1.0] + [0.0] * 10)
    assert enough.warning() is None and enough.significant  # 9 vs 1: p = 0.021
    corrected = with_holm([enough, enough, enough])[0]
    assert corrected.p_holm == pytest.approx(3 * enough.p) and not corrected.significant
    assert "Holm-corrected p" in corrected.warning()
    row = corrected.as_dict("gain_")
    assert row["gain_n"] == 20 and row["gain_method"] == "exact McNemar" and row["gain_ci_method"] == "newcombe"


# -- Holm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_holm_matches_statsmodels(seed: int, holm_reference) -> None:
    gen = np.random.default_rng(seed)
    p = gen.uniform(0, 0.2, size=int(gen.integers(1, 12)))
    p[gen.uniform(size=p.size) < 0.2] = 0.01  # ties
    assert holm(p) == pytest.approx(holm_reference(p), rel=1e-12)


def test_holm_leaves_nan_out_of_the_family() -> None:
    out = holm([0.01, float("nan"), 0.04])
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)
    assert holm([]) == [] and with_holm([None]) == [None]


# -- power ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [0.2, 0.5, 0.8, 1.3])
def test_pairs_needed_for_means_match_statsmodels(d: float) -> None:
    from statsmodels.stats.power import TTestPower

    ref = TTestPower().solve_power(effect_size=d, alpha=0.05, power=0.8)
    assert pairs_needed_means(d * 0.3, 0.3) == math.ceil(ref)
    assert paired_t_power(10, d) == pytest.approx(TTestPower().power(effect_size=d, nobs=10, alpha=0.05), rel=1e-8)


def _slow_mcnemar_power(n: int, p_better: float, p_worse: float, alpha: float = 0.05) -> float:
    """The exact power of the exact McNemar test by brute force: for every discordant count k and
    better count x, the probability of (k, x) times whether scipy's binomtest rejects at alpha."""
    psi = p_better + p_worse
    power = 0.0
    for k in range(1, n + 1):
        pk = stats.binom.pmf(k, n, psi)
        for x in range(k + 1):
            if stats.binomtest(x, k, 0.5).pvalue < alpha:
                power += pk * stats.binom.pmf(x, k, p_better / psi)
    return power


@pytest.mark.parametrize("n, p_better, p_worse", [(20, 0.15, 0.05), (57, 0.08, 0.02), (40, 0.3, 0.1), (9, 0.4, 0.0)])
def test_mcnemar_power_matches_brute_force(n: int, p_better: float, p_worse: float) -> None:
    assert ds.mcnemar_power(n, p_better, p_worse) == pytest.approx(_slow_mcnemar_power(n, p_better, p_worse), abs=1e-12)


@pytest.mark.parametrize("p_better, p_worse", [(0.15, 0.05), (0.08, 0.02), (0.3, 0.1), (0.05, 0.0)])
def test_pairs_needed_for_proportions_give_the_power_asked(p_better: float, p_worse: float) -> None:
    """The n returned is the first, from Connor's approximation up, whose exact power reaches 0.8;
    Connor's n itself falls short (the exact test is conservative), so the search is needed."""
    n = pairs_needed_proportions(p_better - p_worse, p_better + p_worse)
    assert ds.mcnemar_power(n, p_better, p_worse) >= 0.8 > ds.mcnemar_power(n - 1, p_better, p_worse)
    delta, psi = p_better - p_worse, p_better + p_worse
    connor = math.ceil((1.959963984540054 * math.sqrt(psi) + 0.8416212335729143 * math.sqrt(psi - delta**2)) ** 2
                       / delta**2)
    assert connor <= n <= 1.35 * connor + 5
    assert ds.mcnemar_power(int(n * 2 / 3), p_better, p_worse) < 0.72  # (equal to brute force: the test above)


def test_power_inputs_are_checked() -> None:
    assert pairs_needed_proportions(0.1, 0.1) < pairs_needed_proportions(0.1, 0.3)  # more noise, more pairs
    with pytest.raises(ValueError, match="discordant share"):
        pairs_needed_proportions(0.2, 0.1)
    with pytest.raises(ValueError, match="effect"):
        pairs_needed_proportions(0.0, 0.1)
    with pytest.raises(ValueError, match="sd"):
        pairs_needed_means(0.1, 0.0)


# -- clustered paired comparisons (MMLU questions asked after several dialogs) ------------------
def _slow_sign_flip_p(sums: list[float]) -> float:
    """The obvious reference: every one of the 2^k sign patterns, one at a time."""
    import itertools

    observed = abs(sum(sums))
    totals = [abs(sum(s * v for s, v in zip(signs, sums))) for signs in itertools.product((-1, 1), repeat=len(sums))]
    return sum(t >= observed - 1e-12 for t in totals) / len(totals)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sign_flip_test_equals_full_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    integer = [int(v) for v in rng.integers(-6, 7, size=13)]  # paired 0/1 items: integer sums (convolution path)
    graded = [float(v) for v in rng.normal(0.3, 1.0, size=11)]  # graded items: enumerated sign flips
    assert ds.sign_flip_test(integer)[0] == pytest.approx(_slow_sign_flip_p(integer), abs=1e-12)
    assert ds.sign_flip_test(graded)[0] == pytest.approx(_slow_sign_flip_p(graded), abs=1e-12)
    assert ds.sign_flip_test([0, 0, 0]) == (1.0, "cluster sign-flip (exact)")


def test_sign_flip_test_beyond_the_exact_limit_draws_random_flips(monkeypatch) -> None:
    sums = [float(v) for v in np.random.default_rng(3).normal(0.4, 1.0, size=12)]
    monkeypatch.setattr(ds, "CLUSTER_EXACT_MAX", 8)
    p, method = ds.sign_flip_test(sums)
    assert "random flips" in method
    assert p == pytest.approx(_slow_sign_flip_p(sums), abs=0.005)  # 200k flips: MC error ~0.001


def _clustered_items(rng: np.random.Generator, k: int, m: int, shift: float = 0.0):
    """k dialogs of m questions; each dialog's text sets its own accuracy under each condition
    (drawn independently: the two conditions' dialogs differ), steered lower by `shift`."""
    a, b, clusters = {}, {}, {}
    pa, pb = rng.beta(2, 2, size=k), np.clip(rng.beta(2, 2, size=k) - shift, 0, 1)
    for j in range(k):
        for i in range(m):
            q = j * m + i
            a[q], b[q], clusters[q] = float(rng.random() < pa[j]), float(rng.random() < pb[j]), j
    return a, b, clusters


def test_clustered_test_keeps_its_level_where_question_level_mcnemar_does_not() -> None:
    """Simulated under "no difference" with a dialog effect (the slow reference): the sign-flip
    test over 20 dialogs rejects about alpha of the time, McNemar over the 200 questions far more;
    the cluster interval covers the true difference (0) near its nominal rate."""
    rng = np.random.default_rng(0)
    runs, cluster_rejects, mcnemar_rejects, covered = 300, 0, 0, 0
    for _ in range(runs):
        a, b, clusters = _clustered_items(rng, 20, 10)
        t = ds.clustered_paired_test(a, b, clusters)
        cluster_rejects += t.p < 0.05
        mcnemar_rejects += paired_test(a, b).p < 0.05
        covered += t.diff.low <= 0 <= t.diff.high
        assert t.clusters == 20 and t.n == 200 and t.diff.method == "cluster-t"
    assert cluster_rejects / runs <= 0.08  # nominal 0.05; MC error ~0.013
    assert mcnemar_rejects / runs >= 0.15  # the questions are not independent evidence
    assert covered / runs >= 0.90


def test_clustered_interval_is_the_t_interval_of_cluster_means_at_equal_sizes() -> None:
    a, b, clusters = _clustered_items(np.random.default_rng(5), 8, 10, shift=0.2)
    t = ds.clustered_paired_test(a, b, clusters)
    means = [np.mean([a[q] - b[q] for q in a if clusters[q] == j]) for j in range(8)]
    ref = t_interval(means)
    assert (t.diff.estimate, t.diff.low, t.diff.high) == pytest.approx((ref.estimate, ref.low, ref.high))
    sums = [sum(a[q] - b[q] for q in a if clusters[q] == j) for j in range(8)]
    assert t.p == pytest.approx(_slow_sign_flip_p(sums))
    assert t.better == sum(a[q] > b[q] for q in a) and t.worse == sum(a[q] < b[q] for q in a)


def test_one_cluster_is_the_item_level_test_marked_as_one_cluster() -> None:
    a = {i: float(i % 3 == 0) for i in range(40)}
    b = {i: float(i % 2 == 0) for i in range(40)}
    t = ds.clustered_paired_test(a, b, dict.fromkeys(a, 0))
    ref = paired_test(a, b)
    assert (t.p, t.diff, t.method) == (ref.p, ref.diff, ref.method)
    assert t.clusters == 1
    # Four dialogs all one way cannot reach p < 0.05 (2 / 16): the warning says clusters, not pairs.
    few = ds.clustered_paired_test({i: 1.0 for i in range(8)}, {i: 0.0 for i in range(8)},
                                   {i: i // 2 for i in range(8)})
    assert few.p == pytest.approx(2 / 16) and "too few clusters" in few.warning()


def test_every_resamples_statistic_is_scikit_learns_and_scipys_on_the_repeated_sample() -> None:
    """`auroc_resamples` and `rho_resamples` give, for every resample at once, scikit-learn's AUROC and
    scipy's Spearman rho of the sample with each item repeated its count: on data with many ties and
    none, with counts from whole clusters; NaN where a resample lacks a class, is constant or too small."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from driftlab.stats import auroc_resamples, resample_counts, rho_resamples

    gen = np.random.default_rng(0)
    for x, y in ((gen.integers(0, 4, 60).astype(float), gen.integers(0, 3, 60).astype(float)),
                 (gen.normal(size=57), gen.normal(size=57))):
        labels = y > np.median(y)
        counts = resample_counts(len(x), np.arange(len(x)) // 3, 40, rng=1)
        aucs, rhos = auroc_resamples(x, labels, counts), rho_resamples(x, y, counts)
        for c, auc, rho in zip(counts, aucs, rhos, strict=True):
            assert abs(auc - roc_auc_score(np.repeat(labels, c), np.repeat(x, c))) < 1e-12
            assert abs(rho - spearmanr(np.repeat(x, c), np.repeat(y, c)).statistic) < 1e-12
    x = np.array([1.0, 2.0, 3.0, 4.0])
    one_class = np.array([[2, 0, 2, 0]])  # only items 0 and 2 drawn: both labelled True below
    assert np.isnan(auroc_resamples(x, np.array([True, False, True, False]), one_class)).all()
    assert np.isnan(rho_resamples(x, np.array([5.0, 1.0, 5.0, 2.0]), one_class)).all()  # b constant where drawn
    assert np.isnan(rho_resamples(x, x, np.array([[1, 1, 0, 0]]))).all()  # 2 items
    nothing = np.zeros((3, 0), dtype=int)  # no item at all (no dialog that both holds and fails)
    none = auroc_resamples(x[:0], x[:0] > 0, nothing)
    assert len(none) == 3 and np.isnan(none).all()
    assert np.isnan(rho_resamples(x[:0], x[:0], nothing)).all()
