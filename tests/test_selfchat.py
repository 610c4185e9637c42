"""The self-chat protocol: who sees what, probes stay out of the dialog, runs resume exactly
(kill -9 mid-run: tests/test_resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driftlab.bench import get_persona
from driftlab.chat import BackendSpec, Sampling
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import FOLD_TEMPLATE, RECORDS, Dialog, Pair
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig, item_seed
from driftlab.records.rundir import RunDir
from fakes import ScriptedBackend


def _dialog(condition: str = "persona") -> Dialog:
    pair = Pair(0, get_persona("reply-in-french"), get_persona("very-happy"), "Is coffee good for you?")
    return Dialog(pair, condition, a={1: "Is coffee good for you?", 2: "a2", 3: "a3"}, b={1: "b1", 2: "b2"})


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
    assert ablated[0] == {"role": "system", "content": ""}  # the ablation empties s_A (paper), keeps the turn
    assert all(m["role"] != "system" for m in ablated[1:])


def test_empty_user_prompt_keeps_qwens_default_system_prompt_out(smol_dir):
    """Qwen's template inserts "You are Qwen, ..." when there is no system message; an empty one stops it."""
    from transformers import AutoTokenizer

    from driftlab.chat.templates import Renderer

    tok = AutoTokenizer.from_pretrained(smol_dir)  # any tokenizer; the template is Qwen2.5's, vendored
    tok.chat_template = (Path(__file__).parent / "fixtures" / "qwen2.5_chat_template.jinja").read_text()
    renderer = Renderer(tok)
    ablated = renderer.text(_dialog("empty-user").user_view(2, fold=True))
    assert "You are Qwen" not in ablated and ablated.startswith("<|im_start|>system\n<|im_end|>")
    assert "You are Qwen" in renderer.text(_dialog("empty-user").user_view(2, fold=True)[1:])  # the old behaviour


def test_cfg_unconditional_rows_keep_an_empty_system_message_under_qwens_template(smol_dir):
    """CFG contrasts the persona with no instruction, not with Qwen's default persona: its
    unconditional conversation empties the system prompt (as the ablation does) and drops SPR's
    repeated copies; rendered with Qwen2.5's real template, no "You are Qwen" appears."""
    from transformers import AutoTokenizer

    from driftlab.chat.base import without_system
    from driftlab.chat.templates import Renderer
    from driftlab.steering import Interventions

    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.chat_template = (Path(__file__).parent / "fixtures" / "qwen2.5_chat_template.jinja").read_text()
    renderer = Renderer(tok)
    conv = Interventions.parse(["spr:p=1"]).model_view(_dialog().agent_view(3, "a3"))
    assert sum(m["role"] == "system" for m in conv) == 3  # s_B and SPR's copies before user turns 2 and 3
    uncond = without_system(conv)
    assert uncond[0] == {"role": "system", "content": ""} and all(m["role"] != "system" for m in uncond[1:])
    assert uncond[1:] == [m for m in conv if m["role"] != "system"]
    text = renderer.text(uncond)
    assert "You are Qwen" not in text and text.startswith("<|im_start|>system\n<|im_end|>")
    assert _dialog().pair.agent.system_prompt not in text
    assert "You are Qwen" in renderer.text([m for m in conv if m["role"] != "system"])  # the old behaviour
    no_system = [{"role": "user", "content": "hi"}]
    assert without_system(no_system) == no_system  # nothing to remove: the same as the conditional row


def test_item_seeds_are_stable_and_distinct():
    assert item_seed(0, 1, "persona", 2, "agent") == item_seed(0, 1, "persona", 2, "agent")
    seeds = {item_seed(0, p, c, r, w) for p in range(5) for c in ("persona", "empty-user")
             for r in range(1, 9) for w in ("user", "agent")}
    assert len(seeds) == 5 * 2 * 8 * 2
    assert all(0 <= s < 2**63 for s in seeds)


def _keys(records):
    return [r.key for r in records]


def _scripted_run(path, model=None, **overrides) -> list:
    cfg = SelfChatConfig(**{"pairs": 2, "rounds": 3, "user_probe": True, "probe_repeats": 2, "seed": 3,
                            "ablation": True, "probe_after": "user", **overrides})
    run_protocol(SelfChat(cfg, model or ScriptedBackend()), path, progress=False)
    return RunDir(path).records(RECORDS)


