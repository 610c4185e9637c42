"""`driftlab personas list|score|measures`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from driftlab.cli import app
from driftlab.errors import DriftlabError

runner = CliRunner()


def test_list_json_has_all_fields() -> None:
    result = runner.invoke(app, ["personas", "list", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 100
    assert {"id", "category", "system_prompt", "probe", "measure", "params"} <= set(rows[0])
    assert rows[0]["id"] == "start-words-with-a"


def test_list_filters_by_category() -> None:
    result = runner.invoke(app, ["personas", "list", "--category", "language", "--format", "json"])
    assert [r["id"] for r in json.loads(result.stdout)] == [
        "reply-in-french",
        "french-with-english-translation",
        "translate-london-questions-to-french",
    ]


def test_list_table_shows_full_ids() -> None:
    result = runner.invoke(app, ["personas", "list", "-c", "language"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert "translate-london-questions-to-french" in result.stdout
    assert "Vous parlez toujours" in result.stdout


def test_list_includes_user_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    entry = {
        "id": "pirate",
        "category": "persona",
        "system_prompt": "Be a pirate.",
        "probe": "Hi?",
        "measure": "mentions_any",
        "params": {"terms": ["arr"]},
    }
    path.write_text(json.dumps(entry) + "\n", encoding="utf-8")
    result = runner.invoke(app, ["personas", "list", "--file", str(path), "--format", "json"])
    assert json.loads(result.stdout)[-1]["id"] == "pirate"
    result = runner.invoke(app, ["personas", "score", "pirate", "Arr, matey!", "--file", str(path)])
    assert float(result.stdout) == 1.0


def test_score_prints_a_number() -> None:
    good = runner.invoke(
        app, ["personas", "score", "reply-in-french", "Bonjour ! Je visite le Louvre avec mes amis."]
    )
    bad = runner.invoke(
        app, ["personas", "score", "reply-in-french", "Hello! I visit the British Museum with friends."]
    )
    assert good.exit_code == 0 and bad.exit_code == 0
    assert float(good.stdout) > 0.9 and float(bad.stdout) < 0.1


def test_score_reads_stdin() -> None:
    result = runner.invoke(app, ["personas", "score", "cat-meows", "-"], input="Meow meow, purr.\n")
    assert float(result.stdout) == 1.0


def test_unknown_id_is_a_driftlab_error() -> None:
    result = runner.invoke(app, ["personas", "score", "reply-in-frnch", "Bonjour"])
    assert isinstance(result.exception, DriftlabError)
    assert "reply-in-french" in (result.exception.hint or "")


def test_measures_lists_every_measure() -> None:
    result = runner.invoke(app, ["personas", "measures"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in ("choice", "language", "mentions_any", "syllable_limit"):
        assert name in result.stdout


def test_errors_exit_2_with_hint_through_the_entry_point() -> None:
    code = "import sys; sys.argv = ['driftlab', 'personas', 'list', '--category', 'colours']; from driftlab.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Error: unknown category 'colours'" in proc.stderr
    assert "Hint: use one of: multiple_choice" in proc.stderr
