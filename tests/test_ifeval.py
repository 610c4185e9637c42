"""IFEval's instructions as standing system prompts (`driftlab.bench.ifeval`), scored by upstream's checkers.

What is checked against lm-eval's own IFEval code (`lm_eval.tasks.ifeval`): the instruction ids, each
constraint persona's prompt (upstream's description), and every score, on real model replies (the
committed replay study's) and on written ones, equal to lm-eval's strict scoring of the same response.
The real-model path (a replay whose agent has an IFEval constraint) is tests/test_replay.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from driftlab.bench import MEASURES, Persona, ifeval_constraints, load_personas
from driftlab.bench import ifeval as ife
from driftlab.errors import DriftlabError

REPO = Path(__file__).resolve().parent.parent
WRITTEN = [
    "hello there. this is all lowercase and has no commas",
    "HELLO THERE. THIS IS ALL CAPITALS, WITH A COMMA.",
    "<<London for a day>>\n\nStart at the *British Museum*, then walk to *Covent Garden*.",
    "Dear [name], meet me at [address].\n\nP.S. Bring an umbrella.",
    '"Wrapped in quotes, as asked."',
    '```json\n{"answer": "yes", "why": "because"}\n```',
    "* one\n* two\n* three",
    "* one\n* two",
    "Ich antworte immer auf Deutsch, wie gewünscht. London ist eine schöne Stadt.",
    "A short answer. Is there anything else I can help with?",
    "word " * 120,
]


def _replies() -> list[str]:
    """Real replies: the committed replay study's agent turns (qwen2.5-coder-1.5b on ShareGPT turns)."""
    path = REPO / "docs" / "results" / "replay-qwen-plain" / "records.jsonl"
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def _upstream_strict(instruction: str, kwargs: dict, response: str) -> bool:
    """lm-eval's own scoring of one response to one instruction (`test_instruction_following_strict`)."""
    from lm_eval.tasks.ifeval import utils

    example = utils.InputExample(key=0, instruction_id_list=[instruction], prompt="What do you do in London?",
                                 kwargs=[kwargs])
    with ife.seeded_langdetect():  # (upstream's language checks draw at random unless seeded)
        return utils.test_instruction_following_strict(example, response).follow_instruction_list[0]


def test_the_instruction_ids_are_upstreams() -> None:
    assert set(ife.INSTRUCTIONS) == set(ife.registry())


def test_each_constraint_prompt_is_upstreams_description_for_every_reply() -> None:
    constraints = ifeval_constraints()
    assert len(constraints) >= 10 and {p.category for p in constraints} == {"ifeval"}
    for p in constraints:
        expected = ife.standing_instruction(ife.description(p.params["instruction"], p.params["kwargs"]))
        assert p.system_prompt == expected, p.id
    assert [p.id for p in load_personas("ifeval")] == [p.id for p in constraints]
    assert not {p.id for p in load_personas()} & {p.id for p in constraints}  # the 100's draw stays as it was


def test_every_constraint_scores_as_lm_evals_strict_ifeval() -> None:
    """The measure is upstream's verdict as 0/1, on a third of the committed replay study's replies (every third:
    200, of every persona) and on written ones that pass and fail each constraint; each constraint both passes and
    fails somewhere."""
    texts = _replies()[::3] + WRITTEN
    for p in ifeval_constraints():
        ours = [MEASURES["ifeval"](t, **p.params) for t in texts]
        theirs = [float(_upstream_strict(p.params["instruction"], p.params["kwargs"], t)) for t in texts]
        assert ours == theirs, p.id
        assert set(ours) == {0.0, 1.0}, p.id


# Replies of the replay study whose English verdict, lowercased, depends on langdetect's seed (of 600, found
# by trying seeds 0-7; the test below checks that each still does).
BORDERLINE = (32, 45, 54, 103, 135, 320, 352, 504)


def test_a_verdict_is_a_function_of_the_text_whatever_langdetect_was_seeded_with() -> None:
    """Upstream's English check draws n-grams at random: unseeded, a borderline reply flips between calls."""
    from langdetect import DetectorFactory, detect

    lowercase = next(p for p in ifeval_constraints() if p.id == "ifeval-lowercase")
    replies = _replies()
    texts = [replies[i].lower() for i in BORDERLINE]
    before = DetectorFactory.seed
    try:
        for text in texts:  # each is borderline: some seeds call it English, others not
            verdicts = set()
            for seed in range(8):
                DetectorFactory.seed = seed
                verdicts.add(detect(text) == "en")
            assert verdicts == {True, False}, text[:80]
        DetectorFactory.seed = before
        first = [lowercase.score(t) for t in texts]
        for seed in (None, 7, 3):
            DetectorFactory.seed = seed
            assert [lowercase.score(t) for t in texts] == first
            assert DetectorFactory.seed == seed  # left as it was
    finally:
        DetectorFactory.seed = before


def test_a_cut_off_reply_scores_none_where_only_a_whole_reply_can_tell() -> None:
    by_id = {p.id: p for p in ifeval_constraints()}
    assert by_id["ifeval-end-phrase"].score("The answer is", truncated=True) is None
    assert by_id["ifeval-json"].needs_complete and by_id["ifeval-postscript"].needs_complete
    assert by_id["ifeval-no-comma"].score("one, two", truncated=True) == 0.0  # a comma stays a comma
    assert not by_id["ifeval-lowercase"].needs_complete


@pytest.mark.parametrize("params,match", [
    ({"instruction": "length_constraints:number_sentences"}, "punkt"),
    ({"instruction": "combination:repeat_prompt"}, "not a standing instruction"),
    ({"instruction": "punctuation:no_commas"}, "unknown IFEval instruction"),
])
def test_an_instruction_driftlab_cannot_check_is_refused_in_one_line(params, match) -> None:
    with pytest.raises(ValueError, match=match):
        Persona(system_prompt="Obey.", probe="Hi?", measure="ifeval", params=params)


def test_a_constraint_without_its_arguments_is_refused_before_any_work() -> None:
    """Upstream draws a missing argument at random: a persona must name every one, said at once."""
    persona = Persona(system_prompt="End every reply with a phrase.", probe="Hi?", measure="ifeval",
                      params={"instruction": "startend:end_checker"})
    with pytest.raises(DriftlabError, match="end_phrase"):
        ife.ready([persona])


@pytest.mark.process  # a fresh interpreter
def test_importing_the_checkers_downloads_nothing() -> None:
    """lm-eval downloads nltk's punkt_tab at import where it is missing (on rank 0); driftlab's import does not try."""
    code = "from driftlab.bench import ifeval; ifeval.registry(); import os; print(os.environ.get('LOCAL_RANK'))"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "nltk_data" not in out.stderr + out.stdout and out.stdout.strip() == "None"
