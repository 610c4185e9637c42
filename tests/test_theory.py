"""Theory checks: simulations against closed forms, each with a control that must fail.

Statistical tolerances are 4-sigma bands for fixed seeds, so a pass is not luck and a wrong
formula (shifted index, swapped Beta parameters, wrong exponent) is rejected by the same data.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from driftlab.errors import DriftlabError
from driftlab.theory import cone, embeddings, volume, wendel

# ---------------------------------------------------------------- Theorem 5.1


@pytest.fixture(scope="module")
def cone_result() -> cone.ConeResult:
    return cone.run(cone.ConeConfig.quick(), seed=0)


def test_eps_tilde_limits() -> None:
    # theta -> 0: the hull of C^eps is no wider than C^eps itself; eps -> 1: no constraint left.
    assert cone.eps_tilde(0.1, 0.0) == pytest.approx(0.1)
    assert cone.eps_tilde(0.999999, 1.0) == pytest.approx(1.0, abs=1e-5)
    assert cone.eps_tilde(0.1, math.radians(30)) == pytest.approx(0.1 / math.sqrt(0.01 + 0.75 * 0.99))


def test_sharpness_point_attains_eps_tilde_and_single_generator_does_not() -> None:
    c = cone.make_cone(24, 3, 0.2, math.radians(40), np.random.default_rng(1))
    assert c.rel_orth(cone.sharpness_point(c)) == pytest.approx(c.eps_tilde, abs=1e-12)
    # A single boundary point of C^eps only reaches eps < eps~: the hull is what widens the cone.
    one = c.embed(c.gens[:, 0], c.k * np.eye(c.D - c.d)[0])
    assert c.rel_orth(one) == pytest.approx(0.2, abs=1e-12)
    assert c.eps_tilde > 0.2 + 0.02


def test_constructed_wov_satisfies_hypothesis_and_broken_one_does_not() -> None:
    rng = np.random.default_rng(2)
    c = cone.make_cone(32, 4, 0.1, math.radians(30), rng)
    ok = cone.make_model(c, rng, layers=2, heads=3, head_dim=8, contraction=1.0)
    ratio, coeff = cone.hypothesis_violation(c, ok, rng, n=3000)
    assert ratio <= 1 + 1e-9 and coeff >= -1e-9
    bad = cone.make_model(c, rng, layers=2, heads=3, head_dim=8, contraction=4.0)
    assert cone.hypothesis_violation(c, bad, rng, n=3000)[0] > 1


def test_kv_cached_decoder_matches_full_recomputation() -> None:
    """The simulation's cached forward pass equals eq. (1) recomputed from scratch."""
    rng = np.random.default_rng(3)
    c = cone.make_cone(16, 3, 0.1, math.radians(30), rng)
    m = cone.make_model(c, rng, layers=3, heads=2, head_dim=4)
    xs = c.sample(7, rng)
    dec = cone._Decoder(m, capacity=7)
    cached = [dec.push(x) for x in xs]
    h = xs.copy()
    for layer in range(m.layers):
        new = h.copy()
        for head in range(m.wq.shape[1]):
            q, k = h @ m.wq[layer, head].T, h @ m.wk[layer, head].T
            scores = q @ k.T / math.sqrt(m.wq.shape[2])
            scores[np.triu_indices(7, 1)] = -np.inf
            a = np.exp(scores - scores.max(1, keepdims=True))
            a /= a.sum(1, keepdims=True)
            new += a @ (h @ m.wov[layer, head].T)
        h = new
    np.testing.assert_allclose(np.array(cached), h, rtol=1e-10, atol=1e-12)


def test_generated_tokens_stay_within_eps_tilde(cone_result: cone.ConeResult) -> None:
    rows = {ch.id: ch for ch in cone.checks(cone_result)}
    for cid in ("thm51.hypothesis", "thm51.bound", "thm51.hull", "thm51.sweep", "thm51.sharp"):
        assert rows[cid].status == "pass", rows[cid]
    gen = np.concatenate([t.tokens[t.kind == "agent"] for t in cone_result.valid])
    assert len(gen) == cone_result.cfg.n_models * cone_result.cfg.steps
    assert cone_result.cone.rel_orth(gen).max() <= cone_result.eps_tilde


