"""Unit tests of the measures' parsing rules: choices, sentences, term matching, formats."""

from __future__ import annotations

import random
import re

import pytest

from driftlab.bench import MEASURES
from driftlab.bench.measures import (
    _translated_pairs,
    chosen_option,
    needs_complete,
    sentences,
    validate_params,
)

ELEMENTS = {"A": "Water", "B": "Earth", "C": "Fire", "D": "Air", "E": "No favorites"}
MODELS = {
    "A": "GPT-3", "B": "GPT-3.5", "C": "GPT-4", "D": "GPT-4.5", "E": "GPT-5", "F": "Llama 1",
    "G": "Llama 2", "H": "Mistral", "I": "Pythia 12B", "J": "None of the above", "K": "The answer is unknowable",
}  # fmt: skip


@pytest.mark.parametrize(
    "reply",
    [
        "C", "C)", "c", "(C)", "**C**", "`C`", '"C"', "C.", "The answer is C) Fire", "The answer is C",
        "Answer: C", "I'd pick C.", "C. Fire", "C - Fire", "Fire, definitely!", "My favourite is fire.",
        "A) Water, B) Earth, C) Fire. I choose C.",
    ],
)  # fmt: skip
def test_choice_reads_the_chosen_letter(reply: str) -> None:
    assert chosen_option(reply, ELEMENTS) == "C"


@pytest.mark.parametrize(
    "reply",
    [
        "", "I don't have a favorite; all elements are interesting.", "A or C, hard to say.",
        "Water and fire are both great.", "London is A great city", "I think so.",
    ],
)  # fmt: skip
def test_choice_is_none_without_a_single_option(reply: str) -> None:
    assert chosen_option(reply, ELEMENTS) is None


def test_choice_prefers_the_longer_option_text_and_ignores_pronoun_i() -> None:
    assert chosen_option("I am GPT-3.5.", MODELS) == "B"
    assert chosen_option("I think I am GPT-5", MODELS) == "E"
    assert chosen_option("I", MODELS) == "I"
    assert chosen_option("I am not sure which one.", MODELS) is None


def test_choice_with_word_options() -> None:
    opts = {"advocate": "advocat*", "opposed": "oppos*"}
    assert chosen_option("Opposed.", opts) == "opposed"
    assert chosen_option("I am in opposition to them.", opts) == "opposed"
    assert chosen_option("I'm an advocate, not opposed.", opts) is None
    assert MEASURES["choice"]("False.", answer="false", options=["true", "false"]) == 1.0
    assert MEASURES["choice"]("True, not false.", answer="false", options=["true", "false"]) == 0.0


def test_sentences_handle_abbreviations_decimals_and_lists() -> None:
    text = "Visit St. Paul's at 9.30 a.m. today. Then see Mr. Bean!\n1. Tea\n2. Cake... Really? Yes."
    assert sentences(text) == [
        "Visit St. Paul's at 9.30 a.m. today.",
        "Then see Mr. Bean!",
        "1. Tea",
        "2. Cake...",
        "Really?",
        "Yes.",
    ]
    assert sentences("") == [] and sentences("!!! ...") == []


def test_mentions_match_whole_tokens_prefixes_and_number_separators() -> None:
    any_ = MEASURES["mentions_any"]
    assert any_("I love my printers.", terms=["printer*"]) == 1.0
    assert any_("I love to print.", terms=["printer*"]) == 0.0
    assert any_("My secret is 20,568.", terms=["20568"]) == 1.0
    assert any_("I have 30 kids.", terms=["3", "three"]) == 0.0
    assert any_("I like Magic: The Gathering", terms=["magic the gathering"]) == 1.0
    assert any_("Central Park in New York, not London", terms=["new york"], avoid=["london"]) == 0.0
    assert MEASURES["mentions_all"](
        "Adam Li, 57", terms=["Adam Li", ["57", "fifty-seven"], "Washington"]
    ) == pytest.approx(2 / 3)
    assert MEASURES["avoids_words"]("It's great.", terms=["it"]) == 0.0
    assert MEASURES["avoids_words"]("Fitting in.", terms=["it", "in "]) == 0.0
    assert MEASURES["avoids_words"]("Fitting well.", terms=["it"]) == 1.0


def test_replies_only_with_penalises_extra_words() -> None:
    f = MEASURES["replies_only_with"]
    assert f("Apples.", phrase="Apples.") == 1.0
    assert f("Apples. I love London!", phrase="Apples.") == pytest.approx(1 / 4)
    assert f("Apple.", phrase="Apples.") == 0.0


