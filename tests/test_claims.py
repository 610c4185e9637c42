"""What a reader meets names nothing they cannot see: no tracker numbers ("issue 21") and no paths
outside the repository (`../shared`) in README, docs or what the benchmarks print, and no internal
document numbers of the papers ('000', '001') in the CLI's help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROSE = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.py"))]
ISSUE = re.compile(r"\bissues?[\s-]+#?\d+|\bthe [\w-]+ issue\b|\bits issue\b", re.IGNORECASE)
OUTSIDE = re.compile(r"\.\./shared|shared/(?:GPU|DESIGN)\.md|shared/seeds")


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_cites_no_tracker_number_and_no_file_outside_the_repository(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [m.group(0) for m in ISSUE.finditer(text)] + [m.group(0) for m in OUTSIDE.finditer(text)]
    assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_scan_finds_what_it_looks_for() -> None:
    assert ISSUE.search("as issue 21 asks") and ISSUE.search("Issues #4") and OUTSIDE.search("see ../shared/GPU.md")
    assert ISSUE.search("the issue-22 drift run") and ISSUE.search("since the seams issue")
    assert ISSUE.search("as its issue reported them")
    assert not ISSUE.search("a tissue 3 layers thick") and not OUTSIDE.search("shared/ memory")
    assert not ISSUE.search("the issue is the padding") and not ISSUE.search("a known issue in torch")


def _commands(group, path=()):
    """Every (sub)command path of the Typer app, as click sees it."""
    yield path
    for name, command in getattr(group, "commands", {}).items():
        yield from _commands(command, (*path, name))


def test_help_names_papers_not_internal_document_numbers() -> None:
    import typer
    from typer.testing import CliRunner

    from driftlab.cli import app

    runner = CliRunner()
    paths = list(_commands(typer.main.get_command(app)))
    assert ("run",) in paths and ("models", "warm") in paths and len(paths) >= 30
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert not re.search(r"(?<![\d.])00[0-2](?![\d.])", result.output), (path, result.output)


def test_committed_benchmark_records_say_where_and_when_they_ran() -> None:
    """docs/results/bench/*.txt (`benchmarks/run.py --record`): the command, date, commit, machine and
    n first, then RESULT lines a sentence can be checked against."""
    records = sorted((ROOT / "docs" / "results" / "bench").glob("*.txt"))
    assert records, "no committed benchmark record"
    for path in records:
        lines = path.read_text(encoding="utf-8").splitlines()
        assert [line.split(":", 1)[0] for line in lines[:5]] == ["command", "date", "commit", "machine", "n"], path
        assert lines[0].startswith("command: python benchmarks/run.py ")
        assert re.fullmatch(r"date: \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", lines[1]), lines[1]
        results = dict(line.removeprefix("RESULT ").split("=", 1) for line in lines if line.startswith("RESULT "))
        assert results, path
    gpu = dict(line.removeprefix("RESULT ").split("=", 1) for line in
               (ROOT / "docs/results/bench/gpu-quick-cpu.txt").read_text().splitlines() if line.startswith("RESULT "))
    assert gpu["device"] == "cpu" and gpu["tiny.check.modes_ok"] == "7/7"  # what docs/performance.md says of it
