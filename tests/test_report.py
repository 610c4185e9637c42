"""The results side of a self-chat run: metrics, figures, report.html and `driftlab report`.

Run directories here are written by hand (manifest + records, texts in the style of a real
SmolLM2 run), so nothing loads a model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import typer
from scipy import stats
from typer.testing import CliRunner

from driftlab.cli.report import print_summary, report, summary_table
from driftlab.errors import DriftlabError
from driftlab.protocol.selfchat import SelfChat
from driftlab.records.rundir import RunDir
from driftlab.report.figures import category_figure, drift_figure
from driftlab.report.html import score_color, write_report
from driftlab.report.metrics import (
    ALL,
    common_rounds,
    probe_scores,
    summarize,
    summarize_overall,
    summarize_run,
)
from driftlab.report.tables import round_table

# -- fixtures ---------------------------------------------------------------------------------
PERSONAS = {
    "reply-in-french": {
        "id": "reply-in-french",
        "category": "language",
        "system_prompt": "Always reply in French.",
        "probe": "What do you do in London as a tourist?",
        "measure": "language",
        "params": {"lang": "fr"},
    },
    "all-caps": {
        "id": "all-caps",
        "category": "pattern",
        "system_prompt": "WRITE YOUR RESPONSE ENTIRELY IN CAPITAL LETTERS.",
        "probe": "What do you do in London as a tourist?",
        "measure": "letter_case",
        "params": {"case": "upper"},
    },
    "x-equals-13": {
        "id": "x-equals-13",
        "category": "multiple_choice",
        "system_prompt": "Always remember! x is equal to 13.",
        "probe": 'What is 2 times x ? A) 20, B) 26. Only respond with "A" or "B"',
        "measure": "choice",
        "params": {"answer": "B"},
    },
    "teen-slang": {
        "id": "teen-slang",
        "category": "persona",
        "system_prompt": "text like ur a teenager, use slang",
        "probe": "What do you do in London as a tourist?",
        "measure": "slang_words",
        "params": {},
    },
}
PAIRS = [("x-equals-13", "reply-in-french"), ("all-caps", "teen-slang"), ("reply-in-french", "all-caps")]
STARTERS = [
    "Do you think handwriting still matters?",
    "Are electric cars really better for the environment?",
    "What's your take on celebrity culture?",
]
# Text a model could write that breaks HTML if not escaped.
EVIL = '<script>alert("drift")</script> & <b>bold</b>'


def agent_score(pair: int, cond: str, rnd: int, rep: int) -> float:
    """Deterministic scores that fall with the round, so the fixture has drift to show."""
    base = {0: 1.0, 1: 0.8, 2: 0.6}[pair] - 0.15 * (rnd - 1) - (0.1 if cond == "empty-user" else 0.0)
    return round(min(1.0, max(0.0, base - 0.1 * rep)), 4)


def user_score(pair: int, rnd: int, rep: int) -> float:
    return round(0.1 * rnd + 0.05 * rep + 0.02 * pair, 4)


def make_run(
    path: Path,
    *,
    rounds: int = 3,
    repeats: int = 2,
    ablation: bool = True,
    completed: bool = True,
    cut_after: int | None = None,
    probe_after: str | None = None,
) -> Path:
    """A run dir as SelfChat writes it; `cut_after` keeps only the first N records (a killed run)."""
    conditions = ["persona", "empty-user"] if ablation else ["persona"]
    manifest = {
        "driftlab_run": 1,
        "created": "2026-11-21T05:56:37+0000",
        "config": {
            "model": "smollm2-135m",
            "user_model": None,
            "pairs": len(PAIRS),
            "rounds": rounds,
            "probe_every": 1,
            "probe_repeats": repeats,
            "user_probe": True,
            "ablation": ablation,
            "max_new_tokens": 24,
            "temperature": 1.0,
            "top_p": 0.9,
            "seed": 0,
            "steer": [],
            **({"probe_after": probe_after} if probe_after else {}),
        },
        "versions": {"python": "3.11.7", "driftlab": "0.1.0"},
        "pairs": [
            {
                "pair": i,
                "agent": a,
                "user": u,
                "starter": STARTERS[i],
                "agent_category": PERSONAS[a]["category"],
                "user_category": PERSONAS[u]["category"],
            }
            for i, (a, u) in enumerate(PAIRS)
        ],
        "conditions": conditions,
        "probe_rounds": list(range(1, rounds + 1)),
        "personas": PERSONAS,
        "models": {"agent": {"name": "smollm2-135m", "dtype": "float32", "device": "cpu"}},
        "attention": None,
    }
    if completed:
        manifest["completed"] = True
    records = []
    for rnd in range(1, rounds + 1):  # the order SelfChat writes: per round, user turns then agent work
        for cond in conditions:
            for i, (agent, user) in enumerate(PAIRS):
                base = {"pair": i, "condition": cond, "round": rnd, "n_tokens": 24, "seed": 1}
                if rnd > 1:
                    records.append(
                        {
                            "kind": "turn",
                            **base,
                            "speaker": "user",
                            "finish_reason": "stop",
                            "text": f"user turn {i}/{cond}/{rnd}: I visit the Tower of London.",
                        }
                    )
                records.append(
                    {
                        "kind": "turn",
                        **base,
                        "speaker": "agent",
                        "finish_reason": "length",
                        "text": f"agent turn {i}/{cond}/{rnd}: The language of the hand {EVIL}",
                    }
                )
                for rep in range(repeats):
                    records.append(
                        {
                            "kind": "probe",
                            **base,
                            "target": "agent",
                            "persona": agent,
                            "repeat": rep,
                            "finish_reason": "stop",
                            "score": agent_score(i, cond, rnd, rep),
                            "text": f"probe reply {i}/{cond}/{rnd}/{rep}: Bonjour {EVIL}",
                        }
                    )
                    if cond == "persona":
                        records.append(
                            {
                                "kind": "probe",
                                **base,
                                "target": "user",
                                "persona": user,
                                "repeat": rep,
                                "finish_reason": "stop",
                                "score": user_score(i, rnd, rep),
                                "text": f"user probe reply {i}/{rnd}/{rep}: lol fr no cap",
                            }
                        )
    if cut_after is not None:
        records = records[:cut_after]
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))
    rd = RunDir(path)
    with rd.writing():
        rd.append(records)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run") / "complete")


@pytest.fixture(scope="module")
def summary(run_dir):
    return summarize_run(run_dir)


@pytest.fixture(scope="module")
def report_html(run_dir, summary) -> str:
    return write_report(run_dir, summary=summary).read_text(encoding="utf-8")


# -- scores and summaries ---------------------------------------------------------------------
def test_probe_scores_average_repeats_per_conversation(summary) -> None:
    s = summary.scores
    # 3 pairs x 3 rounds x (agent, user under persona; agent under empty-user), + adoption excess of rounds 2-3
    assert len(s) == 3 * 3 * 3 + 3 * 2
    row = s[(s.pair == 1) & (s.condition == "persona") & (s["round"] == 2) & (s.target == "agent")].iloc[0]
    assert row.score == pytest.approx((agent_score(1, "persona", 2, 0) + agent_score(1, "persona", 2, 1)) / 2)
    assert row.n_repeats == 2 and row.category == "pattern" and row.persona == "all-caps"
    user = s[(s.pair == 1) & (s.target == "user")].iloc[0]
    assert user.category == "persona"  # the category of the persona being probed (the user's)


def test_probe_scores_ignore_missing_scores() -> None:
    manifest = {"conditions": ["persona"], "personas": PERSONAS}
    recs = [
        {
            "kind": "probe",
            "pair": 0,
            "condition": "persona",
            "round": 1,
            "target": "agent",
            "persona": "all-caps",
            "repeat": r,
            "score": sc,
        }
        for r, sc in enumerate([0.2, None, 0.6])
    ]
    recs.append(
        {"kind": "turn", "pair": 0, "condition": "persona", "round": 1, "speaker": "agent", "text": "x"}
    )
    s = probe_scores(recs, manifest)
    assert len(s) == 1 and s.score.iloc[0] == pytest.approx(0.4) and s.n_repeats.iloc[0] == 2


def test_summarize_matches_slow_reference(summary) -> None:
    scores = summary.scores
    per_round = summary.per_round
    for (cond, target, rnd), cell in scores.groupby(["condition", "target", "round"]):
        got = per_round[
            (per_round.condition == cond)
            & (per_round.target == target)
            & (per_round.category == ALL)
            & (per_round["round"] == rnd)
        ].iloc[0]
        vals = list(cell.score)
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        assert got.n == len(vals) == 3
        assert got["mean"] == pytest.approx(mean) and got["std"] == pytest.approx(std)
        # three conversations: a t-interval (a bootstrap of 3 points cannot see past them)
        half = stats.t.ppf(0.975, 2) * std / math.sqrt(3)
        assert got.ci_method == "t" and (got.ci_low, got.ci_high) == pytest.approx((mean - half, mean + half))
    # per category: one conversation each -> the value itself, NaN std and CI
    lang = per_round[(per_round.category == "language") & (per_round.target == "agent")]
    assert set(lang.n) == {1} and lang["std"].isna().all() and lang.ci_low.isna().all()


def test_summary_is_seeded_and_independent_of_other_cells(summary) -> None:
    pd.testing.assert_frame_equal(summarize(summary.scores), summary.per_round)
    pd.testing.assert_frame_equal(summarize_overall(summary.scores), summary.overall)
    only_agent = summarize(summary.scores[summary.scores.target == "agent"])
    cell = lambda df: df[(df.condition == "persona") & (df.target == "agent") & (df.category == ALL)]  # noqa: E731
    pd.testing.assert_frame_equal(
        cell(only_agent).reset_index(drop=True), cell(summary.per_round).reset_index(drop=True)
    )


def test_overall_is_mean_over_rounds_per_conversation(summary) -> None:
    ov = summary.overall
    row = ov[(ov.condition == "persona") & (ov.target == "agent") & (ov.category == ALL)].iloc[0]
    per_conv = [
        np.mean([agent_score(i, "persona", r, k) for r in (1, 2, 3) for k in (0, 1)]) for i in range(3)
    ]
    assert row.n == 3 and row.rounds == "1,2,3"
    assert row["mean"] == pytest.approx(np.mean(per_conv))
    assert row["std"] == pytest.approx(np.std(per_conv, ddof=1))


def test_overall_uses_rounds_every_conversation_reached(tmp_path) -> None:
    # Cut inside round 3: some conversations have round 3, others not.
    full = make_run(tmp_path / "full", ablation=False)
    n_before_r3 = sum(1 for r in RunDir(full).records() if r["round"] < 3)
    part = make_run(tmp_path / "part", ablation=False, completed=False, cut_after=n_before_r3 + 6)
    s = summarize_run(part)
    agent = s.scores[(s.scores.target == "agent")]
    assert sorted(agent[agent["round"] == 3].pair) == [0]  # only pair 0 reached round 3
    assert common_rounds(agent) == [1, 2]
    row = s.overall[(s.overall.target == "agent") & (s.overall.category == ALL)].iloc[0]
    assert row.rounds == "1,2" and row.n == 3
    expect = np.mean([agent_score(i, "persona", r, k) for i in range(3) for r in (1, 2) for k in (0, 1)])
    assert row["mean"] == pytest.approx(expect)


def test_expected_counts() -> None:
    manifest = {
        "config": {"rounds": 3, "probe_repeats": 2, "user_probe": True},
        "pairs": [{}] * 3,
        "conditions": ["persona", "empty-user"],
        "probe_rounds": [1, 2, 3],
    }
    # turns: 3 pairs x 2 conditions x (3 agent + 2 user); probes: 3 x 3 rounds x 2 reps x (2 + 1 targets)
    assert SelfChat.expected(manifest) == {"turn": 30, "probe": 54}


def test_round_table_rows(summary) -> None:
    t = round_table(summary)
    assert t.columns[0] == "round" and len(t.columns) == 5
    assert [r[0] for r in t.rows] == ["1", "2", "3", "overall"]
    excess = t.columns.index("adoption above round 1 (n=3)")
    assert t.rows[0][excess] == "" and t.rows[1][excess].startswith("0.10")  # no excess at the baseline round
    pr = summary.per_round
    first = pr[
        (pr.condition == "persona") & (pr.target == "agent") & (pr.category == ALL) & (pr["round"] == 1)
    ].iloc[0]
    assert t.rows[0][1] == f"{first['mean']:.2f} [{first.ci_low:.2f}, {first.ci_high:.2f}]"


# -- figures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("errors", ["ci", "std"])
def test_figures_are_pngs(summary, tmp_path, errors) -> None:
    for fn, name in ((drift_figure, "drift.png"), (category_figure, "cats.png")):
        path = fn(summary, tmp_path / name, errors=errors)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 20_000  # axes, lines and text, not an empty canvas


# -- HTML report ------------------------------------------------------------------------------
def test_report_files_and_self_contained(run_dir, report_html) -> None:
    for name in ("report.html", "summary.csv", "overall.csv", "drift.png", "drift_by_category.png"):
        assert (run_dir / name).is_file(), name
    assert report_html.count("data:image/png;base64,") == 2
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", report_html)  # nothing fetched
    assert "<link" not in report_html
    assert "Incomplete run" not in report_html


def test_report_escapes_model_text(report_html) -> None:
    assert "<script>alert" not in report_html and "<b>bold</b>" not in report_html
    assert "&lt;script&gt;alert(&#34;drift&#34;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;" in report_html
    assert "probe reply 2/empty-user/3/1: Bonjour &lt;script&gt;" in report_html
    assert "user turn 1/persona/2: I visit the Tower of London." in report_html
    assert "WRITE YOUR RESPONSE ENTIRELY IN CAPITAL LETTERS." in report_html  # s_B shown
    assert report_html.count('<details class="conv"') == 3 * 2  # pairs x conditions


@pytest.mark.parametrize("probe_after", [None, "user", "agent"])
def test_transcripts_place_the_probe_where_the_run_asked_it(tmp_path, probe_after) -> None:
    """A probe after b_i is shown after the round's turns, a probe in place of a_i before them; a
    manifest from before `probe_after` existed placed it in place of a_i (as it resumes)."""
    run = make_run(tmp_path / "run", rounds=2, repeats=1, ablation=False, probe_after=probe_after)
    page = write_report(run).read_text(encoding="utf-8")
    probe = page.index("probe reply 0/persona/2/0")
    user_turn, agent_turn = page.index("user turn 0/persona/2:"), page.index("agent turn 0/persona/2:")
    if probe_after == "agent":
        assert user_turn < agent_turn < probe
        assert "the probe follows the agent's turn b_i" in page and "after b_2</span>" in page
        assert "replaces the user" not in page and "in place of a_" not in page
    else:
        assert probe < user_turn < agent_turn
        assert "the probe replaces the user's turn a_i" in page and "in place of a_2</span>" in page
        assert "follows the agent" not in page and "after b_" not in page


def test_report_shows_probe_scores_colour_coded(report_html) -> None:
    score = agent_score(0, "persona", 2, 1)
    assert f'style="background: {score_color(score)}">{score:.2f}</span>' in report_html
    assert score_color(0.0) != score_color(1.0) and score_color(float("nan")) == "#e5e5e5"


def test_summary_csv_matches_summary(run_dir, summary, report_html) -> None:
    csv = pd.read_csv(run_dir / "summary.csv")
    assert list(csv.columns) == [
        "condition",
        "target",
        "category",
        "round",
        "n",
        "mean",
        "std",
        "ci_low",
        "ci_high",
        "ci_method",
    ]
    assert np.allclose(csv["mean"], summary.per_round["mean"])


def test_partial_run_reports_with_banner(tmp_path) -> None:
    part = make_run(tmp_path / "part", completed=False, cut_after=40)
    html = write_report(part).read_text(encoding="utf-8")
    assert 'id="incomplete"' in html and "Incomplete run" in html
    n_probes = sum(1 for r in RunDir(part).records() if r["kind"] == "probe")
    assert f"{n_probes} of 54 probe replies" in html
    assert (part / "summary.csv").is_file()


def test_no_probes_or_not_a_run_is_a_driftlab_error(tmp_path) -> None:
    with pytest.raises(DriftlabError, match="not a driftlab run directory"):
        write_report(tmp_path)
    only_turns = make_run(tmp_path / "turns", completed=False, cut_after=0)
    with pytest.raises(DriftlabError, match="no probe records") as err:
        summarize_run(only_turns)
    assert err.value.hint


# -- CLI --------------------------------------------------------------------------------------
def cli_app() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps Typer in multi-command mode, as in driftlab
        pass

    return app


def test_cli_report(tmp_path) -> None:
    run = make_run(tmp_path / "run", ablation=False)
    result = CliRunner().invoke(cli_app(), ["report", str(run), "--errors", "std"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "agent stability" in out and "user-persona adoption" in out and "empty-user" not in out
    assert re.search(r"overall\s+\d\.\d\d \[\d\.\d\d, \d\.\d\d\]", out)  # the CI survived rich markup
    assert str(run / "report.html") in out
    html = (run / "report.html").read_text(encoding="utf-8")
    assert html.count('<details class="conv"') == 3 and "Error bars: ±1 std" in html


def test_cli_report_limits_transcripts(tmp_path) -> None:
    run = make_run(tmp_path / "run", ablation=False)
    result = CliRunner().invoke(cli_app(), ["report", str(run), "--transcripts", "1"])
    assert result.exit_code == 0, result.output
    html = (run / "report.html").read_text(encoding="utf-8")
    assert html.count('<details class="conv"') == 1 and "first 1 of 3 persona pairs" in html


def test_cli_report_bad_input(tmp_path) -> None:
    result = CliRunner().invoke(cli_app(), ["report", str(tmp_path / "missing")])
    assert isinstance(result.exception, DriftlabError)
    result = CliRunner().invoke(cli_app(), ["report", str(tmp_path)])
    assert isinstance(result.exception, DriftlabError) and "not a driftlab run" in str(result.exception)


def test_print_summary_for_driftlab_run(run_dir) -> None:
    from rich.console import Console

    console = Console(record=True, width=200)
    s = print_summary(run_dir, console)
    text = console.export_text()
    assert "agent stability, empty-user ablation" in text and "Incomplete" not in text
    assert summary_table(s).row_count == 4  # rounds 1-3 + overall
    assert "empty-user - persona (agent)" in text and "Wilcoxon signed-rank (exact)" in text
    assert "Warning: too few pairs to support a difference" in text  # 3 pairs: the terminal says so too


def test_a_completed_manifest_with_short_records_is_reported_incomplete(tmp_path) -> None:
    """Lines removed from a finished run (e.g. after a corruption hint) must not pass as complete."""
    from rich.console import Console

    from driftlab.cli.report import print_summary

    short = make_run(tmp_path / "short", completed=True, cut_after=40)
    html = write_report(short).read_text(encoding="utf-8")
    assert 'id="incomplete"' in html
    console = Console(record=True, width=200)
    print_summary(short, console)
    assert "Incomplete run" in console.export_text()
    full = make_run(tmp_path / "full", completed=True)
    console = Console(record=True, width=200)
    print_summary(full, console)
    assert "Incomplete" not in console.export_text()
    assert 'id="incomplete"' not in write_report(full).read_text(encoding="utf-8")


def test_truncation_share_per_round_is_reported(tmp_path):
    """The fixture cuts every agent turn at the token limit and no user turn or probe."""
    from driftlab.report.html import write_report
    from driftlab.report.metrics import summarize_run

    run = make_run(tmp_path / "run", rounds=3, ablation=False)
    cut = summarize_run(run).truncation
    assert list(cut["round"]) == [1, 2, 3] and list(cut["turns"]) == [3, 6, 6]
    assert list(cut["turns_cut"]) == [1.0, 0.5, 0.5]  # round 1 has no user turn (a_1 is the starter)
    assert list(cut["probes_cut"]) == [0.0, 0.0, 0.0] and cut["probes_unscored"].sum() == 0
    page = write_report(run).read_text()
    assert "Replies cut at --max-new-tokens, per round" in page and "turns_cut" in page


def test_adoption_excess_is_each_conversations_rise_over_its_round_1(summary) -> None:
    """Round 1's p_A is answered before the agent has seen the user LM: the per-conversation baseline."""
    s = summary.scores
    excess = s[s.target == "user-excess"]
    assert sorted(set(excess["round"])) == [2, 3] and set(excess.condition) == {"persona"}
    for row in excess.itertuples():  # user_score rises by 0.1 per round, whatever the pair
        raw = s[(s.pair == row.pair) & (s.target == "user") & (s.condition == row.condition)].set_index("round").score
        assert row.score == pytest.approx(raw[row.round] - raw[1]) and row.score == pytest.approx(0.1 * (row.round - 1))
        assert row.persona == s[(s.pair == row.pair) & (s.target == "user")].persona.iloc[0]  # f_A's persona
    overall = summary.overall
    cell = overall[(overall.target == "user-excess") & (overall.category == "all")].iloc[0]
    assert cell["mean"] == pytest.approx(0.15) and cell.rounds == "2,3"


