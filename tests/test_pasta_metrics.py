"""PASTA's evaluation metrics (driftlab.pasta.metrics): positive and negative cases for each.

Pure CPU, no model; the comparisons with NLTK and pastalib run only where those are importable.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from driftlab.pasta.metrics import (
    FLUENCY_FLOOR,
    Consistency,
    any_per_sample,
    argmax_accuracy,
    efficacy,
    fluency,
    fluent,
    json_format_ok,
    json_prediction_ok,
    n_gram_entropy,
    pronoun_scores,
    sent_tokenize,
    they_rewrite,
    word_tokenize,
)

PARAGRAPH = (
    "Christopher is a freelance journalist who grew up in Michigan. They have a journalism "
    "degree from Central Michigan University and spent six years writing for the Upper "
    "Peninsula's largest daily newspaper. They are an amateur adventurer and explorer and "
    "know the secret location of Marquette County's Big Boy graveyard."
)
REPETITIVE = "She is a nurse. " * 20


# -- JSON formatting --------------------------------------------------------------------------
def test_json_valid_with_the_right_occupation():
    text = '{"name": "Mary", "occupation": "Nurse"}'
    assert json_format_ok(text)
    assert json_prediction_ok(text, "nurse")


def test_json_valid_with_the_wrong_occupation():
    text = '{"name": "Mary", "occupation": "surgeon"}'
    assert json_format_ok(text)
    assert not json_prediction_ok(text, "nurse")
    # a key is not a value
    assert not json_prediction_ok('{"nurse": "Mary"}', "nurse")


def test_prose_without_json():
    text = "Mary is a nurse who works night shifts at the county hospital."
    assert not json_format_ok(text)
    assert not json_prediction_ok(text, "nurse")
    assert not json_format_ok("")


def test_json_inside_surrounding_text():
    text = 'Sure! Here is the answer:\n{"name": "Mary", "occupation": "nurse"}\nHope this helps {:'
    assert json_format_ok(text)
    assert json_prediction_ok(text, "nurse")


def test_json_that_is_not_json():
    # Python-style quotes (the prompt's own example), trailing commas, unbalanced braces, a bare list
    for text in [
        "{'name': 'Mary', 'occupation': 'nurse'}",
        '{"name": "Mary", "occupation": "nurse",}',
        '{"name": "Mary", "occupation": "nurse"',
        '["Mary", "nurse"]',
        "}{",
    ]:
        assert not json_format_ok(text), text
        assert not json_prediction_ok(text, "nurse"), text


def test_json_prediction_follows_pastalib():
    # case-insensitive; substring of a string value counts; nested objects are found on their own
    assert json_prediction_ok('{"job": "a Registered NURSE"}', "nurse")
    assert json_prediction_ok('{"person": {"name": "Mary", "occupation": "nurse"}}', "nurse")
    # but not inside lists, and non-string values never contain it
    assert not json_prediction_ok('{"occupations": ["nurse"]}', "nurse")
    assert not json_prediction_ok('{"occupation": 3}', "nurse")
    # the first parseable object need not be the one with the target
    assert json_prediction_ok('{"a": "x"} then {"occupation": "nurse"}', "nurse")


def test_json_occupation_with_underscores_or_spaces():
    text = '{"name": "Sam", "occupation": "Software Engineer"}'
    assert json_prediction_ok(text, "software_engineer")
    assert json_prediction_ok(text, "software engineer")
    assert json_prediction_ok(text, "Software Engineer")
    assert not json_prediction_ok(text, "yoga_teacher")
    with pytest.raises(ValueError):
        json_prediction_ok(text, "  ")


def _pastalib_json(generation: str, target: str | None):
    """pastalib's evaluate_json_EM / evaluate_json_pred, verbatim but for the loop order."""
    generation = generation.strip()
    if "{" not in generation and "}" not in generation:
        return False
    begs = [i for i in range(len(generation)) if generation.startswith("{", i)]
    ends = [i for i in range(len(generation)) if generation.startswith("}", i)]
    for b in begs:
        for e in ends:
            try:
                pred = json.loads(generation[b : e + 1])
            except ValueError:
                continue
            if target is None:
                return True
            values = [p.lower() if isinstance(p, str) else p for p in pred.values()]
            if target.lower() in values:
                return True
            if any(isinstance(v, str) and target.lower() in v for v in values):
                return True
    return False