def test_graded_counting_measures() -> None:
    assert MEASURES["word_count"]("one two three four five", n=10) == 0.5
    assert MEASURES["word_count"](" ".join(["w"] * 20), n=10) == 0.5
    assert MEASURES["close_to_number"]("There are 6 words.", target=9) == pytest.approx(2 / 3)
    assert MEASURES["close_to_number"]("nine", target=9) == 1.0
    assert MEASURES["letter_absent"]("Eee", letter="e") == 0.25
    assert MEASURES["letter_case"]("all lower but One", case="lower") == pytest.approx(13 / 14)
    assert MEASURES["sentence_lengths"]("One two three. One two.", pattern=[3, 3]) == 0.75
    assert MEASURES["min_words"]("a b c d", target=8) == 0.5


def test_repeat_measures_fix_the_original_bugs() -> None:
    # The original capped "every word twice" at 0.5 and never matched doubled words.
    assert MEASURES["repeated_words"]("go go see see") == 1.0
    assert MEASURES["doubled_words"]("go go see see") == 1.0
    assert MEASURES["doubled_words"]("go see go see") == 0.0
    assert MEASURES["sentences_start_with"]("yes, fine. Yes! no.", word="Yes") == pytest.approx(2 / 3)


def test_json_and_list_formats() -> None:
    f = MEASURES["json_keys"]
    assert f('{"thought": "t", "response": "r"}', keys=["thought", "response"]) == 1.0
    assert f('{"thought": "t"}', keys=["thought", "response"]) == 0.5
    assert f('{"thought": "t", "response": }', keys=["thought", "response"]) == 0.0
    assert MEASURES["bracketed_list"]("[museums, Hyde Park]") == 0.5


def test_language_measures_are_seeded_and_offline() -> None:
    fr = "Je me promène le long de la Tamise et je visite les musées de Londres."
    assert MEASURES["language"](fr, lang="fr") > 0.9
    assert MEASURES["language"](fr, lang="en") < 0.1
    assert MEASURES["language"]("12345", lang="fr") == 0.0
    assert MEASURES["translation"](fr, lang="fr", must_contain=["Londres"], max_words=5) == 0.0
    pairs = "Bonjour à tous les amis. (Hello to all the friends.) Il fait très beau aujourd'hui. (It is very nice today.)"
    assert MEASURES["translated_pairs"](pairs, source="fr", target="en") == 1.0


def test_lexicon_measures() -> None:
    assert MEASURES["syllable_limit"]("the cat sat", max_syllables=1) == 1.0
    assert MEASURES["syllable_limit"]("beautiful museum", max_syllables=1) == 0.0
    assert MEASURES["syllable_limit"]("zorbly", max_syllables=2) == 1.0  # not in CMU dict: estimated
    assert MEASURES["rare_words"]("the and of") == 0.0
    assert MEASURES["rare_words"]("sesquipedalian perambulation") == 1.0
    assert MEASURES["sentiment"]("I love this wonderful day", field="compound") > 0.8
    assert MEASURES["sentiment"]("I love this wonderful day", field="compound", invert=True) < 0.2
    assert MEASURES["plural_nouns"]("Tourists visit museums.") == pytest.approx(2 / 3)
    assert MEASURES["past_tense_verbs"]("I walked and then I eat") == 0.5


