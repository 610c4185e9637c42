"""The README is the contract with a newcomer: its commands and examples must stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one():
    quick = README.split("## Quick start", 1)[1].split("## What you can do", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks)
    install, test = (b.strip() for b in blocks)
    assert install.startswith("pip install torch==2.13.0 && pip install -e")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{test}\n" in ci, "CI must run the README's test command verbatim"
    for step in ("pip install torch==2.13.0", 'pip install -e ".[test]"'):
        assert step in install and step in ci


def test_cli_commands_in_the_readme_exist():
    from typer.main import get_command

    from driftlab.cli import app

    root = get_command(app)
    for block in _bash_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            for cmd in re.findall(r"(?:^|&& )driftlab ([a-z][a-z-]*)(?: ([a-z]+))?", line.strip()):
                group = root.commands.get(cmd[0])
                assert group is not None, f"driftlab {cmd[0]} (README) does not exist"
                if hasattr(group, "commands") and cmd[1]:
                    assert cmd[1] in group.commands, f"driftlab {cmd[0]} {cmd[1]} (README) does not exist"


def test_documented_docs_exist():
    for link in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / link).is_file(), link


@pytest.fixture
def measures_kept():
    """The measure registry as it was: the README registers its own measure, which a later test of
    this worker may register again under the same name from its own module."""
    from driftlab.bench import measures

    tables = (measures.MEASURES, measures._PARAMS, measures._CHECKS, measures._CUSTOM)
    saved = [dict(t) for t in tables]
    yield
    for table, old in zip(tables, saved, strict=True):
        table.clear()
        table.update(old)


@pytest.mark.model
def test_python_examples_run(tmp_path, monkeypatch, measures_kept):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) == 2
    spaces = [{} for _ in blocks]
    for block, namespace in zip(blocks, spaces, strict=True):
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own examples
    api, lower = spaces
    assert api["run"].manifest["completed"] and api["run"].path is None  # in memory: nothing left behind
    assert [r["kind"] for r in api["mine"].records].count("probe") == 1
    assert not any(tmp_path.iterdir())
    assert lower["plain"].trace.decode.shape[1:] == (30, 9)  # SmolLM2-135M: layers, heads
