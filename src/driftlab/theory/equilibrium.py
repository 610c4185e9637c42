"""The equilibrium model of multi-turn drift (Dongre et al. 2025, "Drift No More? Context Equilibria in
Multi-Turn LLM Interactions"), fitted per condition and checked against a model without equilibrium.

Model: a drift measure D_t (their KL to a goal-consistent reference; any per-turn measure works) moves
by a restoring force plus noise,

    D_{t+1} - D_t = a + b D_t + eta_t,   eta_t ~ N(0, sigma^2) independent,

their Eq. (1) with a linear restoring term, fitted as they fit it: ordinary least squares of the step on
the level over every (D_t, D_{t+1}) of a condition's conversations. With -2 < b < 0 the series returns
towards the equilibrium D* = -a/b at rate -b per turn (D_{t+1} - D* = (1 + b)(D_t - D*) + eta_t);
b = 0 is a random walk with drift a, which settles nowhere. Why a second model: b < 0 alone does not
show a restoring force, since noise around a fixed mean (no memory at all) gives b near -1 as well;
so the fit is compared, by held-out likelihood (each conversation predicted by fits to the others),
with the random walk (b = 0), and the rate says how much memory the series has (near 1: none).

Intervals are percentile bootstraps over conversations (a conversation's turns are not independent).
`compare_equilibria` tests whether one condition's D* is lower than another's (a reminder, SPR).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from driftlab.errors import DriftlabError

LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class StepFit:
    """One OLS fit of D_{t+1} - D_t = a + b D_t + eta: a, b, sigma (b = 0 for the random walk)."""

    a: float
    b: float
    sigma: float

    def loglik(self, level: np.ndarray, step: np.ndarray) -> float:
        """The Gaussian log-likelihood of steps given levels."""
        resid = step - (self.a + self.b * level)
        var = max(self.sigma, 1e-12) ** 2
        return float(-0.5 * (len(step) * (LOG_2PI + math.log(var)) + (resid**2).sum() / var))


@dataclass(frozen=True)
class EquilibriumFit:
    """A condition's fit: the equilibrium D* = -a/b, the rate of return -b and the noise sigma, each with
    its bootstrap interval over conversations; and the held-out comparison with the random walk."""

    a: float
    b: float
    sigma: float
    d_star: float  # NaN where b >= 0 (no equilibrium)
    rate: float  # -b
    intervals: dict[str, tuple[float, float]]  # a, b, sigma, d_star, rate -> (low, high)
    n_conversations: int
    n_steps: int
    heldout_gain: float  # mean per step of log L(equilibrium) - log L(random walk), each conversation held out
    heldout_better: int  # conversations the equilibrium model predicts better
    heldout_p: float  # two-sided sign test over conversations

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()} | {
            "intervals": {k: list(v) for k, v in self.intervals.items()}}


def _pairs(series: Sequence[Sequence[float]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per conversation: (levels D_1..D_{T-1}, steps D_{t+1} - D_t)."""
    out = []
    for s in series:
        x = np.asarray(s, dtype=np.float64)
        x = x[np.isfinite(x)]
        if len(x) >= 2:
            out.append((x[:-1], np.diff(x)))
    return out


def ols(level: np.ndarray, step: np.ndarray, equilibrium: bool = True) -> StepFit:
    """The least-squares fit of steps on levels (a and b), or on a constant alone (the random walk)."""
    if equilibrium:
        X = np.column_stack([np.ones_like(level), level])
        coef, *_ = np.linalg.lstsq(X, step, rcond=None)
        a, b = float(coef[0]), float(coef[1])
    else:
        a, b = float(step.mean()), 0.0
    resid = step - (a + b * level)
    dof = max(1, len(step) - (2 if equilibrium else 1))
    return StepFit(a, b, float(math.sqrt((resid**2).sum() / dof)))


def _summary(fit: StepFit) -> dict[str, float]:
    d_star = -fit.a / fit.b if fit.b < 0 else float("nan")
    return {"a": fit.a, "b": fit.b, "sigma": fit.sigma, "d_star": d_star, "rate": -fit.b}