def test_scripted_run_has_every_record_once_and_each_turn_sees_its_dialog(tmp_path):
    backend = ScriptedBackend()
    records = _scripted_run(tmp_path / "run", backend)
    manifest = RunDir(tmp_path / "run").read_manifest()
    assert len(records) == sum(SelfChat.expected(manifest).values()) == len(set(_keys(records)))
    # Rebuild the dialogs from the records and check every agent turn was generated from
    # exactly [s_B, a_1, b_1, ..., a_i] (the scripted reply is a hash of what it was shown).
    from driftlab.protocol.dialog import pairs_from_manifest
    from fakes import scripted_text

    dialogs = Dialog.from_records(pairs_from_manifest(manifest), manifest["conditions"], records)
    for r in records:
        d = next(x for x in dialogs if (x.pair.index, x.condition) == (r.pair, r.condition))
        if r.kind == "turn" and r.speaker == "agent":
            assert r.text == scripted_text(d.agent_view(r.round, d.a[r.round]), r.seed)
        elif r.kind == "turn":
            assert r.text == scripted_text(d.user_view(r.round, True), r.seed)
        else:
            probe = d.pair.agent.probe if r.target == "agent" else d.pair.user.probe
            assert r.text == scripted_text(d.agent_view(r.round, probe), r.seed)
            assert r.score == pytest.approx(get_persona(r.persona).score(r.text))


def test_probe_after_agent_sees_the_exchange_of_its_round_as_the_reference_code_does(tmp_path):
    """--probe-after agent (likenneth/persona_drift): the probe of round i follows b_i, so it sees
    [s_B, a_1, b_1, ..., a_i, b_i, p_B]; it runs with b_{i+1} (same prefix), the last round's after
    the dialog. The dialog itself is the same as with the default, and so is every seed."""
    from driftlab.protocol.dialog import pairs_from_manifest
    from fakes import scripted_text

    backend = ScriptedBackend()
    records = _scripted_run(tmp_path / "agent", backend, probe_after="agent")
    manifest = RunDir(tmp_path / "agent").read_manifest()
    assert manifest["config"]["probe_after"] == "agent"  # recorded
    assert len(records) == sum(SelfChat.expected(manifest).values()) == len(set(_keys(records)))
    dialogs = Dialog.from_records(pairs_from_manifest(manifest), manifest["conditions"], records)
    probes = [r for r in records if r.kind == "probe"]
    assert {r.round for r in probes} == {1, 2, 3}
    for r in probes:
        d = next(x for x in dialogs if (x.pair.index, x.condition) == (r.pair, r.condition))
        probe = d.pair.agent.probe if r.target == "agent" else d.pair.user.probe
        shown = d.agent_view(r.round + 1, probe)
        assert shown[-3:-1] == [{"role": "user", "content": d.a[r.round]}, {"role": "assistant", "content": d.b[r.round]}]
        assert r.text == scripted_text(shown, r.seed)
    # Probes of round i share the batch of b_{i+1} (their common prefix); the last round's come alone.
    probe_texts = {d.pair.agent.probe for d in dialogs} | {d.pair.user.probe for d in dialogs}
    for request in backend.requests:
        rows = request.conversations
        is_probe = [c[-1]["content"] in probe_texts and c[-1]["role"] == "user" for c in rows]
        prefixes = {repr(c[:-1]) for c, p in zip(rows, is_probe, strict=True) if not p}
        if any(is_probe) and prefixes:
            assert all(repr(c[:-1]) in prefixes for c, p in zip(rows, is_probe, strict=True) if p)
    last = backend.requests[-1].conversations
    assert all(len(c) == 1 + 2 * 3 + 1 for c in last)  # the final batch: round 3's probes, after b_3
    default = _scripted_run(tmp_path / "user")
    turns = lambda rs: sorted(r.model_dump_json() for r in rs if r.kind == "turn")  # noqa: E731
    assert turns(records) == turns(default)  # the dialogs do not depend on where the probes go
    # The default is the reference code's placement, which produced the paper's figures.
    assert SelfChatConfig().probe_after == "agent"