def test_broken_hypothesis_and_user_tokens_violate_the_bound(cone_result: cone.ConeResult) -> None:
    c, et = cone_result.cone, cone_result.eps_tilde
    assert max(c.rel_orth(t.tokens[t.kind == "agent"]).max() for t in cone_result.broken) > et
    dlg = cone_result.dialog
    first_user = np.flatnonzero(dlg.kind == "user")[0]
    after = (dlg.kind == "agent") & (np.arange(len(dlg.kind)) > first_user)
    assert c.rel_orth(dlg.tokens[after]).max() > et


def test_cone_simulation_is_deterministic(cone_result: cone.ConeResult) -> None:
    again = cone.run(cone.ConeConfig.quick(), seed=0)
    np.testing.assert_array_equal(again.valid[0].tokens, cone_result.valid[0].tokens)
    other = cone.run(cone.ConeConfig.quick(), seed=1)
    assert not np.allclose(other.valid[0].tokens[-1], cone_result.valid[0].tokens[-1])


# ---------------------------------------------------------------- Proposition 5.2


def test_wendel_closed_form_on_the_circle() -> None:
    # On S^1 the probability that n points fit in a half circle is n / 2^(n-1).
    for n in range(2, 12):
        assert wendel.wendel_hemisphere(1, n) == pytest.approx(n / 2 ** (n - 1))
    assert wendel.p_span(5, 5) == 0.0  # n <= D points never span R^D
    assert wendel.p_span(3, 6) == pytest.approx(0.5)  # P = 1/2 at n = 2D


def test_lp_hemisphere_test_on_known_configurations() -> None:
    D = 4
    cross = np.concatenate([np.eye(D), -np.eye(D)])[None]  # +-e_i: 0 is interior, spans R^D
    assert wendel.hemisphere_margins(cross)[0] <= wendel.MARGIN_TOL
    rng = np.random.default_rng(0)
    half = wendel.uniform_sphere((1, 30, D), rng)
    half[..., 0] = np.abs(half[..., 0]) + 0.05  # all in the open half-space x_0 > 0
    assert wendel.hemisphere_margins(half)[0] > 1e-3


@pytest.mark.parametrize(("D", "n"), [(3, 6), (5, 11), (8, 17)])
def test_wendel_matches_lp_monte_carlo_and_rejects_wrong_index(D: int, n: int) -> None:
    trials = 1500
    rng = np.random.default_rng([D, n])
    p_mc = wendel.mc_p_span(D, n, trials, rng)
    assert abs(wendel.binomial_z(p_mc, wendel.p_span(D, n), trials)) <= 4
    # The proof's a_{D,n} (points on S^D) predicts a different probability; the data reject it.
    wrong = 1 - wendel.wendel_hemisphere(D, n)
    assert abs(wendel.binomial_z(p_mc, wrong, trials)) > 4


def test_sample_bound_of_prop52() -> None:
    for D in (1, 2, 3, 5, 10, 30, 100):
        for eta in (0.1, 1e-2, 1e-4, 1e-8):
            n = wendel.paper_n_bound(D, eta)
            assert wendel.wendel_hemisphere(D - 1, n) <= eta
            assert wendel.minimal_n(D, eta) <= n
    # The proof's variant n >= 4D + log(1/eta) is not enough for small D and eta.
    n = wendel.paper_n_bound(2, 1e-6, log_coef=1.0)
    assert wendel.wendel_hemisphere(1, n) > 1e-6
    assert wendel.wendel_hemisphere(1, n) == pytest.approx(10.5e-6, rel=5e-3)  # docs/theory.md: 10.5 eta


# ---------------------------------------------------------------- Proposition 5.3


def test_cap_fraction_matches_lemma_a2_and_circle() -> None:
    for d in (2, 3, 5, 9):
        for psi in (0.1, 0.7, 1.3):
            assert volume.cap_fraction(d, psi) == pytest.approx(volume.cap_fraction_lemma(d, psi), abs=1e-10)
    assert volume.cap_fraction(2, 0.5) == pytest.approx(0.5 / math.pi)
    assert volume.cap_fraction(3, math.pi / 2) == pytest.approx(0.5)


@pytest.mark.parametrize(("d", "psi_deg", "eps"), [(2, 45, 0.8), (3, 60, 0.6), (5, 70, 0.5)])
def test_closed_form_volume_matches_plain_monte_carlo(d: int, psi_deg: float, eps: float) -> None:
    D, n = 9, 400_000
    psi = math.radians(psi_deg)
    vnorm, angle = volume.membership_stats(D, d, n, np.random.default_rng(d))
    hits = int(((vnorm <= eps) & (angle <= psi)).sum())

    def z(p: float) -> float:
        return (hits - n * p) / math.sqrt(n * p * (1 - p))

    assert abs(z(float(volume.mu_closed(D, d, psi, eps)))) <= 4
    # Swapping the Beta parameters (a plausible slip) is rejected by the same samples.
    from scipy.special import betainc

    wrong = float(betainc(d / 2, (D - d) / 2, eps**2)) * volume.cap_fraction(d, psi)
    assert abs(z(wrong)) > 4


