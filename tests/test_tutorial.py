"""docs/tutorial.md runs: its Python blocks, in order, in one fresh interpreter, on the real model.

A tutorial whose code has rotted is worse than none; this is the check that it has not. The
blocks run in a temporary directory (the files they write land there) that holds the one
repository file they read, at the same relative path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
READS = ["tests/fixtures/mmlu_raw_sample.jsonl"]


def blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_tutorial_has_code_to_run():
    code = blocks(TUTORIAL.read_text(encoding="utf-8"))
    assert len(code) >= 7 and all(block.strip() for block in code)
    for read in READS:
        assert read in TUTORIAL.read_text(encoding="utf-8") and (ROOT / read).is_file()


@pytest.mark.model
def test_every_block_of_the_tutorial_runs(tmp_path):
    for read in READS:
        (tmp_path / read).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / read, tmp_path / read)
    code = blocks(TUTORIAL.read_text(encoding="utf-8"))
    # Each block announces itself, so a failure names the block it is in.
    script = "\n".join(f"print('--- block {i}', flush=True)\n{block}" for i, block in enumerate(code))
    (tmp_path / "tutorial.py").write_text(script, encoding="utf-8")
    done = subprocess.run([sys.executable, "tutorial.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=3000)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = done.stdout
    assert f"--- block {len(code) - 1}" in out
    assert "Run(selfchat, 5 records, in memory)" in out and "memory:my-smol" in out
    assert "1.0 0.0" in out  # the one-sentence measure, on its two examples
    assert (tmp_path / "trace.png").stat().st_size > 10_000
