"""`driftlab replay`: user turns from data, the model's own replies, every agent turn scored.

What is checked: the data (ShareGPT's cut file read record by record, MT-Bench, a user's JSONL with
one-line errors naming the line before any model loads, the chained draw); on SmolLM2 that the
model sees the source's user turns verbatim and in order with its own replies (never the logged
assistant's), each agent turn scored by its persona's own measure, and the compliance per turn
(the table, results.json, the figure); on a tiny random Llama (tests/tiny_models.py: bookkeeping,
not language) that a gate by score steers exactly the turns after a failing one. Resume after
SIGKILL is tests/test_resume.py's replay case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from driftlab.assets import conversations as conv
from driftlab.assets import datasets
from driftlab.assets.store import MARKER
from driftlab.cli import app
from driftlab.errors import DriftlabError


def _sharegpt_record(i: int, speakers: list[str], words: int = 5) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": s, "value": f"turn {k} of {i} " + "w " * words}
                                             for k, s in enumerate(speakers)]}


# -- the data ---------------------------------------------------------------------------------------
def test_sharegpt_cleaning_keeps_the_complete_records_before_the_cut() -> None:
    """The packaged file is one JSON array cut mid-record: every record before the cut is read, in
    OpenAI's chat format (human and user ask; gpt, chatgpt, bing and bard answer), and the same reader
    as a user's file reads the result."""
    records = [_sharegpt_record(0, ["human", "gpt", "human", "chatgpt"]), _sharegpt_record(1, ["gpt", "human"]),
               _sharegpt_record(2, ["system", "user", "bard"])]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"c2"') + 30]  # mid-record, as the package's 125.5 MB file ends
    data, n = datasets._clean_sharegpt(cut.encode())
    assert n == 2
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert [[m["role"] for m in r["messages"]] for r in rows] == [["user", "assistant", "user", "assistant"],
                                                                  ["assistant", "user"]]
    assert rows[0]["messages"][2]["content"] == records[0]["conversations"][2]["value"]
    whole, n_whole = datasets._clean_sharegpt(text.encode())
    assert n_whole == 3 and whole.startswith(data)


def test_mtbench_questions_become_two_user_turns() -> None:
    raw = "\n".join(json.dumps({"question_id": q, "category": "writing", "turns": [f"first {q}", f"second {q}"]})
                    for q in (81, 82))
    data, n = datasets._clean_mtbench(raw.encode())
    rows = [json.loads(line) for line in data.decode().splitlines()]
    assert n == 2 and rows[1] == {"id": "mtbench-82", "category": "writing",
                                  "messages": [{"role": "user", "content": "first 82"},
                                               {"role": "user", "content": "second 82"}]}


@pytest.mark.parametrize("line,what", [
    ('{"messages": [{"role": "user", "content": "hi"}', "line 2: not JSON"),
    ('{"turns": ["hi"]}', 'line 2: no "messages" list'),
    ('{"messages": [{"role": "human", "content": "hi"}]}', "line 2: message 1 has no role"),
    ('{"messages": [{"role": "user", "content": ["a", "b"]}]}', "line 2: user message 1 has no text content"),
    ('{"messages": [{"role": "assistant", "content": "hello"}]}', "line 2: no user message"),
])
def test_a_bad_conversations_line_is_a_one_line_error_with_its_number_before_any_model_loads(
        tmp_path, monkeypatch, line: str, what: str) -> None:
    import driftlab.chat.factory as factory

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the conversations were checked")

    monkeypatch.setattr(factory, "make_backend", no_model)
    path = tmp_path / "logs.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    result = CliRunner().invoke(app, ["replay", "--conversations", str(path), "--out", str(tmp_path / "run")])
    assert isinstance(result.exception, DriftlabError), result.output  # `driftlab` prints it as one line
    message = result.exception.message  # str() adds the hint on a line of its own
    assert message.startswith(f"--conversations {path}, {what}") and "\n" not in message, message
    assert not (tmp_path / "run" / "records.jsonl").exists()