def test_importance_sampling_matches_closed_form_at_tiny_volumes() -> None:
    D, d, psi = 10, 3, math.radians(30)
    eps = np.array([1e-4, 1e-3, 1e-2])
    m, se = volume.mu_importance(D, d, psi, eps, 60_000, np.random.default_rng(5))
    exact = volume.mu_closed(D, d, psi, eps)
    assert exact[0] < 1e-25  # far beyond plain Monte Carlo
    assert np.all(np.abs(m - exact) <= 4 * se)
    assert np.all(se / m < 0.05)


def test_volume_ratio_slope_is_d2_minus_d1() -> None:
    res = volume.run(volume.VolumeConfig.quick(), seed=0)
    rows = {ch.id: ch for ch in volume.checks(res)}
    assert all(ch.status == "pass" for ch in rows.values()), rows
    for d1, d2, slope_is, _slope_cf, const_is, const in res.slopes:
        assert abs(slope_is - (d2 - d1)) <= 0.05
        assert abs(slope_is - (d2 - d1 + 1)) > 0.5  # an off-by-one exponent would be caught
        assert const_is == pytest.approx(const, rel=0.1)


# ---------------------------------------------------------------- Figure 7


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Minimal writer (supports BF16, which safetensors.numpy cannot save)."""
    header, blobs, offset = {}, [], 0
    for key, (dtype, arr) in tensors.items():
        if dtype == "BF16":
            raw = (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(arr, dtype={"F32": "<f4", "F16": "<f2"}[dtype]).tobytes()
        header[key] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_embedding_norms_read_raw_safetensors(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((300, 16)).astype(np.float32)
    other = rng.standard_normal((16, 16)).astype(np.float32)
    _write_safetensors(
        tmp_path / "model.safetensors",
        {
            "model.layers.0.mlp.weight": (dtype, other),
            "model.embed_tokens.weight": (dtype, emb),
        },
    )
    norms, key, got = embeddings.embedding_norms(tmp_path / "model.safetensors", chunk=64)
    assert key == "model.embed_tokens.weight" and got == dtype
    rtol = {"F32": 1e-6, "F16": 2e-3, "BF16": 2e-2}[dtype]
    np.testing.assert_allclose(norms, np.linalg.norm(emb, axis=1), rtol=rtol)
    # The other tensor would give different norms: the right key was read.
    assert len(norms) == 300


def test_embedding_key_missing_raises_actionable_error(tmp_path: Path) -> None:
    _write_safetensors(tmp_path / "model.safetensors", {"foo.weight": ("F32", np.ones((2, 2)))})
    with pytest.raises(DriftlabError) as err:
        embeddings.find_embedding(tmp_path)
    assert "foo.weight" in (err.value.hint or "")


def test_named_tensor_missing_raises_actionable_error(tmp_path: Path) -> None:
    emb = np.ones((4, 3), np.float32)
    _write_safetensors(tmp_path / "model.safetensors", {"model.embed_tokens.weight": ("F32", emb)})
    with pytest.raises(DriftlabError, match="No tensor 'lm_head.weight'") as err:
        embeddings.embedding_norms(tmp_path, key="lm_head.weight")
    assert "model.embed_tokens.weight" in (err.value.hint or "")
    # The same call with a key that is there reads it (so the error above is about the name).
    norms, key, _ = embeddings.embedding_norms(tmp_path, key="model.embed_tokens.weight")
    np.testing.assert_allclose(norms, np.sqrt(3.0))


def test_truncated_safetensors_raises_driftlab_error(tmp_path: Path) -> None:
    full = tmp_path / "full.safetensors"
    emb = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    _write_safetensors(full, {"model.embed_tokens.weight": ("F32", emb)})
    data = full.read_bytes()
    for name, cut in [("body", len(data) - 100), ("header", 20), ("length", 5)]:
        bad = tmp_path / name / "model.safetensors"
        bad.parent.mkdir()
        bad.write_bytes(data[:cut])
        with pytest.raises(DriftlabError, match="not a readable safetensors file") as err:
            embeddings.embedding_norms(bad.parent)
        assert str(bad) in err.value.message and "truncated" in (err.value.hint or "")
    assert embeddings.embedding_norms(full)[0].shape == (64,)  # the untruncated file is fine


def test_non_safetensors_file_raises_driftlab_error(tmp_path: Path) -> None:
    junk = tmp_path / "model.safetensors"
    junk.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)  # e.g. a zip-format torch checkpoint
    with pytest.raises(DriftlabError, match="not a readable safetensors file"):
        embeddings.find_embedding(junk)
    # A header whose JSON is fine but whose offsets do not cover the data is refused as well.
    head = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    )
    head = head.encode() + b" " * (-len(head) % 8)
    junk.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 16)
    with pytest.raises(DriftlabError, match="not a readable safetensors file"):
        embeddings.embedding_norms(junk)


def test_missing_model_path_raises_driftlab_error(tmp_path: Path) -> None:
    with pytest.raises(DriftlabError, match="does not exist"):
        embeddings.embedding_norms(tmp_path / "nowhere" / "model.safetensors")


def _reference_rows(file: Path, key: str, rows: np.ndarray) -> np.ndarray:
    """Independent reader: parse the safetensors header by hand, decode bf16 rows with numpy."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(n))[key]
        assert info["dtype"] == "BF16"
        width = info["shape"][1]
        out = np.empty((len(rows), width))
        for i, r in enumerate(rows):
            fh.seek(8 + n + info["data_offsets"][0] + int(r) * width * 2)
            raw = np.frombuffer(fh.read(width * 2), dtype="<u2")
            out[i] = (raw.astype(np.uint32) << 16).view(np.float32)
    return out


