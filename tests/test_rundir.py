"""Run directories: one writer at a time, readers that never modify, line-numbered errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS
from driftlab.records.rundir import RunDir

TURN = {"kind": "turn", "pair": 0, "condition": "persona", "round": 1, "speaker": "agent", "text": "x",
        "n_tokens": 1, "finish_reason": "stop", "seed": 1}


def _hold_lock(path) -> subprocess.Popen:
    """Another process holding the run's lock (as a live `driftlab run` would)."""
    code = textwrap.dedent(f"""
        import sys, time
        from driftlab.records.rundir import RunDir
        with RunDir({str(path)!r}).writing():
            print("locked", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_reader_never_modifies_the_records_file(tmp_path):
    rd = RunDir(tmp_path)
    with rd.writing():
        rd.append([TURN])
    with rd.records_path.open("a") as fh:
        fh.write('{"kind": "turn", "pair": 0, "cond')  # a writer mid-write
    before = rd.records_path.read_bytes()
    assert len(rd.records()) == 1
    assert rd.records_path.read_bytes() == before  # the torn tail is the writer's to cut
    with rd.writing():  # the next writer repairs it, under the lock
        pass
    assert rd.records_path.read_text().endswith("}\n") and len(rd.records()) == 1


def test_second_writer_is_refused_with_the_owner_pid(tmp_path):
    holder = _hold_lock(tmp_path / "run")
    try:
        with pytest.raises(DriftlabError, match=rf"in use by another driftlab process \(PID {holder.pid} on "):
            with RunDir(tmp_path / "run").writing():
                pass
    finally:
        holder.kill()
        holder.wait()
    with RunDir(tmp_path / "run").writing():  # free again once the holder is gone (even killed)
        pass


@pytest.mark.process  # fresh interpreters
def test_cli_run_on_a_locked_directory_fails_at_once_and_writes_nothing(tmp_path):
    holder = _hold_lock(tmp_path / "run")
    try:
        proc = subprocess.run([sys.executable, "-m", "driftlab", "run", "--out", str(tmp_path / "run"),
                               "--pairs", "1", "--rounds", "1"], capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr
    assert f"PID {holder.pid}" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", ".owner"]


def test_writes_outside_the_lock_are_a_bug(tmp_path):
    with pytest.raises(RuntimeError, match="writing"):
        RunDir(tmp_path).append([TURN])


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x00\x00\x00\n", "line 2 is not a valid record"),
        (b"\xff\xfe caf\xe9\n", "line 2 is not a valid record"),
        (b"{}\n", "line 2 is not a valid record: Unable to extract tag using discriminator 'kind'"),
        (b"[1, 2]\n", "line 2 is not a valid record: a JSON list"),
        (json.dumps({**TURN, "round": 0}).encode() + b"\n", "line 2 is not a valid record: turn.round"),
    ],
)
def test_bad_record_lines_are_errors_with_their_line_number(tmp_path, content, message):
    rd = RunDir(tmp_path)
    rd.records_path.write_bytes(json.dumps(TURN).encode() + b"\n" + content)
    with pytest.raises(DriftlabError, match=message):
        rd.records(RECORDS)


@pytest.mark.parametrize("manifest", ["{}", "[]", "not json", '{"config": 3}'])
def test_bad_manifests_are_errors(tmp_path, manifest):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(DriftlabError, match="manifest|not valid JSON"):
        RunDir(tmp_path).read_manifest()


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DriftlabError, match="is a file"):
        with RunDir(tmp_path / "f").writing():
            pass
    assert (tmp_path / "f").read_text() == "x"