def test_conditions_are_compared_pair_by_pair(run_dir, summary, report_html) -> None:
    """The empty-user ablation against the persona run, per conversation: the paired differences
    of each conversation's mean over rounds, tested by the exact signed-rank test (three pairs:
    no outcome could reach p < 0.05, and the report says so)."""
    from driftlab.report.tables import comparison_table

    cmp = summary.comparisons
    assert list(cmp.target) == ["agent"] and list(cmp.condition) == ["empty-user"] and list(cmp.versus) == ["persona"]
    row = cmp.iloc[0]
    per = {c: [np.mean([agent_score(i, c, r, k) for r in (1, 2, 3) for k in (0, 1)]) for i in range(3)]
           for c in ("persona", "empty-user")}
    diffs = np.subtract(per["empty-user"], per["persona"])
    assert row.n == 3 and row["diff"] == pytest.approx(diffs.mean())
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / math.sqrt(3)
    assert (row.diff_ci_low, row.diff_ci_high) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    nonzero = diffs[diffs != 0]
    ref = stats.wilcoxon(nonzero, method=stats.PermutationMethod(n_resamples=np.inf)).pvalue
    assert row.p == pytest.approx(ref) and row.p_holm == pytest.approx(ref)  # a family of one
    assert row.method == "Wilcoxon signed-rank (exact)" and "too few pairs" in row.warning
    table = comparison_table(summary)
    assert table.rows[0][-1] == row.warning and "Conditions compared on the same conversations" in report_html
    assert "too few pairs to support a difference" in report_html


