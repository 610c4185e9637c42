"""The self-chat protocol: who sees what, probes stay out of the dialog, runs resume exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from driftlab.bench import get_persona
from driftlab.protocol.selfchat import FOLD_TEMPLATE, Dialog, Pair, SelfChat, SelfChatConfig, item_seed
from driftlab.records.rundir import RunDir, record_key


def _dialog(condition: str = "persona") -> Dialog:
    pair = Pair(0, get_persona("reply-in-french"), get_persona("very-happy"), "Is coffee good for you?")
    d = Dialog(pair, condition)
    d.a = ["Is coffee good for you?", "a2", "a3"]
    d.b = ["b1", "b2"]
    return d


def test_agent_view_is_the_dialog_from_the_agents_side():
    d = _dialog()
    assert d.agent_view(3, "a3") == [
        {"role": "system", "content": d.pair.agent.system_prompt},
        {"role": "user", "content": "Is coffee good for you?"},
        {"role": "assistant", "content": "b1"},
        {"role": "user", "content": "a2"},
        {"role": "assistant", "content": "b2"},
        {"role": "user", "content": "a3"},
    ]
    probe = d.agent_view(2, d.pair.agent.probe)
    assert probe[-1] == {"role": "user", "content": "What do you do in London as a tourist?"}
    assert len(probe) == 4


def test_user_view_swaps_roles_and_folds_the_first_exchange():
    d = _dialog()
    folded = d.user_view(3, fold=True)
    assert folded == [
        {"role": "system", "content": d.pair.user.system_prompt},
        {"role": "user", "content": FOLD_TEMPLATE.format(a="Is coffee good for you?", b="b1")},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "b2"},
    ]
    plain = d.user_view(2, fold=False)
    assert plain[1:] == [
        {"role": "assistant", "content": "Is coffee good for you?"},
        {"role": "user", "content": "b1"},
    ]
    ablated = _dialog("empty-user").user_view(2, fold=True)
    assert all(m["role"] != "system" for m in ablated)  # the ablation removes s_A


def test_item_seeds_are_stable_and_distinct():
    assert item_seed(0, 1, "persona", 2, "agent") == item_seed(0, 1, "persona", 2, "agent")
    seeds = {item_seed(0, p, c, r, w) for p in range(5) for c in ("persona", "empty-user")
             for r in range(1, 9) for w in ("user", "agent")}
    assert len(seeds) == 5 * 2 * 8 * 2
    assert all(0 <= s < 2**63 for s in seeds)


class Recording:
    """Wraps the real backend and keeps every conversation it was asked to continue."""

    def __init__(self, backend):
        self.backend, self.name, self.seen = backend, backend.name, []
        self.generate = backend.generate

    def chat(self, conversations, sampling, **kw):
        replies = self.backend.chat(conversations, sampling, **kw)
        self.seen += [(c, r.text) for c, r in zip(conversations, replies)]
        return replies


@pytest.mark.model
def test_probe_replies_never_enter_the_dialog(smol32, tmp_path):
    cfg = SelfChatConfig(pairs=2, rounds=3, max_new_tokens=12, user_probe=True, probe_repeats=2, seed=3)
    rec = Recording(smol32)
    rundir = SelfChat(cfg, str(tmp_path / "run"), rec, progress=False).run()
    records = rundir.records()
    probes = {r["text"] for r in records if r["kind"] == "probe" and r["text"]}
    turns = {r["text"] for r in records if r["kind"] == "turn"}
    for conv, _ in rec.seen:
        context = {m["content"] for m in conv}
        assert not (context & (probes - turns)), "a probe reply leaked into a later context"
    # Every probe's context is the dialog so far followed by the probe question.
    probe_questions = {get_persona(r["persona"]).probe for r in records if r["kind"] == "probe"}
    n_probe_calls = sum(conv[-1]["content"] in probe_questions for conv, _ in rec.seen)
    assert n_probe_calls == len([r for r in records if r["kind"] == "probe"]) == 2 * 3 * 2 * 2
    assert len(records) == len({record_key(r) for r in records})  # no duplicates
    for r in records:
        if r["kind"] == "probe":
            assert 0.0 <= r["score"] <= 1.0
            assert r["score"] == pytest.approx(get_persona(r["persona"]).score(r["text"]))


def _run_cmd(out: Path, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "driftlab", "run", "--out", str(out), "--pairs", "2", "--rounds", "3",
            "--max-new-tokens", "10", "--user-probe", "--dtype", "float32", "--seed", "7",
            "--batch-size", "2", *extra]


@pytest.mark.model
def test_killed_run_resumes_to_the_same_result(tmp_path):
    """kill -9 mid-run, run the same command again: same records as an uninterrupted run."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_run_cmd(full, ["--no-report"]), check=True, env=env, capture_output=True)

    cut = tmp_path / "cut"
    proc = subprocess.Popen(_run_cmd(cut, ["--no-report"]), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    records = cut / "records.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if records.exists() and len(records.read_text().splitlines()) >= 6:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    n_before = len(RunDir(cut).records())
    assert 0 < n_before < len(RunDir(full).records()), "the kill did not land mid-run"
    kept = {record_key(r): r for r in RunDir(cut).records()}

    done = subprocess.run(_run_cmd(cut), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "report:" in done.stdout
    a, b = RunDir(full).records(), RunDir(cut).records()
    assert len(b) == len({record_key(r) for r in b}), "duplicated records after resume"
    for r in b:  # nothing recorded before the kill was redone
        if record_key(r) in kept:
            assert r == kept[record_key(r)]
    strip = lambda rs: sorted(json.dumps(r, sort_keys=True) for r in rs)  # noqa: E731
    assert strip(a) == strip(b)
    assert json.loads((cut / "manifest.json").read_text())["completed"] is True
    assert (cut / "report.html").stat().st_size > 10_000


def test_resume_refuses_a_different_config(tmp_path):
    rd = RunDir(tmp_path)
    rd.start({"seed": 1, "rounds": 8}, {}, ["seed", "rounds"])
    with pytest.raises(Exception, match="different configuration.*seed: 1 -> 2"):
        rd.start({"seed": 2, "rounds": 8}, {}, ["seed", "rounds"])
    assert rd.start({"seed": 1, "rounds": 8}, {}, ["seed", "rounds"]) is True


def test_torn_last_record_is_dropped(tmp_path):
    rd = RunDir(tmp_path)
    rd.append([{"kind": "turn", "pair": 0, "condition": "persona", "round": 1, "speaker": "agent", "text": "x"}])
    with rd.records_path.open("a") as fh:
        fh.write('{"kind": "turn", "pair": 0, "cond')
    assert len(rd.records()) == 1
    assert rd.records_path.read_text().endswith("}\n")