@pytest.fixture
def pulled(tmp_path, monkeypatch) -> Path:
    """A driftlab cache holding a small 'pulled' ShareGPT (a cache as `driftlab data pull` leaves it)."""
    monkeypatch.setenv("DRIFTLAB_CACHE", str(tmp_path / "cache"))
    records = [_sharegpt_record(i, ["human", "gpt"] * 3) for i in range(30)]
    records += [_sharegpt_record(30, ["gpt", "human"]),  # a later split: opens with an answer
                _sharegpt_record(31, ["human", "gpt"], words=80),  # too long for the chain
                {"id": "c32", "conversations": [{"from": "human", "value": "caf\u00e9 \u2028 ol\u00e9"}]}]  # not ASCII
    data, _ = datasets._clean_sharegpt(json.dumps(records).encode())
    directory = datasets.dataset_dir("sharegpt")
    directory.mkdir(parents=True)
    (directory / "sharegpt.jsonl").write_bytes(data)
    (directory / MARKER).write_text("{}")
    return directory


def test_chained_dialogs_draw_distinct_short_standalone_first_turns_by_seed(pulled) -> None:
    pool = conv.standalone_turns(conv._dataset("sharegpt"), 60)
    assert len(pool) == 30 and all(t.startswith("turn 0 of ") for t in pool)  # first turns only, none of c30-c32
    dialogs = conv.draw_dialogs("sharegpt-chain", 4, 12, seed=1)
    assert [len(set(d["turns"])) for d in dialogs] == [12] * 4 and all(t in pool for d in dialogs for t in d["turns"])
    assert conv.draw_dialogs("sharegpt-chain", 4, 12, seed=1) == dialogs != conv.draw_dialogs("sharegpt-chain", 4, 12,
                                                                                             seed=2)
    whole = conv.draw_dialogs("sharegpt", 2, 3, seed=0)
    i = whole[0]["id"][1:]
    assert whole[0]["turns"] == [f"turn {k} of {i} " + "w " * 5 for k in (0, 2, 4)]  # its user turns, in order
    with pytest.raises(DriftlabError, match="fewer than --rounds 31"):
        conv.draw_dialogs("sharegpt-chain", 1, 31, seed=0)
    with pytest.raises(DriftlabError, match="30 conversations that fit .* fewer than the 40 dialogs"):
        conv.draw_dialogs("sharegpt", 40, 3, seed=0)


def test_replay_is_a_protocol_of_its_own_config() -> None:
    from driftlab.protocol.registry import protocol_class
    from driftlab.protocol.replay import Replay, ReplayConfig

    assert protocol_class("replay") is Replay and Replay.config_type() is ReplayConfig
    with pytest.raises(ValueError, match="a replay has no user model"):
        ReplayConfig(conversations="x.jsonl", user_probe=True)


def test_a_data_source_not_pulled_says_how_to_pull_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DRIFTLAB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DriftlabError, match="not pulled") as err:
        conv.draw_dialogs("mtbench", 2, 2, seed=0)
    assert "driftlab data pull mtbench" in err.value.hint


