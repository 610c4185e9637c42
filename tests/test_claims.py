"""What a reader meets names nothing they cannot see: no tracker numbers ("issue 21") and no paths
outside the repository (`../shared`) in README, docs or what the benchmarks print, and no internal
document numbers of the papers ('000', '001') in the CLI's help. And what README and docs call
"tested" names its test, and a timing they quote names its record, or its date and machine."""

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


# -- claims that need a source: "tested" and quoted timings ----------------------------------------
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"\s*(```|~~~)")
_ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s|\s*\|")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\[*])")


def paragraphs(text: str) -> list[tuple[int, str, str]]:
    """(first line, text, lead) of each unit of a markdown file's prose, code blocks left out.

    A unit is a paragraph (lines between blank lines), one list item or one table row. A list
    item's or table row's lead is the plain paragraph that introduces it: the text before the
    first item of its block, or else the last plain paragraph before the block under the same
    heading (a table's caption; the paragraph before a table that a list follows)."""
    units: list[tuple[int, str, str]] = []
    block: list[tuple[int, str]] = []
    last_plain = ""
    fence = False

    def flush() -> None:
        nonlocal block, last_plain
        if not block:
            return
        lead_lines: list[str] = []
        items: list[tuple[int, list[str]]] = []
        for number, line in block:
            if _ITEM.match(line):
                items.append((number, [line.strip()]))
            elif items:
                items[-1][1].append(line.strip())
            else:
                lead_lines.append(line.strip())
        lead = " ".join(lead_lines)
        if lead:
            units.append((block[0][0], lead, ""))
            last_plain = lead
        for number, lines in items:
            units.append((number, " ".join(lines), lead or last_plain))
        block = []

    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            flush()
            fence = not fence
        elif fence:
            continue
        elif not line.strip() or line.lstrip().startswith("<!--"):
            flush()
        elif line.startswith("#"):
            flush()
            last_plain = ""
        else:
            block.append((number, line))
    flush()
    return units


def sentences(text: str) -> list[str]:
    return _SENTENCE_END.split(text)


# (a) "tested": the word, as a claim that a test checks something.
TESTED = re.compile(r"(?<![\w-])tested\b", re.IGNORECASE)
# Not such a claim: a negation, a persona's property, or a statistical test of a result.
NOT_A_TEST_CLAIM = re.compile(r"\b(?:not|what is)\s+tested\b|McNemar|Wilcoxon|sign-flip|\bt-test|\bHolm\b"
                              r"|as the unit\b", re.IGNORECASE)
# Where the claim is checked: a test file or function, the testing page, a committed record.
TEST_SOURCE = re.compile(r"\btests/[\w/.-]+\.py|\btest_\w+|\btesting\.md|\bdocs/results/[\w.-]+|\bresults/[\w.-]+")


def untested_claims(text: str) -> list[str]:
    """'line: sentence' of each sentence that says something is tested without naming where.

    A sentence with "tested" is a claim unless it negates it ("not tested"), names a persona's
    property ("what is tested") or is about a statistical test (McNemar, Wilcoxon, sign-flip,
    t-test, Holm, "as the unit"). A claim must have in its paragraph (or the lead of its list
    item / table row) a tests/*.py path or a test_* name (a file or a function), docs/testing.md,
    or a committed record (docs/results/..., or results/... from a page in docs/)."""
    found = []
    for line, unit, lead in paragraphs(text):
        if TEST_SOURCE.search(unit) or TEST_SOURCE.search(lead):
            continue
        found += [f"{line}: {s}" for s in sentences(unit) if TESTED.search(s) and not NOT_A_TEST_CLAIM.search(s)]
    return found


# (b) a timing: a number with a time unit, not part of a formula or a bound ("1 + 18 s", "<= 90 s").
TIMING = re.compile(r"(?<![\w.,/-])(?<![<>=+*] )(?<![<>=+*])\d+(?:[.,]\d+)*(?:\s?(?:-|to)\s?\d+(?:[.,]\d+)*)?"
                    r" (?:ms(?:/step)?|s|sec|seconds?|min|minutes?|h|hours?|tok/s)(?![\w/-])")
# A setting or a bound, not a measurement: an option or one of these words just before or after it.
SETTING = re.compile(r"--[a-z][\w-]*|\b(?:defaults?|timeouts?|limits?|targets?|budgets?|at most|up to|waits?|backoff)\b",
                     re.IGNORECASE)
SETTING_AFTER = re.compile(r"\s*\(?`?(?:--[a-z]|(?:defaults?|timeouts?|limits?|targets?|budgets?|waits?)\b)",
                           re.IGNORECASE)