def test_a_run_recorded_before_probe_after_is_not_resumed_with_a_new_meaning(tmp_path):
    """Before the option, every probe replaced a_i: resuming such a run under today's default
    (after b_i) is refused in one line naming the setting; with probe_after "user" it resumes."""
    old = SelfChatConfig(pairs=1, probe_after="user").model_dump(mode="json")
    del old["probe_after"]  # as driftlab wrote it before the option
    rd = RunDir(tmp_path / "run")
    with rd.writing():
        rd.start(old, {}, protocol="selfchat")
        with pytest.raises(DriftlabError, match=r"probe_after: 'user' \(recorded before the option existed\) "
                                                r"-> 'agent'"):
            rd.start(SelfChatConfig(pairs=1).model_dump(mode="json"), {}, protocol="selfchat",
                     legacy=SelfChatConfig.LEGACY)
        resumed = SelfChatConfig(pairs=1, probe_after="user").model_dump(mode="json")
        assert rd.start(resumed, {}, protocol="selfchat", legacy=SelfChatConfig.LEGACY)["config"] == old


def test_probe_after_agent_resumes_exactly(tmp_path):
    full = _scripted_run(tmp_path / "full", probe_after="agent")
    run = tmp_path / "cut"
    _scripted_run(run, probe_after="agent")
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    gone = [i for i, line in enumerate(lines) if '"kind": "probe"' in line and '"round": 3' in line][:2]
    gone.append(next(i for i, line in enumerate(lines) if '"round": 2' in line and '"speaker": "agent"' in line))
    (run / "records.jsonl").write_text("".join(line for i, line in enumerate(lines) if i not in gone))
    resumed = _scripted_run(run, probe_after="agent")
    assert sorted(r.model_dump_json() for r in resumed) == sorted(r.model_dump_json() for r in full)


def test_probe_replies_never_enter_the_dialog(tmp_path):
    backend = ScriptedBackend()
    records = _scripted_run(tmp_path / "run", backend)
    probes = {r.text for r in records if r.kind == "probe"}
    assert probes and not probes & {r.text for r in records if r.kind == "turn"}
    for conv, _ in backend.seen:
        assert not {m["content"] for m in conv} & probes, "a probe reply leaked into a later context"


def test_resume_recomputes_exactly_a_missing_middle_record(tmp_path):
    full = _scripted_run(tmp_path / "full")
    run = tmp_path / "cut"
    _scripted_run(run)
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    victim = next(i for i, line in enumerate(lines) if '"round": 1' in line and '"speaker": "agent"' in line)
    (run / "records.jsonl").write_text("".join(lines[:victim] + lines[victim + 1 :]))
    backend = ScriptedBackend()
    resumed = _scripted_run(run, backend)
    assert sorted(_keys(resumed)) == sorted(_keys(full))  # nothing missing, nothing twice
    assert sorted(r.model_dump_json() for r in resumed) == sorted(r.model_dump_json() for r in full)
    assert sum(len(r.conversations) for r in backend.requests) == 1  # only the missing record


def test_resume_continues_the_recorded_plan_when_personas_change(tmp_path):
    personas = tmp_path / "mine.jsonl"
    entry = {"id": "say-hi", "category": "pattern", "system_prompt": "Always start with Hi.",
             "probe": "Who are you?", "measure": "starts_with_word", "params": {"word": "Hi"}}
    personas.write_text(json.dumps(entry) + "\n")
    cfg = {"pairs": 0, "pair_ids": [("say-hi", "very-happy")], "rounds": 3, "persona_file": str(personas)}
    run = tmp_path / "run"
    _scripted_run(run, **cfg)
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(lines[:3]))  # interrupted after round 1
    personas.write_text(json.dumps({**entry, "system_prompt": "Always start with Ho."}) + "\n")
    backend = ScriptedBackend()
    _scripted_run(run, backend, **cfg)
    shown = {m["content"] for conv, _ in backend.seen for m in conv if m["role"] == "system"}
    assert "Always start with Hi." in shown and "Always start with Ho." not in shown