def test_the_score_gate_reads_the_last_agent_turn_a_conversation_shows() -> None:
    """A turn of round i is decided by b_{i-1}'s score; a probe after b_i (its conversation shows b_i) by b_i's,
    though b_{i+1} may be scored by then; a first turn by none."""
    from driftlab.protocol.replay import Replay
    from driftlab.protocol.selfchat import Job

    replay = Replay.__new__(Replay)
    replay._turn_scores = {(0, "persona", 1): 0.0, (0, "persona", 2): 1.0, (0, "persona", 3): 0.0}
    shows = lambda n: [{"role": "system", "content": "s"}] + [  # noqa: E731
        m for i in range(n) for m in ({"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"b{i}"})]
    job = lambda n: Job({"pair": 0, "condition": "persona"}, [*shows(n), {"role": "user", "content": "next"}], 0,  # noqa: E731
                        "agent", True)
    assert [replay._previous_score(job(n)) for n in (0, 1, 2, 3)] == [None, 0.0, 1.0, 0.0]


# -- on a real model ----------------------------------------------------------------------------------
LOGS = [
    {"messages": [{"role": "system", "content": "You are a logged bot."},
                  {"role": "user", "content": "Hi! What is a good name for a cat?"},
                  {"role": "assistant", "content": "LOGGED ANSWER ONE"},
                  {"role": "user", "content": "And one for a dog?"},
                  {"role": "assistant", "content": "LOGGED ANSWER TWO"},
                  {"role": "user", "content": "Thanks. What should I cook tonight?"}]},
    {"id": "short", "messages": [{"role": "user", "content": "Tell me a fun fact about Paris."}]},
]


@pytest.mark.model
def test_a_replay_shows_the_users_turns_verbatim_in_order_with_the_models_own_replies(tmp_path, smol32) -> None:
    """The agent sees [its system prompt, u_1, b_1, ..., u_i]: the file's user turns verbatim and in
    order, its own earlier replies, never the file's system or assistant turns. Each agent turn is
    scored by its persona's measure; the run reports compliance per turn."""
    from driftlab.bench import Persona, get_persona
    from driftlab.protocol.replay import Replay, draw_replay
    from driftlab.protocol.runner import run_protocol
    from driftlab.records.rundir import RunDir
    from driftlab.report.results import summarize

    datasets.pull_dataset("ifbench")  # IFBench's checkers (CI's install step pulls them)
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in LOGS))
    seen = []
    generate = smol32.generate

    def spy(request):
        seen.extend(request.conversations)
        return generate(request)

    smol32.generate = spy
    try:
        from driftlab.api import backend_spec
        from driftlab.api.options import KEYWORDS, replay_config

        config = replay_config(backend_spec("smollm2-135m", dtype="float32"), KEYWORDS, {
            "conversations": path, "agents": "reply-in-french,ifbench-word-repeats", "rounds": 5,
            "max_new_tokens": 12, "greedy": True})
        assert config.source == "file" and config.n_dialogs() is None
        run_protocol(Replay(config, smol32), tmp_path / "run", progress=False)
    finally:
        smol32.generate = generate
    rd = RunDir(tmp_path / "run")
    records = rd.records()
    manifest = rd.read_manifest()
    turns = {p["pair"]: p["turns"] for p in manifest["pairs"]}
    assert turns == {0: [m["content"] for m in LOGS[0]["messages"] if m["role"] == "user"],
                     1: ["Tell me a fun fact about Paris."]}
    assert [p["source"] for p in manifest["pairs"]] == ["line-1", "short"]
    replies = {(r["pair"], r["round"]): r["text"] for r in records}
    assert sorted(replies) == [(0, 1), (0, 2), (0, 3), (1, 1)] and Replay.expected(manifest) == {"turn": 4, "probe": 0}
    personas = {p.index: p.agent for p in draw_replay(config)}
    for view in seen:  # every conversation the model was asked to continue
        pair = next(k for k, t in turns.items() if view[1]["content"] == t[0])
        i = sum(m["role"] == "user" for m in view)
        assert view[0] == {"role": "system", "content": personas[pair].system_prompt}
        assert [m["content"] for m in view if m["role"] == "user"] == turns[pair][:i]
        assert [m["content"] for m in view if m["role"] == "assistant"] == [replies[(pair, j)] for j in range(1, i)]
        assert "LOGGED" not in json.dumps(view) and "logged bot" not in json.dumps(view)
    assert len(seen) == 4
    agents = {get_persona("reply-in-french").id, "ifbench-word-repeats"}  # a persona, and IFBench's checker
    assert {p["agent"] for p in manifest["pairs"]} == agents
    for r in records:  # each agent turn scored by its persona's own measure
        persona = Persona(**manifest["personas"][manifest["pairs"][r["pair"]]["agent"]])
        assert r["score"] == persona.score(r["text"], truncated=r["finish_reason"] == "length")
        if persona.measure == "ifbench":  # upstream's own strict evaluation of the same turn
            from test_ifbench import _upstream_strict

            assert r["score"] == float(_upstream_strict("words:repeats", {"small_n": 4}, r["text"]))

    from driftlab.protocol.project import recorded_dialogs

    again = recorded_dialogs(tmp_path / "run")  # what `driftlab kl|project|decay --from-run` read again
    assert {d["pair"]: d["a"] for d in again} == {0: turns[0][:3], 1: turns[1]}
    assert all(d["b"] == [replies[(d["pair"], i)] for i in range(1, len(d["a"]) + 1)] for d in again)

    results = summarize(tmp_path / "run")
    per_round = [e for e in results.estimates if e.metric == "compliance"]
    assert [e.group["round"] for e in per_round] == [1, 2, 3] and [e.n for e in per_round] == [2, 1, 1]
    assert any(e.metric == "drift" for e in results.estimates)
    report = CliRunner().invoke(app, ["report", str(tmp_path / "run")])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "run" / "compliance.png").stat().st_size > 5000
    assert "replay run: 4 of 4 records, complete" in report.output
    assert manifest["config"]["sampling"]["max_new_tokens"] == 12


