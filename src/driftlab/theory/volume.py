"""Proposition 5.3 (persona-drift paper, Sec. 5.3): volume ratio of approximate cones ~ eps^(d2 - d1).

mu(C^eps) is the normalised spherical measure of C^eps ∩ S^{D-1}. For the eps-approximate
cone of a spherical cone P^d[c, psi] in a d-dim subspace U, a point x of the sphere is inside
iff its orthogonal part has ||v|| <= eps and its U-part is within angle psi of c.

Closed form (derived here, checked against Monte Carlo below). For x uniform on S^{D-1},
||P_U x||^2 ~ Beta(d/2, (D-d)/2) and the direction P_U x / ||P_U x|| is uniform on the unit
sphere of U, independently (x = g/||g|| with g Gaussian; the two groups of coordinates
are independent chi-squares and isotropic directions). Hence
    mu = P(||v||^2 <= eps^2) * cap_d(psi) = I_{eps^2}((D-d)/2, d/2) * cap_d(psi),
where I is the regularised incomplete beta function and cap_d(psi) = (1/2) I_{sin^2 psi}((d-1)/2,
1/2) is the normalised measure of a cap of angular radius psi <= pi/2 on S^{d-1} (Lemma A.2).
As eps -> 0, I_{eps^2}(a, b) ~ eps^{2a} / (a B(a, b)), so
    mu(C0^eps) / mu(Cn^eps) ~ const * eps^{(D-d1) - (D-d2)} = const * eps^{d2-d1},
the proposition's rate, with an explicit constant (`limit_constant`).

Why two Monte Carlo estimators: plain sampling of the sphere is the most independent check
of the derivation but sees nothing once mu < 1e-5. For small eps we use importance sampling
from the angular central Gaussian ACG(Sigma), Sigma = diag(I_d, s^2 I_{D-d}) with s ~ eps:
x = g/||g||, g ~ N(0, Sigma). Its density relative to the uniform measure is
|Sigma|^{-1/2} (x^T Sigma^{-1} x)^{-D/2} (Tyler 1987), so each sample carries the weight
s^{D-d} (x^T Sigma^{-1} x)^{D/2}. That estimator uses neither the Beta law nor the cap
formula, so agreement with the closed form and the fitted slope are genuine checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.integrate import quad
from scipy.special import betainc, gammaln

from driftlab.theory.checks import Check, fmt, verdict
from driftlab.theory.cone import _random_orthogonal


def cap_fraction(d: int, psi: float) -> float:
    """Normalised measure of {y in S^{d-1}: angle(y, c) <= psi} (d = 1: a point of S^0)."""
    if d == 1:
        return 0.5 if psi < math.pi / 2 else 1.0
    half = 0.5 * float(betainc((d - 1) / 2, 0.5, math.sin(psi) ** 2))
    return half if psi <= math.pi / 2 else 1.0 - half


def cap_fraction_lemma(d: int, psi: float) -> float:
    """Lemma A.2 as printed (Li 2010), by quadrature: an independent check of `cap_fraction`."""
    num = quad(lambda t: math.sin(t) ** (d - 2), 0, psi)[0]
    den = 2 * quad(lambda t: math.sin(t) ** (d - 2), 0, math.pi / 2)[0]
    return num / den


def mu_closed(D: int, d: int, psi: float, eps: float | np.ndarray) -> np.ndarray:
    """Closed-form mu(C^eps) for C = P^d[c, psi] in R^D."""
    eps = np.asarray(eps, dtype=float)
    radial = np.ones_like(eps) if d == D else betainc((D - d) / 2, d / 2, eps**2)
    return radial * cap_fraction(d, psi)


def limit_constant(D: int, d1: int, psi1: float, d2: int, psi2: float) -> float:
    """lim_{eps->0} [mu(C0^eps)/mu(Cn^eps)] / eps^(d2-d1), from the small-x beta asymptotics."""

    def lead(d: int) -> float:  # I_x(a, b) ~ x^a / (a B(a, b))
        a, b = (D - d) / 2, d / 2
        return -math.log(a) - (gammaln(a) + gammaln(b) - gammaln(a + b))

    return math.exp(lead(d1) - lead(d2)) * cap_fraction(d1, psi1) / cap_fraction(d2, psi2)


def _sin_integral(a: float, p: int) -> float:
    return quad(lambda t: math.sin(t) ** p, 0, a)[0]


def paper_bound(D: int, d1: int, psi1: float, d2: int, psi2: float, eps: float) -> float:
    """The explicit upper bound at the end of the proof of Prop. 5.3/A.2 (the instruction-stability paper's form)."""
    log_g = gammaln((D - d1 + 1) / 2) + gammaln((d1 - 1) / 2) - gammaln((D - 1) / 2)
    th = math.asin(eps)
    num = _sin_integral(psi1, d1 - 2) * _sin_integral(2 * th, d2 - 2)
    den = _sin_integral(psi2, d2 - 2) * _sin_integral(th, D - 2)
    return math.exp(log_g) * num / den * eps ** (D - d1)


def membership_stats(
    D: int, d: int, n: int, rng: np.random.Generator, chunk: int = 200_000
) -> tuple[np.ndarray, np.ndarray]:
    """Plain Monte Carlo on S^{D-1} with a random subspace U and axis c.

    Returns, per sample, ||v|| (orthogonal part; |x| = 1) and the angle of the U-part to c, so
    membership for any (eps, psi) is a comparison — one sample set serves the whole eps grid.
    The random rotation makes this exercise the geometry, not a coordinate shortcut.
    """
    basis = _random_orthogonal(D, rng)[:, :d]
    c = rng.standard_normal(d)
    c /= np.linalg.norm(c)
    vnorm, angle = [], []
    for start in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - start), D))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        u = x @ basis
        un = np.linalg.norm(u, axis=1)
        vnorm.append(np.sqrt(np.maximum(0.0, 1.0 - un**2)))
        angle.append(np.arccos(np.clip((u @ c) / un, -1, 1)))
    return np.concatenate(vnorm), np.concatenate(angle)