@pytest.mark.model
def test_embedding_norms_of_real_model(smol_dir) -> None:
    res = embeddings.run(str(smol_dir))
    s = res.stats
    assert res.key == "model.embed_tokens.weight" and res.dtype == "BF16"
    assert int(s["rows"]) == 49152 and res.norms.shape == (49152,)
    assert 0 < s["p01"] < s["median"] < s["p99"] and s["cv"] < 0.5
    # Spot-check rows across the matrix (first, chunk boundaries, last) against the hand parser.
    rows = np.array([0, 1, 8191, 8192, 8193, 30000, 49151])
    ref = np.linalg.norm(_reference_rows(Path(smol_dir) / "model.safetensors", res.key, rows), axis=1)
    np.testing.assert_allclose(res.norms[rows], ref, rtol=1e-12)


# ---------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    from driftlab.cli.theory import theory

    app = typer.Typer()
    app.command("theory")(theory)
    app.command("noop")(lambda: None)  # keeps Typer in multi-command mode, as in driftlab.cli
    return app


def _run_quick(out: Path, *extra: str):
    result = CliRunner().invoke(_app(), ["theory", "--out", str(out), "--quick", *extra])
    assert result.exit_code == 0, result.output
    for name in (
        "thm51_cone.png",
        "prop52_wendel.png",
        "prop53_volume.png",
        "checks.csv",
        "checks.md",
        "summary.json",
        "prop52_wendel.csv",
        "prop53_is.csv",
    ):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["all_passed"] and summary["quick"]
    assert {c["id"] for c in summary["checks"]} >= {"thm51.bound", "prop52.wendel", "prop53.slope"}
    assert "all checks passed" in result.output
    return summary


def test_cli_quick_writes_its_files(tmp_path: Path) -> None:
    summary = _run_quick(tmp_path / "theory")
    assert "fig7.norms" not in {c["id"] for c in summary["checks"]}
    assert not (tmp_path / "theory" / "fig7_embedding_norms.png").exists()


@pytest.mark.model
def test_cli_quick_with_model_adds_fig7(tmp_path: Path, smol_dir) -> None:
    summary = _run_quick(tmp_path / "theory", "--model", str(smol_dir))
    assert "fig7.norms" in {c["id"] for c in summary["checks"]}
    assert (tmp_path / "theory" / "fig7_embedding_norms.png").stat().st_size > 0


def test_cli_bad_model_raises_driftlab_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        _app(), ["theory", "--out", str(tmp_path / "o"), "--quick", "--model", str(tmp_path / "missing_dir")]
    )
    assert isinstance(result.exception, DriftlabError)
    assert result.exception.hint


def test_out_must_be_a_directory(tmp_path: Path) -> None:
    from driftlab.report.theory import write_theory

    (tmp_path / "file").write_text("x")
    with pytest.raises(DriftlabError, match="not a directory"):
        write_theory(tmp_path / "file", quick=True)