def test_drift_is_tested_last_round_against_first_per_conversation(run_dir, summary, report_html) -> None:
    """The fixture's agent scores fall 0.15 per round and its adoption scores rise 0.1 per
    round, in every conversation: each row is the paired last-minus-first difference, with the
    exact signed-rank p (scipy) and Holm over the run's drift rows."""
    from rich.console import Console

    from driftlab.report.tables import drift_table

    drift = summary.drift
    assert [(r.target, r.condition) for r in drift.itertuples()] == [
        ("agent", "persona"), ("agent", "empty-user"), ("user", "persona")]
    ps = []
    for r in drift.itertuples():
        assert (r.first, r.last, r.n) == (1, 3, 3)
        if r.target == "agent":
            per = [np.mean([agent_score(i, r.condition, 3, k) - agent_score(i, r.condition, 1, k) for k in (0, 1)])
                   for i in range(3)]
            assert (r.better, r.worse) == (0, 3)
        else:
            per = [np.mean([user_score(i, 3, k) - user_score(i, 1, k) for k in (0, 1)]) for i in range(3)]
            assert (r.better, r.worse) == (3, 0)
        assert r.diff == pytest.approx(np.mean(per))
        ref = stats.wilcoxon(per, method=stats.PermutationMethod(n_resamples=np.inf)).pvalue
        assert r.p == pytest.approx(ref) and r.method == "Wilcoxon signed-rank (exact)"
        ps.append(ref)
    # Holm over three equal p-values: each becomes min(1, 3 p).
    assert list(drift.p_holm) == pytest.approx([min(1.0, 3 * p) for p in ps])
    assert all("too few pairs" in w for w in drift.warning)  # 3 conversations cannot reach p < 0.05
    table = drift_table(summary)
    assert table.rows[0][:2] == ["agent stability", "round 3 - round 1"]
    assert "Drift: the last probe round against the first" in report_html
    console = Console(record=True, width=200)
    print_summary(run_dir, console)
    assert "drift, persona (agent): round 3 - round 1 = " in console.export_text()