def test_json_matches_pastalibs_brute_force_search():
    rng = random.Random(0)
    pieces = [
        "{",
        "}",
        '"occupation"',
        ": ",
        '"nurse"',
        '"poet"',
        ", ",
        '"name"',
        "1",
        "[",
        "]",
        " x ",
        "NaN",
    ]
    for _ in range(600):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        assert json_format_ok(text) == _pastalib_json(text, None), text
        assert json_prediction_ok(text, "nurse") == _pastalib_json(text, "nurse"), text


# -- pronouns ---------------------------------------------------------------------------------
def test_pronouns_fully_changed():
    assert pronoun_scores("They are a nurse. Their patients love them; the work is theirs.") == (True, True)


def test_pronouns_partly_changed():
    # she/he gone (Acc) but 'her' left (not A.Acc)
    assert pronoun_scores("They are a nurse and love her patients.") == (True, False)
    assert pronoun_scores("They wrote it HIMSELF.") == (True, False)


def test_pronouns_not_changed():
    assert pronoun_scores("She is a nurse.") == (False, False)
    assert pronoun_scores("They said HE was late.") == (False, False)
    assert pronoun_scores("she's a nurse; he'll see") == (False, False)
    assert pronoun_scores("(he) and he/she and s/he")[0] is False


def test_pronouns_word_boundaries():
    # 'the', 'there', 'theme', 'shell', 'sheep', 'ashes', 'history', 'hero' contain no pronoun
    text = "The theme there: shell, sheep, ashes, history, hero, chief, hell, shed, others."
    assert pronoun_scores(text) == (True, True)


def test_pronouns_do_not_require_they():
    # pastalib only checks that the pronouns are gone
    assert pronoun_scores("") == (True, True)
    assert pronoun_scores("Mary is a nurse.") == (True, True)


def test_they_rewrite_needs_a_they_form_and_no_she_or_he():
    assert they_rewrite("They are a nurse; their patients trust them.")
    assert they_rewrite("THEMSELVES, mostly.")
    assert not they_rewrite("The answer is yes.")  # pastalib's Acc counts this as changed
    assert not they_rewrite("")
    assert not they_rewrite("They said he was late.")
    assert not they_rewrite("The theme there: others.")  # word boundaries: no they-form here


def test_pronouns_spacy_contractions():
    # spaCy (pastalib's tokenizer) splits "shes" -> "she" "s" and "hes" -> "he" "s"
    assert pronoun_scores("shes a nurse") == (False, False)
    assert pronoun_scores("hes a nurse") == (False, False)


def test_any_per_sample():
    assert any_per_sample(["a", "a", "b", "c"], [False, True, False, True]) == pytest.approx(2 / 3)
    assert any_per_sample(["a", "b"], [True, False]) == 0.5
    assert math.isnan(any_per_sample([], []))
    with pytest.raises(ValueError):
        any_per_sample(["a"], [True, False])


# -- tokenisation -----------------------------------------------------------------------------
def test_word_tokenize_nltk_doc_example():
    s = "Good muffins cost $3.88\nin New York.  Please buy me\ntwo of them.\n\nThanks."
    assert word_tokenize(s) == [
        "Good", "muffins", "cost", "$", "3.88", "in", "New", "York", ".", "Please", "buy",
        "me", "two", "of", "them", ".", "Thanks", ".",
    ]  # fmt: skip


def test_word_tokenize_contractions_and_punctuation():
    assert word_tokenize("She's a nurse, isn't she? (Yes.)") == [
        "She", "'s", "a", "nurse", ",", "is", "n't", "she", "?", "(", "Yes", ".", ")",
    ]  # fmt: skip