def test_resume_refuses_a_different_config_but_not_a_different_batch_size(tmp_path):
    _scripted_run(tmp_path / "run", rounds=2)
    with pytest.raises(DriftlabError, match=r"different configuration.*temperature"):
        _scripted_run(tmp_path / "run", rounds=2, sampling=Sampling(temperature=0.7))
    _scripted_run(tmp_path / "run", rounds=2, batch_size=1, backend=BackendSpec(device="cpu"))


def test_unsupported_intervention_is_refused_before_anything_is_written(tmp_path):
    remote = ScriptedBackend("remote", interventions=frozenset())
    cfg = SelfChatConfig(pairs=1, rounds=2, steer=["split-softmax:k=0.9"])
    with pytest.raises(DriftlabError, match="remote cannot apply --steer split-softmax"):
        run_protocol(SelfChat(cfg, remote), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_steer_specs_are_stored_normalised(tmp_path):
    cfg = SelfChatConfig(pairs=1, rounds=1, steer=["trace", "Split-Softmax: k = 0.90"])
    assert cfg.steer.specs() == ["split-softmax:k=0.9,heads=all", "trace:prefill=false"]
    assert cfg.model_dump(mode="json")["steer"] == cfg.steer.specs()  # what the manifest records
    assert SelfChatConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # and reads back


def test_a_failure_before_the_manifest_leaves_no_directory(tmp_path):
    with pytest.raises(DriftlabError, match="no-such-model"):
        config = SelfChatConfig(backend=BackendSpec(model="no-such-model"), pairs=1, rounds=1)
        run_protocol(SelfChat(config), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_spr_copies_are_seen_by_the_agent_only(tmp_path):
    backend = ScriptedBackend()
    records = _scripted_run(tmp_path / "run", backend, steer=["spr:p=1"], ablation=False)
    agent_rows = [(c, r) for r in backend.requests if r.interventions for c in r.conversations]
    user_rows = [c for r in backend.requests if not r.interventions for c in r.conversations]
    assert agent_rows and user_rows
    for conv, request in agent_rows:  # the protocol hands over the dialog; the backend shows the copies
        view = request.interventions.model_view(conv)
        n_user = sum(m["role"] == "user" for m in conv)
        assert sum(m["role"] == "system" for m in view) == n_user  # the original + one per later turn
    for conv in user_rows:
        assert sum(m["role"] == "system" for m in conv) <= 1  # the user LM never sees s_B repeated
    assert len(records) == len({r.key for r in records})


def test_a_probe_cut_at_the_token_limit_is_unscored_only_where_its_measure_needs_the_whole_reply(tmp_path):
    cfg = SelfChatConfig(pair_ids=[("json-thought-response", "reply-in-french"),
                                   ("reply-in-french", "json-thought-response")], pairs=0, rounds=1)
    assert get_persona("json-thought-response").needs_complete and not get_persona("reply-in-french").needs_complete
    for reason in ("stop", "length"):
        run_protocol(SelfChat(cfg, ScriptedBackend(finish_reason=reason)), tmp_path / reason, progress=False)
        probes = {r.persona: r for r in RunDir(tmp_path / reason).records(RECORDS) if r.kind == "probe"}
        assert probes["reply-in-french"].score is not None  # language can be judged from a cut reply
        assert (probes["json-thought-response"].score is None) == (reason == "length")
        assert probes["json-thought-response"].finish_reason == reason


def test_user_probe_version_crafted_or_generic_asks_the_instruction_stability_papers_crafted_probe(tmp_path):
    from driftlab.bench import user_probe

    crafted = user_probe(get_persona("very-happy"), "crafted-or-generic").probe
    assert crafted != get_persona("very-happy").probe
    for version, expected in (("own", get_persona("very-happy").probe), ("crafted-or-generic", crafted)):
        backend = ScriptedBackend()
        cfg = SelfChatConfig(pair_ids=[("reply-in-french", "very-happy")], pairs=0, rounds=1, user_probe=True,
                             user_probe_version=version)
        run_protocol(SelfChat(cfg, backend), tmp_path / version, progress=False)
        asked = [c[-1]["content"] for r in backend.requests for c in r.conversations]
        assert expected in asked and (crafted in asked) == (version == "crafted-or-generic")


def test_user_probe_version_old_names_validate_to_todays():
    """'000' and '001' (what earlier versions recorded) are read as 'own' and 'crafted-or-generic'."""
    assert SelfChatConfig().user_probe_version == "own"
    for old, new in (("000", "own"), ("001", "crafted-or-generic")):
        cfg = SelfChatConfig(user_probe_version=old)
        assert cfg.user_probe_version == new and cfg.model_dump(mode="json")["user_probe_version"] == new
        assert SelfChatConfig.model_validate_json(json.dumps({"user_probe_version": old})).user_probe_version == new
    with pytest.raises(ValueError, match="'own' or 'crafted-or-generic'"):
        SelfChatConfig(user_probe_version="002")


RECORDED = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_a_run_recorded_with_user_probe_version_000_resumes_as_own(tmp_path):
    """A committed run recorded "000": its config reads as today's ("own"), a resume under today's
    name continues it (nothing to redo, the manifest untouched), and another version is refused."""
    import shutil

    from driftlab.protocol.runner import config_of

    run = tmp_path / "run"
    run.mkdir()
    for name in ("manifest.json", "records.jsonl"):
        shutil.copy(RECORDED / "qwen-paper-20" / name, run / name)
    recorded = json.loads((run / "manifest.json").read_text())
    assert recorded["config"]["user_probe_version"] == "000"
    config = {**SelfChatConfig.LEGACY, **config_of(recorded)}  # options added since: as the run meant them
    assert config["user_probe_version"] == "own"
    cfg = SelfChatConfig.model_validate(config)
    assert cfg.user_probe_version == "own"
    assert SelfChatConfig.model_validate({**SelfChatConfig.LEGACY, **recorded["config"]}) == cfg  # raw: the same
    dtype = recorded["models"]["agent"]["dtype"]
    backend = ScriptedBackend()
    backend.describe = lambda: {**ScriptedBackend.describe(backend), "dtype": dtype}  # the recorded one
    run_protocol(SelfChat(cfg, backend), run, progress=False)
    assert backend.requests == []  # a complete run: nothing regenerated
    assert json.loads((run / "manifest.json").read_text())["config"] == recorded["config"]  # still "000"
    other = cfg.model_copy(update={"user_probe_version": "crafted-or-generic"})
    with pytest.raises(DriftlabError, match="user_probe_version: '000' -> 'crafted-or-generic'"):
        run_protocol(SelfChat(other, backend), run, progress=False)


def test_a_run_recorded_with_000_resumes_mid_run(tmp_path):
    """Cut a fresh run short, rewrite its manifest as an older driftlab wrote it ("000"): resumed
    under today's name it finishes with exactly the records of an uninterrupted run."""
    kw = dict(pair_ids=[("reply-in-french", "very-happy")], pairs=0, rounds=2, user_probe=True)
    full = tmp_path / "full"
    run_protocol(SelfChat(SelfChatConfig(**kw), ScriptedBackend()), full, progress=False)
    cut = tmp_path / "cut"
    run_protocol(SelfChat(SelfChatConfig(**kw), ScriptedBackend()), cut, progress=False)
    lines = (cut / "records.jsonl").read_text().splitlines(keepends=True)
    (cut / "records.jsonl").write_text("".join(lines[: len(lines) // 2]))
    manifest = json.loads((cut / "manifest.json").read_text())
    manifest["config"]["user_probe_version"] = "000"
    manifest["completed"] = False
    (cut / "manifest.json").write_text(json.dumps(manifest))
    run_protocol(SelfChat(SelfChatConfig(**kw, user_probe_version="own"), ScriptedBackend()), cut, progress=False)
    assert sorted((cut / "records.jsonl").read_text().splitlines()) == \
        sorted((full / "records.jsonl").read_text().splitlines())


def test_a_sweep_point_recorded_with_000_is_not_stale():
    """A sweep compares each recorded point with what it would write now ("own"): the old name is no
    difference, so resuming a recorded sweep keeps its points instead of running them again."""
    from driftlab.protocol.sweep import point_differences

    recorded = json.loads((RECORDED / "sweep-ref-20" / "points" / "plain" / "selfchat" / "manifest.json").read_text())
    assert recorded["config"]["user_probe_version"] == "000"
    now = {**recorded, "config": {**recorded["config"], "user_probe_version": "own"}}
    assert point_differences(recorded, now, "selfchat") == []
    other = {**recorded, "config": {**recorded["config"], "user_probe_version": "crafted-or-generic"}}
    assert point_differences(recorded, other, "selfchat") == [
        "config.user_probe_version: 'own' -> 'crafted-or-generic'"]


def test_starter_sets(tmp_path):
    from driftlab.bench import STARTER_SETS
    from driftlab.protocol.selfchat import draw_pairs

    for name in ("reference", "driftlab"):
        pairs = draw_pairs(SelfChatConfig(pairs=6, starters=name))
        assert all(p.starter in STARTER_SETS[name] for p in pairs)
    assert SelfChatConfig().starters == "reference"  # the reference code's topics, by default


def test_the_report_shows_the_user_probe_that_was_asked(tmp_path):
    from driftlab.bench import user_probe
    from driftlab.report.html import transcripts
    from driftlab.report.metrics import summarize_run

    crafted = user_probe(get_persona("very-happy"), "crafted-or-generic").probe
    cfg = SelfChatConfig(pair_ids=[("reply-in-french", "very-happy")], pairs=0, rounds=1, user_probe=True,
                         user_probe_version="crafted-or-generic")
    run_protocol(SelfChat(cfg, ScriptedBackend()), tmp_path / "run", progress=False)
    [conv] = transcripts(summarize_run(tmp_path / "run"))
    asked = {b["target"]: b["question"] for b in conv["rounds"][0]["probes"]}
    assert asked["user"] == crafted and asked["agent"] == get_persona("reply-in-french").probe


def test_probes_get_their_own_token_budget_and_turn_keeps_one_call(tmp_path):
    """--probe-tokens: probe replies decode with their budget, dialog turns with --max-new-tokens;
    'turn' (runs recorded before the option) sends turns and probes in one call with the turn's."""
    backend = ScriptedBackend()
    cfg = SelfChatConfig(pairs=2, rounds=2, seed=3, sampling=Sampling(max_new_tokens=20), probe_tokens=7)
    run_protocol(SelfChat(cfg, backend), tmp_path / "own", progress=False)
    rows = {budget: sum(len(r.conversations) for r in backend.requests if r.sampling.max_new_tokens == budget)
            for budget in (7, 20)}
    assert rows == {7: 2 * 2, 20: 2 * 3}  # 2 pairs x 2 probes with the probe budget; 3 turns each with the turn's
    old = ScriptedBackend()
    run_protocol(SelfChat(cfg.model_copy(update={"probe_tokens": "turn"}), old), tmp_path / "turn", progress=False)
    assert {r.sampling.max_new_tokens for r in old.requests} == {20}
    assert len(old.requests) < len(backend.requests)  # probes share their turn's call
    with pytest.raises(ValueError, match="1 to 32768, or 'turn'"):
        SelfChatConfig(probe_tokens=0)
    assert SelfChatConfig(sampling=Sampling(max_new_tokens=48)).probe_tokens == 400  # the reference code's
    # A probe budget equal to the turn's is "turn", as recorded before the option: such runs resume unchanged.
    assert SelfChatConfig().probe_tokens == "turn" and SelfChatConfig.LEGACY["probe_tokens"] == "turn"
    assert SelfChatConfig(sampling=Sampling(max_new_tokens=48), probe_tokens=48).probe_tokens == "turn"


def test_calls_are_as_few_as_the_batch_size_allows_and_as_even_as_possible(tmp_path):
    """A round's jobs go out in the fewest calls of at most batch_size rows, their sizes within one
    of each other, turns and probes apart when their budgets differ: 10 pairs at batch 4 are calls
    of 3-4 rows, never a tail of 2 (a compiled loop would compile another batch bucket for it), and
    never a call that mixes turns and probes (run_unit would split it into two smaller calls)."""
    backend = ScriptedBackend()
    cfg = SelfChatConfig(pairs=10, rounds=2, seed=3, batch_size=4, sampling=Sampling(max_new_tokens=20), probe_tokens=7)
    run_protocol(SelfChat(cfg, backend), tmp_path / "own", progress=False)
    sizes = [len(r.conversations) for r in backend.requests]
    # agent turns of round 1; user turns, agent turns and round 1's probes (probes go with the next
    # agent turn: probe_after="agent"); round 2's probes: 10 jobs each
    assert sizes == [3, 3, 4] * 5, sizes
    assert all(len({r.sampling.max_new_tokens}) == 1 for r in backend.requests)
    mixed = ScriptedBackend()  # one budget: round 2's agent turns and round 1's probes share 5 calls of 4
    run_protocol(SelfChat(cfg.model_copy(update={"probe_tokens": "turn"}), mixed), tmp_path / "turn", progress=False)
    assert [len(r.conversations) for r in mixed.requests] == [3, 3, 4] * 2 + [4] * 5 + [3, 3, 4]


class _Described(ScriptedBackend):
    """A scripted backend that says it computes in `dtype` (as a local model's describe() does)."""

    def __init__(self, dtype: str) -> None:
        super().__init__()
        self.dtype = dtype

    def describe(self):
        return {**super().describe(), "dtype": self.dtype}


def test_a_resume_computes_in_the_dtype_the_run_was_computed_in(tmp_path):
    """--dtype auto resolves by machine (bf16 with native bf16, float32 elsewhere): a run begun in
    bf16 is not continued in float32, and `--dtype bfloat16` resumes a run begun as auto -> bf16."""
    cfg = SelfChatConfig(pairs=1, rounds=2, sampling=Sampling(max_new_tokens=8))
    out = tmp_path / "run"
    run_protocol(SelfChat(cfg.model_copy(update={"rounds": 1}), _Described("bfloat16")), out, progress=False)
    with pytest.raises(DriftlabError, match="computed in bfloat16, and this resume would compute in float32"):
        run_protocol(SelfChat(cfg.model_copy(update={"rounds": 1}), _Described("float32")), out, progress=False)
    explicit = cfg.model_copy(update={"rounds": 1, "backend": BackendSpec(dtype="bfloat16")})
    run_protocol(SelfChat(explicit, _Described("bfloat16")), out, progress=False)  # the same dtype: resumes
    assert json.loads((out / "manifest.json").read_text())["config"]["backend"]["dtype"] == "auto"  # as recorded
    with pytest.raises(DriftlabError, match="dtype: 'auto' -> 'float16'"):
        run_protocol(SelfChat(cfg.model_copy(update={"rounds": 1, "backend": BackendSpec(dtype="float16")}),
                              _Described("float16")), out, progress=False)


def test_drift_pushing_users_are_drawn_as_users_only_each_with_its_source_and_the_default_draw_is_unchanged(
        tmp_path):
    """--users drift-pushing draws every user from the shipped set (the Assistant Axis paper's drift kinds and
    role-play), never an agent; the default run draws and hashes exactly the 100 personas, as before the set."""
    from driftlab.bench import drift_users, load_personas
    from driftlab.bench.personas import drift_user_sources
    from driftlab.protocol.selfchat import digest, draw_pairs, input_hashes

    users = {p.id for p in drift_users()}
    sources = drift_user_sources()
    assert len(users) == 5 and set(sources) == users and all(s["source"] for s in sources.values())
    assert not users & {p.id for p in load_personas()}
    pushed = draw_pairs(SelfChatConfig(pairs=40, seed=1, users="drift-pushing"))
    assert {p.user.id for p in pushed} == users and not {p.agent.id for p in pushed} & users
    plain = SelfChatConfig(pairs=40, seed=1)
    assert {p.user.id for p in draw_pairs(plain)} <= {p.id for p in load_personas()}
    assert input_hashes(plain)["personas"] == digest([p.model_dump() for p in load_personas()])
    records = _scripted_run(tmp_path / "run", users="drift-pushing", ablation=False)
    asked = {r.persona for r in records if r.kind == "probe" and r.target == "user"}
    assert asked and asked <= users  # --user-probe asks each drift-pushing user's own probe


def test_the_equilibrium_of_a_run_without_kls_is_one_line(tmp_path):
    from driftlab.report.equilibrium import turns

    _scripted_run(tmp_path / "run")
    with pytest.raises(DriftlabError, match="has no reminded KL to fit"):
        turns(tmp_path / "run")