@pytest.fixture(scope="module")
def tiny(tiny_llama, device):
    """A tiny random Llama with SmolLM2's tokenizer, in float32: the gate's bookkeeping needs no language."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_llama), dtype="float32", device=str(device), prefix_cache_bytes=0)


@pytest.mark.model
def test_a_gate_by_score_steers_the_turn_after_a_failing_one(tmp_path, tiny) -> None:
    """`--steer when-drifting:r=0.5,by=score --steer spr:p=1`: an agent turn is generated under SPR exactly where
    its dialog's previous agent turn scored below 0.5, else plain, and its record keeps the decision. On the tiny
    model, whose replies repeat words in some turns and not in others, its agents score repetition: the dialog
    of four turns passes, passes, fails (so its fourth turn and the MMLU questions after it are steered)."""
    from driftlab.api import backend_spec
    from driftlab.api.options import KEYWORDS, replay_config
    from driftlab.protocol.replay import Replay
    from driftlab.protocol.runner import run_protocol
    from driftlab.records.rundir import RunDir
    from driftlab.steering.interventions import Interventions

    logs = [{"messages": [*LOGS[0]["messages"], {"role": "user", "content": "And what for dessert?"}]}, LOGS[1]]
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in logs))
    asked, generate = [], tiny.generate

    def spy(request):
        asked.extend((c[1]["content"], sum(m["role"] == "user" for m in c), request.interventions)
                     for c in request.conversations)
        return generate(request)

    tiny.generate = spy
    try:
        config = replay_config(backend_spec(str(tiny.path), dtype="float32"), KEYWORDS, {
            "conversations": path, "agents": "every-word-twice,never-repeat-words", "rounds": 4, "max_new_tokens": 12,
            "greedy": True, "steer": ["when-drifting:r=0.5,by=score", "spr:p=1"]})
        run_protocol(Replay(config, tiny), tmp_path / "run", progress=False)
    finally:
        tiny.generate = generate
    records = sorted(RunDir(tmp_path / "run").records(), key=lambda r: (r["pair"], r["round"]))
    previous = {}
    for r in records:
        before = previous.get(r["pair"])
        assert r["gate"] == {"r": 0.5, "by": "score", "score": before, "steered": before is not None and before < 0.5}
        previous[r["pair"]] = r["score"]
    steered = {(r["pair"], r["round"]) for r in records if r["gate"]["steered"]}
    assert steered and len(steered) < len(records)  # both halves taken (round 1 never is)
    assert any(r["gate"]["score"] is not None and not r["gate"]["steered"] for r in records)  # plain after a pass
    spr = Interventions.parse(["spr:p=1"])
    for first, users, iv in asked:
        pair = 0 if first == LOGS[0]["messages"][1]["content"] else 1
        assert iv == (spr if (pair, users) in steered else Interventions())
    # a resumed run reads the earlier scores from the records: the last (steered) turn again, the same
    lines = (tmp_path / "run" / "records.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "run" / "records.jsonl").write_text("".join(lines[:-1]))
    run_protocol(Replay(config, tiny), tmp_path / "run", progress=False)
    assert sorted(RunDir(tmp_path / "run").records(), key=lambda r: (r["pair"], r["round"])) == records
    from driftlab.report.results import summarize

    (share,) = [e for e in summarize(tmp_path / "run").estimates if e.metric == "steered"]
    assert (share.value, share.n) == (len(steered) / len(records), len(records))

    # Its MMLU price (`driftlab mmlu --history-from RUN`): questions after the replay's own dialog, steered where
    # the turn before them failed (after b_3, scored 0), and then exactly as always-on SPR scores them.
    from driftlab.api import mmlu

    raw = str(Path(__file__).parent / "fixtures" / "mmlu_raw_sample.jsonl")
    ask = dict(n=2, turn=6, data=raw, history_from=str(tmp_path / "run"), progress=False)
    gated = mmlu(tiny, steer=["when-drifting:r=0.5,by=score", "spr:p=1"], out=tmp_path / "m-gated", **ask).records
    always = mmlu(tiny, steer=["spr:p=1"], out=tmp_path / "m-always", **ask).records
    lp = lambda rs, c: {r["index"]: r["logprobs"] for r in rs if r["condition"] == c}  # noqa: E731
    assert lp(gated, "steered") == lp(always, "steered") != lp(always, "plain") == lp(gated, "plain")
    assert [r["gate"] for r in gated if r["condition"] == "steered"] == [
        {"r": 0.5, "by": "score", "score": records[2]["score"], "steered": True}] * 2
    assert "The gate steered 2 of 2 questions" in CliRunner().invoke(app, ["report", str(tmp_path / "m-gated")]).output