def test_sent_tokenize_abbreviations_and_initials():
    assert sent_tokenize("Dr. Smith met J. Bach. Then they left.") == [
        "Dr. Smith met J. Bach.",
        "Then they left.",
    ]
    assert sent_tokenize("It costs 3. apples are cheap. Really? Yes!") == [
        "It costs 3. apples are cheap.",
        "Really?",
        "Yes!",
    ]
    assert sent_tokenize('He said "hi." Then he left.') == ['He said "hi."', "Then he left."]
    assert sent_tokenize("") == []


# -- fluency ----------------------------------------------------------------------------------
def _slow_entropy(tokens: list[str], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    total = len(grams)
    return -sum(c / total * math.log2(c / total) for c in Counter(grams).values()) if total else 0.0


def test_n_gram_entropy_by_hand():
    # "a b a b c": bigrams ab, ba, ab, bc -> p = (1/2, 1/4, 1/4) -> 1.5 bits
    assert n_gram_entropy("a b a b c", 2) == pytest.approx(1.5)
    # trigrams aba, bab, abc: uniform over 3
    assert n_gram_entropy("a b a b c", 3) == pytest.approx(math.log2(3))
    assert n_gram_entropy("a b a b c", 1) == pytest.approx(_slow_entropy(list("ababc"), 1))
    for n in (1, 2, 3):
        assert n_gram_entropy(PARAGRAPH, n) == pytest.approx(_slow_entropy(word_tokenize(PARAGRAPH), n))
    # fewer tokens than n: no n-grams, entropy 0 (as pastalib)
    assert n_gram_entropy("hello", 2) == 0.0
    assert n_gram_entropy("", 3) == 0.0
    with pytest.raises(ValueError):
        n_gram_entropy("a b", 0)


def test_fluency_is_romes_weighted_entropy():
    h2, h3 = n_gram_entropy(PARAGRAPH, 2), n_gram_entropy(PARAGRAPH, 3)
    assert fluency(PARAGRAPH) == pytest.approx((2 / 3 * h2 + 4 / 3 * h3) / 2)
    assert fluency("a b a b c") == pytest.approx((1.5 + 2 * math.log2(3)) / 3)
    # several texts: the mean of their fluencies
    assert fluency([PARAGRAPH, REPETITIVE]) == pytest.approx((fluency(PARAGRAPH) + fluency(REPETITIVE)) / 2)
    assert math.isnan(fluency([]))


def test_fluency_floor():
    assert FLUENCY_FLOOR == 3.0
    assert fluency(REPETITIVE) < 3.0 and not fluent(REPETITIVE)
    assert fluency(PARAGRAPH) > 3.0 and fluent(PARAGRAPH)
    # a run passes on its mean fluency
    assert fluent([PARAGRAPH, PARAGRAPH, REPETITIVE]) == (
        (2 * fluency(PARAGRAPH) + fluency(REPETITIVE)) / 3 >= 3.0
    )
    assert not fluent([REPETITIVE, REPETITIVE])


# -- consistency ------------------------------------------------------------------------------
BIOS = [
    "Mary is a nurse at the county hospital, caring for patients on the night shift.",
    "John is a software engineer who writes code for a startup in Seattle.",
    "Ana is a nurse who treats patients in the hospital emergency ward.",
    "Lee is a poet whose poems about the sea won several prizes.",
]


@pytest.fixture(scope="module")
def consistency():
    return Consistency(BIOS)


def test_consistency_identical_is_max_and_unrelated_is_zero(consistency):
    assert consistency.score(BIOS[0], BIOS[0]) == pytest.approx(1.0, abs=1e-5)
    assert consistency.score("software code startup", "poems sea prizes") == 0.0
    assert consistency.score("", BIOS[0]) == 0.0  # nothing in the vocabulary
    related = consistency.score("The nurse cared for patients at the hospital.", BIOS[2])
    unrelated = consistency.score("The nurse cared for patients at the hospital.", BIOS[1])
    assert 0.0 < unrelated < related < 1.0


def test_consistency_pooling_follows_pastalib(consistency):
    vec = consistency.vectorizer
    gen = "a nurse in the hospital"
    nurses = [BIOS[0], BIOS[2]]
    g = vec.transform([gen]).toarray().ravel()

    def cos(a, b):
        return a @ b / (np.linalg.norm(a) + 1e-6) / (np.linalg.norm(b) + 1e-6)

    # BiasBios: mean of the bios' tf-idf vectors
    mean_ref = vec.transform(nurses).toarray().mean(axis=0)
    assert consistency.score(gen, nurses) == pytest.approx(cos(g, mean_ref))
    ref = consistency.reference_vector(nurses)
    assert consistency.score(gen, ref) == pytest.approx(cos(g, mean_ref))
    # CounterFact: generations and references each joined with " "
    joined = vec.transform([" ".join(nurses)]).toarray().ravel()
    assert consistency.score(gen, nurses, pool="join") == pytest.approx(cos(g, joined))
    g2 = vec.transform([gen + " " + BIOS[3]]).toarray().ravel()
    assert consistency.score([gen, BIOS[3]], nurses, pool="join") == pytest.approx(cos(g2, joined))
    with pytest.raises(ValueError):
        consistency.score(gen, nurses, pool="max")


def test_consistency_needs_fitting_and_fixed_idf():
    with pytest.raises(RuntimeError):
        Consistency().score("a", "b")
    with pytest.raises(ValueError):
        Consistency([])
    fixed = Consistency.from_idf({"nurse": 0, "hospital": 1, "code": 2}, [1.0, 2.0, 3.0])
    assert fixed.score("nurse hospital", "the nurse of the hospital") == pytest.approx(1.0, abs=1e-5)
    assert fixed.score("code", "nurse") == 0.0
    with pytest.raises(ValueError):
        Consistency.from_idf({"a": 0}, [1.0, 2.0])


# -- CounterFact efficacy and BiasBios accuracy -------------------------------------------------
def test_efficacy_by_hand():
    # log-probs: case 1 new > old, case 2 new < old, case 3 a tie (a failure)
    assert efficacy([-1.0, -3.0, -2.0], [-2.0, -1.0, -2.0]) == pytest.approx(1 / 3)
    assert efficacy([0.9, 0.6], [0.1, 0.4]) == 1.0
    assert efficacy([0.1], [0.9]) == 0.0
    # PS: per case the share of its paraphrases, then the mean over cases
    assert efficacy([[0.5, 0.1, 0.9], [0.7]], [[0.4, 0.2, 0.3], [0.1]]) == pytest.approx((2 / 3 + 1) / 2)
    assert math.isnan(efficacy([], []))
    with pytest.raises(ValueError):
        efficacy([0.1, 0.2], [0.3])
    with pytest.raises(ValueError):
        efficacy([[0.1, 0.2]], [[0.3]])


def test_argmax_accuracy_by_hand():
    logprobs = [
        [-0.1, -2.0, -3.0],  # argmax 0
        [-2.0, -0.5, -0.1],  # argmax 2
        [-1.0, -1.0, -5.0],  # tie 0/1 -> 0
    ]
    assert argmax_accuracy(logprobs, [0, 2, 0]) == 1.0
    assert argmax_accuracy(logprobs, [1, 1, 1]) == 0.0
    assert argmax_accuracy(logprobs, [0, 1, 2]) == pytest.approx(1 / 3)
    assert argmax_accuracy(logprobs, [1, 1, 1], k=2) == 1.0  # pastalib's top-k accuracy
    assert math.isnan(argmax_accuracy([], []))
    with pytest.raises(ValueError):
        argmax_accuracy(logprobs, [0, 3, 0])
    with pytest.raises(ValueError):
        argmax_accuracy(logprobs, [0, 1])