# Where a timing comes from: a committed record, or one dated observation on a named machine.
RECORD = re.compile(r"\bdocs/results/|\bresults/[\w.-]+|\bbenchmarks/\w+\.py|\bRESULT\b|\btesting\.md")
DATE = re.compile(r"\b20\d\d-\d\d\b")
MACHINE = re.compile(r"\b(?:CPU|GPU|cores?|H100|H200|A100|Xeon|EPYC|AVX[\w-]*|AMX|laptop|machine)\b")


def unsourced_timings(text: str) -> list[str]:
    """'line: sentence' of each sentence quoting a timing whose paragraph names no provenance.

    A timing is a number with a unit of time (ms, s, sec, seconds, min, minutes, h, hours, tok/s)
    in prose (code blocks are left out); "1 + 18 s" (a formula) and "<= 90 s" (a bound) are not
    timings, and neither is a setting or a bound: a number with a `--option` or one of default,
    timeout, limit, target, budget, at most, up to, wait, backoff in the 20 characters before it
    ("`--timeout`, 300 s", "a target of 10 minutes"), or an option or one of those words right
    after it ("1 s (--timeout)", "10 ms wait"). Its paragraph (or the lead of its list item /
    table row) must name a committed record (a path under docs/results/, a benchmarks/*.py, a
    RESULT line, docs/testing.md) or a date (2026-11) and a machine (CPU, GPU, cores, H100,
    Xeon, ...), which mark it as one observation."""
    found = []
    for line, unit, lead in paragraphs(text):
        context = f"{lead} {unit}"
        if RECORD.search(context) or (DATE.search(context) and MACHINE.search(context)):
            continue
        found += [f"{line}: {s}" for s in sentences(unit) if any(not _setting(s, m) for m in TIMING.finditer(s))]
    return found


def _setting(sentence: str, timing: re.Match) -> bool:
    """A setting or bound: SETTING in the 20 characters before the number, or right after it."""
    return bool(SETTING.search(sentence[max(0, timing.start() - 20):timing.start()])
                or SETTING_AFTER.match(sentence, timing.end()))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_what_the_docs_call_tested_names_its_test(path: Path) -> None:
    found = untested_claims(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: 'tested' without a test named beside it:\n" + "\n".join(found)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_timings_in_the_docs_say_where_they_come_from(path: Path) -> None:
    found = unsourced_timings(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: a timing without its record or date and machine:\n" + "\n".join(found)


def test_the_claim_scans_find_what_they_look_for() -> None:
    # "tested" without a test is found; with one named in its paragraph or list lead it is not.
    assert untested_claims("Batched greedy equals one-at-a-time greedy (tested).")
    assert untested_claims("Other text.\n\nIt is tested here on the CPU, in float32.\n")
    assert untested_claims("A table:\n\n| a | b |\n|---|---|\n| serve | tested: `driftlab serve` |\n")
    assert not untested_claims("Batched greedy equals one-at-a-time greedy (tested: tests/test_backend.py).")
    assert not untested_claims("Tested in `test_batched_greedy_equals_one_at_a_time`.")
    assert not untested_claims("Checked (docs/testing.md):\n\n- it is tested on CUDA\n- and on the CPU\n")
    assert not untested_claims("The drop is tested by the exact McNemar test.")
    assert not untested_claims("Not tested: vLLM.") and not untested_claims("| category | what is tested |")
    assert not untested_claims("```\n# tested per dialog\n```\n") and not untested_claims("an untested path")
    # A timing without provenance is found; a record, or a date with a machine, answers it.
    assert unsourced_timings("The suite took 7 s.") and unsourced_timings("Prefill: 3.0 vs 3.2 s, decode 13.2 tok/s.")
    assert unsourced_timings("It took about 4 h 15 min (not recorded).")
    assert unsourced_timings("One run:\n\n| mode | p50 |\n|---|---|\n| batched | 0.61 s |\n")
    assert not unsourced_timings("It took 23 minutes (one run on 2026-11-24, a 2-core CPU).")
    assert not unsourced_timings("It took 1.08 s (benchmarks/measures.py).")
    assert not unsourced_timings("Cost: 11 minutes per point (docs/results/sweep-ref-20/).")
    assert not unsourced_timings("One run, 2026-11, an H100:\n\n| a | b |\n|---|---|\n| x | 7.69 ms |\n\n"
                                 "* Compiling took 42-130 s each.\n")
    assert unsourced_timings("Naive 1703 s, batched 456 s: now `--full`.")  # an option nearby is no setting
    assert not unsourced_timings("A per-request timeout (`--timeout`, 300 s).")
    assert not unsourced_timings("No answer within 1 s (--timeout).") and not unsourced_timings("a 10 ms wait")
    assert not unsourced_timings("Backoff: a first wait of 0.5 s, doubling up to 30 s.")
    assert not unsourced_timings("A first compile <= 90 s is its target.") and not unsourced_timings("m = 1 + 18 s")
    assert not unsourced_timings("three 0s: [0, 0.56]") and not unsourced_timings("```\nsleep 30 s\n```\n")