def mu_importance(
    D: int, d: int, psi: float, eps: np.ndarray, n: int, rng: np.random.Generator, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Importance-sampling estimates (means, standard errors) of mu(C^eps) via ACG(diag(1, s^2)).

    Coordinates: the first d axes are U and c = e_1 (the measure is rotation invariant).
    s = scale * eps, with scale ~ sqrt(d / (D - d)) so the proposal's typical ||v||/||u|| matches
    the target region (found empirically to minimise the variance). The same Gaussian draws
    serve every eps (common random numbers): each estimate is still unbiased, and their errors
    are strongly correlated, which makes the fitted log-log slope far more precise.
    """
    eps = np.atleast_1d(np.asarray(eps, dtype=float))
    if scale is None:
        scale = float(np.clip(math.sqrt(d / (D - d)), 0.5, 2.0))
    a = rng.standard_normal((n, d))
    b = rng.standard_normal((n, D - d))
    a2 = np.einsum("ij,ij->i", a, a)
    b2 = np.einsum("ij,ij->i", b, b)
    in_cap = a[:, 0] >= np.sqrt(a2) * math.cos(psi)
    means, ses = np.empty(len(eps)), np.empty(len(eps))
    for i, e in enumerate(eps):
        s2 = (scale * e) ** 2
        g2 = a2 + s2 * b2  # ||g||^2 for g = (a, s b)
        inside = in_cap & (s2 * b2 <= e**2 * g2)
        # weight = s^{D-d} (x^T Sigma^-1 x)^{D/2} with x = g/||g||, x^T Sigma^-1 x = (a2 + b2) / g2
        logw = 0.5 * (D - d) * math.log(s2) + 0.5 * D * np.log((a2 + b2) / g2)
        w = np.where(inside, np.exp(logw), 0.0)
        means[i], ses[i] = w.mean(), w.std(ddof=1) / math.sqrt(n)
    return means, ses


@dataclass
class VolumeConfig:
    D: int = 10
    pairs: tuple[tuple[int, int], ...] = ((2, 4), (2, 6), (3, 8))
    psi1_deg: float = 30.0
    psi2_deg: float = 60.0
    mc_samples: int = 2_000_000
    mc_eps: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)
    is_eps: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.03, 0.1, 0.2, 0.3, 0.5)
    is_samples: int = 400_000
    slope_eps_max: float = 0.01

    @classmethod
    def quick(cls) -> VolumeConfig:
        return cls(
            pairs=((2, 4), (2, 6)),
            mc_samples=200_000,
            mc_eps=(0.5, 0.9),
            is_eps=(1e-4, 1e-3, 1e-2, 0.1),
            is_samples=40_000,
        )


@dataclass
class VolumeResult:
    cfg: VolumeConfig
    # (d, psi_deg, eps, hits, n, mu_mc, mu_closed, z)
    mc: list[tuple[int, float, float, int, int, float, float, float]] = field(default_factory=list)
    # (d, psi_deg, eps, mu_is, se, mu_closed, z)
    imp: list[tuple[int, float, float, float, float, float, float]] = field(default_factory=list)
    # per pair: (d1, d2, slope_is, slope_closed, const_is, limit_constant)
    slopes: list[tuple[int, int, float, float, float, float]] = field(default_factory=list)
    # per pair and eps: (d1, d2, eps, ratio_closed, paper_bound)
    bounds: list[tuple[int, int, float, float, float]] = field(default_factory=list)
    lemma_gap: float = 0.0


def _fit_slope(eps: np.ndarray, ratio: np.ndarray) -> tuple[float, float]:
    """Least-squares slope and intercept of log ratio against log eps."""
    slope, icpt = np.polyfit(np.log(eps), np.log(ratio), 1)
    return float(slope), float(math.exp(icpt))


def run(cfg: VolumeConfig, seed: int = 0) -> VolumeResult:
    rng = np.random.default_rng([seed, 53])
    res = VolumeResult(cfg=cfg)
    psi1, psi2 = math.radians(cfg.psi1_deg), math.radians(cfg.psi2_deg)
    D = cfg.D
    dims = sorted({(d1, psi1) for d1, _ in cfg.pairs} | {(d2, psi2) for _, d2 in cfg.pairs})
    res.lemma_gap = max(abs(cap_fraction(d, p) - cap_fraction_lemma(d, p)) for d, p in dims if d >= 2)
    for d, psi in dims:
        vnorm, angle = membership_stats(D, d, cfg.mc_samples, rng)
        in_cap = angle <= psi
        for eps in cfg.mc_eps:
            hits = int(((vnorm <= eps) & in_cap).sum())
            p = float(mu_closed(D, d, psi, eps))
            res.mc.append(
                (
                    d,
                    math.degrees(psi),
                    eps,
                    hits,
                    cfg.mc_samples,
                    hits / cfg.mc_samples,
                    p,
                    (hits - cfg.mc_samples * p) / math.sqrt(max(cfg.mc_samples * p * (1 - p), 1.0)),
                )
            )
        means, ses = mu_importance(D, d, psi, np.array(cfg.is_eps), cfg.is_samples, rng)
        for eps, m, se in zip(cfg.is_eps, means, ses, strict=True):
            p = float(mu_closed(D, d, psi, eps))
            res.imp.append((d, math.degrees(psi), float(eps), float(m), float(se), p, (m - p) / se))
    imp = {(r[0], r[2]): r[3] for r in res.imp}
    for d1, d2 in cfg.pairs:
        eps = np.array([e for e in cfg.is_eps if e <= cfg.slope_eps_max])
        r_is = np.array([imp[(d1, e)] / imp[(d2, e)] for e in eps])
        r_cf = mu_closed(D, d1, psi1, eps) / mu_closed(D, d2, psi2, eps)
        s_is, c_is = _fit_slope(eps, r_is)
        s_cf, _ = _fit_slope(eps, r_cf)
        res.slopes.append((d1, d2, s_is, s_cf, c_is, limit_constant(D, d1, psi1, d2, psi2)))
        for e in cfg.is_eps:
            if 2 * math.asin(e) <= psi2:  # the proof's covering argument needs 2 arcsin(eps) <= psi2
                ratio = float(mu_closed(D, d1, psi1, e) / mu_closed(D, d2, psi2, e))
                res.bounds.append((d1, d2, float(e), ratio, paper_bound(D, d1, psi1, d2, psi2, float(e))))
    return res


def checks(res: VolumeResult) -> list[Check]:
    cfg = res.cfg
    z_mc = max(abs(r[7]) for r in res.mc)
    z_is = max(abs(r[6]) for r in res.imp)
    rel_is = max(abs(r[3] / r[5] - 1) for r in res.imp)
    slope_err = max(abs(s[2] - (s[1] - s[0])) for s in res.slopes)
    slope_txt = "; ".join(f"({s[0]},{s[1]}): {s[2]:.3f} vs {s[1] - s[0]}" for s in res.slopes)
    const_err = max(abs(s[4] / s[5] - 1) for s in res.slopes)
    bound_ok = all(b[3] <= b[4] for b in res.bounds)
    bound_slack = min(b[4] / b[3] for b in res.bounds) if res.bounds else float("nan")
    setup = f"D={cfg.D}, psi1={cfg.psi1_deg:g} deg, psi2={cfg.psi2_deg:g} deg"
    return [
        Check(
            "prop53.lemma",
            "Lemma A.2 (cap measure, quadrature) = Beta closed form",
            f"max |diff| = {fmt(res.lemma_gap, 2)}",
            "< 1e-9",
            verdict(res.lemma_gap < 1e-9),
            setup,
            {"max_abs_diff": res.lemma_gap},
        ),
        Check(
            "prop53.closed_mc",
            "mu(C^eps) closed form (Beta x cap) vs plain Monte Carlo",
            f"max |z| = {fmt(z_mc, 3)} over {len(res.mc)} (d, eps) cells",
            "|z| <= 4 (binomial)",
            verdict(z_mc <= 4),
            f"{cfg.mc_samples:,} uniform points per d, random subspace; eps in {list(cfg.mc_eps)}",
            {"max_abs_z": z_mc},
        ),
        Check(
            "prop53.closed_is",
            "mu(C^eps) closed form vs importance sampling (small eps)",
            f"max |z| = {fmt(z_is, 3)}, max rel. err = {fmt(rel_is, 2)}",
            "|z| <= 4",
            verdict(z_is <= 4),
            f"ACG proposal, {cfg.is_samples:,} samples per cell, eps from "
            f"{min(cfg.is_eps):g} to {max(cfg.is_eps):g}",
            {"max_abs_z": z_is, "max_rel_err": rel_is},
        ),
        Check(
            "prop53.slope",
            "Prop 5.3: log-log slope of mu(C0^eps)/mu(Cn^eps) = d2 - d1",
            slope_txt,
            "|slope - (d2-d1)| <= 0.05",
            verdict(slope_err <= 0.05),
            f"fit on importance-sampling estimates, eps <= {cfg.slope_eps_max:g}",
            {"max_slope_err": slope_err, **{f"slope_{s[0]}_{s[1]}": s[2] for s in res.slopes}},
        ),
        Check(
            "prop53.constant",
            "Prefactor: ratio / eps^(d2-d1) -> closed-form limit constant",
            f"max rel. diff = {fmt(const_err, 2)}",
            "<= 0.1",
            verdict(const_err <= 0.1),
            "the constant hidden in the paper's '≲'",
            {"max_rel_diff": const_err},
        ),
        Check(
            "prop53.paper_bound",
            "Paper's explicit bound (end of proof) >= exact ratio",
            f"min bound / exact = {fmt(bound_slack, 3)}",
            ">= 1",
            verdict(bound_ok),
            f"{len(res.bounds)} (pair, eps) points with 2 arcsin(eps) <= psi2",
            {"min_slack": bound_slack},
        ),
    ]
