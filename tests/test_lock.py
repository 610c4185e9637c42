"""The locked test environment (test-lock.txt, .ci/lock.py): current with pyproject, and a stale
lock fails CI with one line."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "lock.py"


def _lock_module():
    spec = importlib.util.spec_from_file_location("ci_lock", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _lock_module()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "test-lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


def _check(pyproject: Path, lock_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "check", "--pyproject", str(pyproject), "--lock",
                           str(lock_file)], capture_output=True, text=True)


def test_the_committed_lock_is_current() -> None:
    """Fails whenever pyproject's dependencies change without `python3 .ci/lock.py refresh`."""
    assert lock.check() is None, lock.check()
    done = _check(ROOT / "pyproject.toml", ROOT / "test-lock.txt")
    assert done.returncode == 0 and "current" in done.stdout, done


def test_the_lock_pins_every_dependency_within_pyprojects_ranges() -> None:
    """Every requirement of the package and its test extra (but torch, installed first) is pinned,
    to a version its specifier admits."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    assert "torch" not in pins and "driftlab" not in pins and len(pins) > 100
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(text)
        if req.name == "torch" or (req.marker is not None and not req.marker.evaluate()):
            continue
        name = re.sub(r"[-_.]+", "-", req.name.lower())
        assert name in pins, f"{req.name} is not in test-lock.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"


@pytest.mark.parametrize("edit, stale", [
    (lambda s: s.replace('"numpy>=1.26"', '"numpy>=2.1"'), True),  # a changed range
    (lambda s: s.replace('"pytest>=8", ', '"pytest>=8", "hypothesis>=6", '), True),  # a new test dependency
    (lambda s: s.replace('"numpy>=1.26"', '"numpy >= 1.26"'), False),  # spacing alone
    (lambda s: s.replace('version = "0.1.0"', 'version = "0.2.0"'), False),  # not a dependency
])
def test_a_dependency_changed_without_a_refresh_fails_with_one_line(tmp_path: Path, edit, stale: bool) -> None:
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    assert edit(text) != text  # the edit applies to today's pyproject
    pyproject.write_text(edit(text))
    done = _check(pyproject, ROOT / "test-lock.txt")
    if not stale:
        assert done.returncode == 0, done
        return
    assert done.returncode == 1 and done.stdout == "", done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "stale" in lines[0] and "python3 .ci/lock.py refresh" in lines[0], lines


def test_a_missing_or_unstamped_lock_is_named(tmp_path: Path) -> None:
    done = _check(ROOT / "pyproject.toml", tmp_path / "test-lock.txt")
    assert done.returncode == 1 and "test-lock.txt is missing" in done.stderr, done
    unstamped = tmp_path / "test-lock.txt"
    unstamped.write_text("numpy==2.0.0\n")
    done = _check(ROOT / "pyproject.toml", unstamped)
    assert done.returncode == 1 and "pyproject-dependencies-sha256" in done.stderr, done


def test_freeze_lines_become_sorted_pins_without_torch_and_driftlab() -> None:
    freeze = "Torch==2.13.0+cpu\nzeta==1.0\n-e git+https://x/driftlab@abc#egg=driftlab\nAlpha_B==2.0\n" \
             "driftlab @ file:///work/main\n"
    assert lock._pinned(freeze) == ["Alpha_B==2.0", "zeta==1.0"]


def test_a_missing_or_broken_pyproject_is_one_line(tmp_path: Path) -> None:
    done = _check(tmp_path / "pyproject.toml", ROOT / "test-lock.txt")
    assert done.returncode == 1 and "pyproject.toml is missing" in done.stderr, done
    assert "Traceback" not in done.stderr
    broken = tmp_path / "pyproject.toml"
    broken.write_text("[project\n")
    done = _check(broken, ROOT / "test-lock.txt")
    assert done.returncode == 1 and "is not valid TOML" in done.stderr and "Traceback" not in done.stderr, done