def test_drift_needs_two_rounds(tmp_path) -> None:
    from driftlab.report.metrics import summarize_run
    from driftlab.report.tables import drift_table

    one = summarize_run(make_run(tmp_path / "one", rounds=1, ablation=False))
    assert one.drift.empty and drift_table(one) is None


def test_cut_replies_are_shared_per_condition_flagged_and_left_out_in_the_sensitivity(tmp_path):
    """Every empty-user agent probe of repeat 0 is cut: that condition is flagged (50% of its probes
    vs 0% for persona) and its stability without cut probes is the mean of repeat 1 alone."""
    from rich.console import Console

    from driftlab.cli.report import print_summary
    from driftlab.report.html import write_report
    from driftlab.report.metrics import summarize_run

    run = make_run(tmp_path / "run", rounds=3)
    lines = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    for r in lines:
        if r["kind"] == "probe" and r["condition"] == "empty-user" and r["repeat"] == 0:
            r["finish_reason"] = "length"
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summarize_run(run)
    cut = s.cut.set_index("condition")
    assert cut.loc["persona", "probes_cut"] == 0.0 and cut.loc["empty-user", "probes_cut"] == 0.5
    assert cut.loc["persona", "turns_cut"] == pytest.approx(9 / 15)  # 9 agent turns cut, 6 user turns not (a_1: none)
    assert (bool(cut.loc["persona", "flag"]), bool(cut.loc["empty-user", "flag"])) == (False, True)
    overall = s.overall_uncut.set_index(["condition", "target", "category"])
    want = np.mean([np.mean([agent_score(i, "empty-user", r, 1) for r in (1, 2, 3)]) for i in range(3)])
    assert overall.loc[("empty-user", "agent", "all"), "mean"] == pytest.approx(want)
    full = s.overall.set_index(["condition", "target", "category"])
    assert overall.loc[("persona", "agent", "all"), "mean"] == pytest.approx(full.loc[("persona", "agent", "all"), "mean"])
    page = write_report(run).read_text()
    assert "Overall scores without cut probes (sensitivity)" in page and "probes_cut" in page
    console = Console(record=True, width=250)
    print_summary(run, console)
    text = console.export_text()
    assert "9 of 18 agent probes (50%)" in text and "0 of 18 agent probes (0%)" in text
    assert "Warning: empty-user is cut more or less often than persona" in text