def fit_equilibrium(series: Sequence[Sequence[float]], *, n_boot: int = 2000, seed: int = 0,
                    confidence: float = 0.95) -> EquilibriumFit:
    """Fit the model to a condition's series (one per conversation, in turn order; NaN turns dropped)."""
    pairs = _pairs(series)
    if len(pairs) < 2:
        raise DriftlabError(f"The equilibrium fit needs at least 2 conversations of 2 or more turns; got {len(pairs)}.",
                            hint="Run more pairs or more rounds.")
    level = np.concatenate([p[0] for p in pairs])
    step = np.concatenate([p[1] for p in pairs])
    fit = ols(level, step)
    point = _summary(fit)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(pairs), len(pairs))
        boots.append(_summary(ols(np.concatenate([pairs[i][0] for i in pick]),
                                  np.concatenate([pairs[i][1] for i in pick]))))
    tail = (1 - confidence) / 2 * 100
    intervals = {}
    for name in point:
        values = np.array([b[name] for b in boots])
        values = values[np.isfinite(values)]
        intervals[name] = (float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))) \
            if len(values) else (float("nan"), float("nan"))
    gains = heldout_gains(pairs)
    better = int((gains > 0).sum())
    from scipy.stats import binomtest

    decided = int((gains != 0).sum())
    p = float(binomtest(better, decided).pvalue) if decided else 1.0
    return EquilibriumFit(**point, intervals=intervals, n_conversations=len(pairs), n_steps=len(step),
                          heldout_gain=float(gains.sum() / len(step)), heldout_better=better, heldout_p=p)


def heldout_gains(pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per conversation, held out of both fits: log L(equilibrium) - log L(random walk) of its steps."""
    gains = []
    for i, (level, step) in enumerate(pairs):
        rest_level = np.concatenate([p[0] for j, p in enumerate(pairs) if j != i])
        rest_step = np.concatenate([p[1] for j, p in enumerate(pairs) if j != i])
        gains.append(ols(rest_level, rest_step).loglik(level, step) -
                     ols(rest_level, rest_step, equilibrium=False).loglik(level, step))
    return np.array(gains)


def compare_equilibria(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]], *, n_boot: int = 2000,
                       seed: int = 0, confidence: float = 0.95) -> dict[str, float]:
    """D*(second) - D*(first) with a bootstrap interval (conversations of each condition resampled on their
    own) and the bootstrap p-value of 'second is not lower' (the share of resamples with a difference >= 0)."""
    a, b = _pairs(first), _pairs(second)
    rng = np.random.default_rng(seed)

    def d_star(pairs, pick) -> float:
        fit = ols(np.concatenate([pairs[i][0] for i in pick]), np.concatenate([pairs[i][1] for i in pick]))
        return -fit.a / fit.b if fit.b < 0 else float("nan")

    point = d_star(b, range(len(b))) - d_star(a, range(len(a)))
    diffs = np.array([d_star(b, rng.integers(0, len(b), len(b))) - d_star(a, rng.integers(0, len(a), len(a)))
                      for _ in range(n_boot)])
    diffs = diffs[np.isfinite(diffs)]
    tail = (1 - confidence) / 2 * 100
    return {"difference": point, "low": float(np.percentile(diffs, tail)), "high": float(np.percentile(diffs, 100 - tail)),
            "p_not_lower": float((diffs >= 0).mean()) if len(diffs) else float("nan"), "n_resamples": len(diffs)}


def simulate(a: float, b: float, sigma: float, *, d0: float, turns: int, conversations: int,
             seed: int = 0) -> list[np.ndarray]:
    """Series of the model (b = 0: a random walk), for checks and for reading a fit's numbers."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(conversations):
        d = [d0]
        for _ in range(turns - 1):
            d.append(d[-1] + a + b * d[-1] + sigma * rng.standard_normal())
        out.append(np.array(d))
    return out