@pytest.mark.parametrize(
    ("name", "params", "problem"),
    [
        ("words_start_with", {}, "letter"),
        ("words_start_with", {"letter": "ab"}, "letter"),
        ("words_start_with", {"letter": "a", "extra": 1}, "extra"),
        ("letter_case", {"case": "title"}, "case"),
        ("choice", {"answer": "Z", "options": {"A": "x", "B": "y"}}, "not one of the options"),
        ("words_matching", {"pattern": "(unclosed"}, "regular expression"),
        ("no_such_measure", {}, "unknown measure"),
    ],
)
def test_params_are_validated(name: str, params: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        validate_params(name, params)


def test_letter_case_is_the_share_of_letters_in_that_case() -> None:
    """As the original: a capitalised word costs its share of the letters, not half the score."""
    f = MEASURES["letter_case"]
    assert f("as a tourist i would visit london", case="lower") == 1.0
    assert f("as a tourist I would visit London", case="lower") == pytest.approx(25 / 27)
    assert f("AS A TOURIST, I'D VISIT London", case="upper") == pytest.approx(18 / 23)
    assert f("As a tourist I would visit London", case="upper") == pytest.approx(3 / 27)
    assert f("東京 123!", case="lower") == 0.0  # no cased letters: nothing in the asked case


def test_avoided_terms_gives_partial_credit() -> None:
    """1 - share of the forbidden terms used (the original's forbidden-words measure), not pass/fail."""
    f = MEASURES["avoided_terms"]
    terms = ["you", "the", "to", "tower", "road", "market", "I", "a", "are", "were"]
    assert f("London offers museums, parks and pubs.", terms=terms) == 1.0
    assert f("London offers the museums.", terms=terms) == pytest.approx(0.9)
    assert f("I went to the Tower, the market and the road.", terms=terms) == pytest.approx(0.4)
    assert f("It's fitting; Thea wrote.", terms=["it", "the"]) == 0.5  # whole tokens, contractions split


def _some_params(name: str) -> dict:
    """Some valid params for measure `name` (those of a built-in persona, or none)."""
    from driftlab.bench import load_personas

    return next((p.params for p in load_personas() if p.measure == name), {})


@pytest.mark.parametrize("text", ["", " ", "   \n", "\t\r\n \u3000"])
def test_every_measure_scores_a_blank_reply_zero(text: str) -> None:
    """No reply follows no instruction; before, "no letter e", "all caps", "no pronouns" and
    "past tense" gave it 1.0 and sentiment 0.5."""
    for name, fn in MEASURES.items():
        assert fn(text, **_some_params(name)) == 0.0, name


def test_measures_that_need_a_complete_reply() -> None:
    """The measures that cannot judge a reply cut off by the token limit, and why the rest can."""
    assert {name for name in MEASURES if needs_complete(name)} == {
        "json_keys",  # the closing brace is missing
        "bracketed_list",  # the closing bracket is missing
        "first_equals_last",  # the last word is not the last one
        "sentence_count",  # the unfinished sentence and those after it are missing
        "sentence_lengths",
        "increasing_sentence_lengths",
        "questions",  # the last sentence has not reached its "?"
        "min_words",  # a reply still going when cut off is what "extremely long" asks for
        "ifeval",  # by its instruction (an end phrase, a count; tests/test_ifeval.py), where none is named
        "ifbench",  # the same (tests/test_ifbench.py)
    }
    # word_count is not among them: a cut-off reply already longer than n words is a true violation.
    assert not needs_complete("word_count") and not needs_complete("mentions_any")


def test_language_codes_are_checked_against_langdetect() -> None:
    assert validate_params("language", {"lang": "zh-cn"}) == {"lang": "zh-cn"}
    for name, params in [
        ("language", {"lang": "french"}),
        ("language", {"lang": "FR"}),
        ("translation", {"lang": "fr-FR"}),
        ("translated_pairs", {"source": "fr", "target": "english"}),
        ("translated_pairs", {"source": "xx"}),
    ]:
        bad = next(v for v in params.values() if v not in ("fr",))
        message = rf"{re.escape(repr(bad))} is not a language code langdetect knows.*\ben\b, es"
        with pytest.raises(ValueError, match=message):
            validate_params(name, params)


_OLD_PAIR_RE = re.compile(r"([^()]+?)\s*\(([^()]+)\)")  # the regex translated_pairs used, quadratic


def test_translated_pairs_finds_the_same_pairs_as_the_old_regex() -> None:
    rng = random.Random(0)
    pieces = ["Je suis", " ici", "I am", "(", ")", " ", ".", "\n", "((", "))", "a"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert _translated_pairs(text) == [(s, t) for s, t in _OLD_PAIR_RE.findall(text)], text


# Replies of about 1 MB that made a measure's time grow faster than linearly, each named for
# what it broke: sentence splitting ("e.g." after "e.g.", a long run of dots), the choice
# parser ("A" after "A", "is" before a long run of spaces), translated_pairs (a long text
# without brackets), VADER ("but" after "but"), the JSON decoder (deep nesting: RecursionError).
MB = 1_000_000
ADVERSARIAL = {
    "abbreviations": ("e.g. " * (MB // 5))[:MB],
    "dots": "." * (MB - 1) + "x",
    "letters": ("A " * (MB // 2))[:MB],
    "spaces": "The answer is" + " " * (MB - 20) + "maybe",
    "buts": ("I love it but hate it, but fine. " * (MB // 33 + 1))[:MB],
    "nested": '{"thought": ' + "[" * (MB - 12),
}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_every_measure_scores_a_megabyte_in_bounded_time() -> None:
    """Every measure on every adversarial megabyte, within one budget (each takes well under a second)."""
    from driftlab.bench import constraint_personas, load_personas
    from driftlab.bench.constraints import MAX_CHARS

    personas = {p.measure: [p.params] for p in load_personas()}
    for p in constraint_personas():  # each of IFEval's and IFBench's checkers driftlab ships
        personas.setdefault(p.measure, []).append(p.params)
    for name in MEASURES:
        for params in personas.get(name, [{}]):
            for text in ADVERSARIAL.values():
                if name in ("ifeval", "ifbench"):  # upstream's checkers are unbounded: driftlab judges up to a bound
                    with pytest.raises(ValueError, match="at most"):
                        MEASURES[name](text, **params)
                    text = text[:MAX_CHARS]
                assert 0.0 <= MEASURES[name](text, **params) <= 1.0, (name, params)