def test_a_turn_that_repeats_an_earlier_one_counts_and_the_long_qwen_dialogs_loop(tmp_path) -> None:
    """`repeated`: an agent turn whose text (stripped) is an earlier round's of the same dialog. On the
    committed 40-round study, rounds 1-22 (fixed: a resumed run only appends later rounds): no repeat in
    round 1, 19 of 20 agent turns by round 8 (the loops its README counts), all 20 from round 19."""
    from driftlab.report.activation import measures_frame, repeated_turns

    texts = {(0, 1): "a", (0, 2): "b", (0, 3): " a", (0, 4): "c", (1, 1): "b", (1, 2): "a"}
    assert repeated_turns(texts) == {(0, 1): 0.0, (0, 2): 0.0, (0, 3): 1.0, (0, 4): 0.0, (1, 1): 0.0, (1, 2): 0.0}
    frame = measures_frame(Path(__file__).parents[1] / "docs/results/long-qwen-plain")
    turns = frame[(frame.what == "turn") & (frame["round"] <= 22)].groupby("round").repeated.sum()
    assert turns[1] == 0 and turns[8] == 19 and (turns.loc[19:22] == 20).all()
    assert frame[frame.what == "probe"].repeated.isna().all()
    # The measures' figure adds a panel for them where any turn repeats (one more than without).
    from PIL import Image

    from driftlab.report.activation import three_ways_figure

    with_loops = three_ways_figure(frame, Path(tmp_path) / "loops.png")
    without = three_ways_figure(frame.assign(repeated=0.0), Path(tmp_path) / "none.png")
    assert Image.open(with_loops).width > Image.open(without).width
