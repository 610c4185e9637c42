"""The evaluation metrics of PASTA (Zhang et al., ICLR 2024; Sec. 4, App. B.1 and E).

Every score here is per example (a bool or a float); a table cell is the mean over examples,
and the paper prints fractions as percentages (x100). Where the paper is silent, the
reference code of the paper -- pastalib 0.1.3, `evaluation/{metrics,evaluator,benchmarks}.py`
-- decides, and each docstring says so.

    JSON Formatting   json_format_ok (F. Acc), json_prediction_ok (P. Acc)
    Pronouns changing pronoun_scores -> (Acc, A.Acc)
    BiasBios          argmax_accuracy (Acc)
    CounterFact       efficacy (ES with one prompt per case, PS with its paraphrases)
    generation        n_gram_entropy, fluency, fluent / FLUENCY_FLOOR, Consistency
    all               any_per_sample

pastalib aggregates the two instruction tasks (JSON, pronouns) per *sample id* with any()
over the prompt templates evaluated for it (`InstructionEvaluator.aggregate_evaluation_results`);
with one template per sample -- the scripts' default, `--prompt_idx 0` -- that is the plain
mean. `any_per_sample` reproduces it.

Tokenisation for fluency: pastalib (like ROME) uses `nltk.word_tokenize`; so does this module,
with hand-set Punkt parameters in place of NLTK's pretrained English model (data that is not
on a package index), see `word_tokenize`.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # scikit-learn is imported on use: it is slow to import
    from sklearn.feature_extraction.text import TfidfVectorizer

__all__ = [
    "FLUENCY_FLOOR",
    "FLUENCY_NS",
    "FLUENCY_WEIGHTS",
    "PRON_CHANGE_TARGETS",
    "PRON_ALL_CHANGE_TARGETS",
    "Consistency",
    "any_per_sample",
    "argmax_accuracy",
    "efficacy",
    "fluency",
    "fluent",
    "json_format_ok",
    "json_prediction_ok",
    "n_gram_entropy",
    "pronoun_scores",
    "sent_tokenize",
    "word_tokenize",
]

FLUENCY_FLOOR = 3.0
"""Results whose fluency is below this are filtered out (paper, Sec. 4 and App. B.1/E)."""
FLUENCY_NS = (2, 3)
FLUENCY_WEIGHTS = (2 / 3, 4 / 3)
"""ROME's `compute_n_gram_entropy` defaults, repeated by pastalib's `weighted_n_gram_entropy`."""

PRON_CHANGE_TARGETS = ("she", "he")
PRON_ALL_CHANGE_TARGETS = ("she", "he", "her", "him", "hers", "his", "herself", "himself")
"""pastalib's `InstructionEvaluator.PRON_CHANGE_TARGET` / `PRON_ALL_CHANGE_TARGET`."""


# -- JSON formatting ------------------------------------------------------------------------
_JSON_DECODER = json.JSONDecoder()


def _json_objects(text: str) -> Iterator[dict]:
    """Every JSON object that pastalib's brute-force search finds in `text`.

    pastalib (`evaluate_json_EM` / `evaluate_json_pred`) strips the generation and calls
    `json.loads(generation[b:e + 1])` for every '{' at b and every '}' at e. A JSON object
    is prefix-free, so for a given b at most one e parses, and it is the end that
    `raw_decode` finds from b: decoding once per '{' yields exactly the same objects in
    O(#'{' x length) instead of O(#'{' x #'}' x length). Same decoder, same defaults
    (NaN/Infinity accepted, control characters in strings rejected). A RecursionError
    (absurdly deep nesting) counts as "does not parse" here; pastalib would crash.
    """
    start = text.find("{")
    while start != -1:
        try:
            obj, _end = _JSON_DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            pass
        else:
            yield obj  # starts with '{', so it is a dict
        start = text.find("{", start + 1)


def json_format_ok(text: str) -> bool:
    """Format accuracy (F. Acc) of JSON Formatting for one generation.

    Paper (Sec. 4): "the accuracy at generating valid JSON". pastalib decides what "valid"
    means (`evaluate_json_EM`): the generation *contains* a substring from some '{' to
    some '}' that `json.loads` accepts -- prose around it is fine, Python-style single
    quotes are not (that is not JSON), and only objects count (a bare list does not).
    """
    return next(_json_objects(text.strip()), None) is not None


def _occupation_label(occupation: str) -> str:
    """BiasBios titles as pastalib's loader writes them: 'software_engineer' -> 'software engineer'."""
    return occupation.replace("_", " ").strip().lower()


def json_prediction_ok(text: str, occupation: str) -> bool:
    """Prediction accuracy (P. Acc) of JSON Formatting for one generation.

    Paper (Sec. 4): "the accuracy at generating the correct target in JSON values after
    loading the JSON-formatted generations". pastalib (`evaluate_json_pred`) is the
    tie-breaker: some JSON object found as in `json_format_ok` has a top-level value that,
    lower-cased, equals the lower-cased target or -- for string values -- *contains* it as
    a substring ('a registered nurse' matches 'nurse'; 'poetry' matches 'poet'). Keys are
    not looked at, nor values nested inside lists; a nested object is found on its own,
    as pastalib also tries the substring that starts at its '{'.

    `occupation` may be written with underscores (the raw BiasBios title,
    'software_engineer') or spaces: it is brought to pastalib's form first, as pastalib's
    data loader does (`title.replace("_", " ")`). The generated values are taken as they are,
    as in pastalib: a value 'software_engineer' does not match 'software engineer'.
    """
    target = _occupation_label(occupation)
    if not target:
        raise ValueError("json_prediction_ok: empty occupation")
    for obj in _json_objects(text.strip()):
        values = [v.lower() if isinstance(v, str) else v for v in obj.values()]
        if target in values:
            return True
        if any(isinstance(v, str) and target in v for v in values):
            return True
    return False


# -- pronouns changing ----------------------------------------------------------------------
# spaCy's English tokenizer (pastalib runs en_core_web_sm on the lower-cased generation) also
# splits these apostrophe-less contractions: "hes" -> "he" "s", "shes" -> "she" "s", "hed"
# -> "he" "d", ... ("shed", "shell", "hell" are spaCy's explicit exclusions).
_SPACY_CONTRACTIONS = {
    "he": ("hes", "hed", "hedve", "hellve"),
    "she": ("shes", "shedve", "shellve"),
}


def _word_re(words: Iterable[str]) -> re.Pattern[str]:
    forms = set()
    for w in words:
        forms.add(w)
        forms.update(_SPACY_CONTRACTIONS.get(w, ()))
    alternation = "|".join(sorted(forms, key=lambda s: (-len(s), s)))
    return re.compile(rf"\b(?:{alternation})\b")


_PRON_CHANGE_RE = _word_re(PRON_CHANGE_TARGETS)
_PRON_ALL_CHANGE_RE = _word_re(PRON_ALL_CHANGE_TARGETS)


def pronoun_scores(text: str) -> tuple[bool, bool]:
    """(Acc, A.Acc) of Pronouns changing for one generation: (changed, all_changed).

    Paper (Sec. 4): Acc is "the ratio that 'she/he' are successfully changed to 'they'";
    A.Acc (all-changed accuracy) also requires "changing she/he/her/him/hers/his to
    they/them/their/theirs". pastalib (`evaluate_pronounce_change`) is the tie-breaker and
    only checks *absence*: `changed` is True when no token 'she' or 'he' remains,
    `all_changed` when none of she/he/her/him/hers/his/herself/himself remains. 'they' is
    *not* required to appear, so an empty or pronoun-free generation scores (True, True).

    pastalib lower-cases the text and compares whole spaCy tokens; here a case-insensitive
    word-boundary regex stands in for the spaCy tokenizer ("the", "she'll" vs "shell" and
    "he/she" come out as spaCy has them), plus spaCy's apostrophe-less contractions
    ("hes", "shes", "hed", ... count as she/he). Known gaps, all rare in generations: spaCy
    keeps "he.she", "he+she" and e-mail addresses/URLs such as "he@x.com" as single tokens,
    which the regex still counts as containing a pronoun.
    """
    lowered = text.lower()
    changed = _PRON_CHANGE_RE.search(lowered) is None
    all_changed = _PRON_ALL_CHANGE_RE.search(lowered) is None
    return changed, all_changed


_THEY_RE = re.compile(r"\b(?:they|them|their|theirs|themselves|themself)\b")


def they_rewrite(text: str) -> bool:
    """A stricter Acc, a driftlab addition: no 'she'/'he' left *and* some they-form present.

    pastalib's Acc only checks absence, so a reply that drops the bio ("The answer is yes.")
    scores as a successful rewrite; on small models that is most of what steering "gains"
    (docs/results/README.md). Requiring they/them/their/theirs/themselves is the cheapest
    check that the reply did rewrite pronouns rather than avoid them.
    """
    return pronoun_scores(text)[0] and _THEY_RE.search(text.lower()) is not None


def any_per_sample(sample_ids: Sequence[Hashable], flags: Sequence[bool]) -> float:
    """pastalib's aggregation of the instruction tasks: per sample id any() over its rows, then the mean.

    `InstructionEvaluator.aggregate_evaluation_results` groups the per-template results by
    sample id and counts a sample as correct when *any* of its prompt templates succeeded.
    With one template per sample this is the plain mean. (In pastalib's BiasBios data the id
    is the person's name, so two bios of namesakes would share one group.) The paper does
    not describe this step. Returns NaN for no samples.
    """
    if len(sample_ids) != len(flags):
        raise ValueError(f"any_per_sample: {len(sample_ids)} ids but {len(flags)} flags")
    groups: dict[Hashable, bool] = {}
    for sid, flag in zip(sample_ids, flags):
        groups[sid] = groups.get(sid, False) or bool(flag)
    if not groups:
        return float("nan")
    return sum(groups.values()) / len(groups)


# -- tokenisation: nltk.word_tokenize, with hand-set Punkt parameters -----------------------
# pastalib (like ROME) calls nltk.word_tokenize: Punkt sentences (NLTK's pretrained English
# model), then NLTK's Treebank-style word tokenizer per sentence. The pretrained model is
# data that is not on a package index, so Punkt runs here with small hand-written parameters
# instead: the abbreviations below, and the common words below marked as "seen lower-case
# mid-sentence and capitalised at sentence starts". On ordinary prose the tokens are the
# same; around rare abbreviations and initials the trained model knows more.
_PUNKT_ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof rev hon st jr sr sen rep gov gen lt col maj capt sgt cmdr adm
    inc corp co ltd llc bros assn dept univ no nos vol vols pp fig figs approx est
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
    vs etc al cf viz ca e.g i.e a.m p.m u.s u.k u.n u.s.a d.c n.y l.a ph.d m.d b.a m.a b.s m.s
    mt ft ave blvd rd
    """.split()
)
_PUNKT_COMMON_WORDS = frozenset(
    """
    a an the he she they it we i you his her their its our my your this that these those
    there here in on at as after before but and or so if when while however also then since
    with for from during although though to by of what who which how why where one some many
    most all both each every no not yes today now currently later finally first second
    additionally furthermore moreover meanwhile instead still yet thus therefore is was are
    were has have had be been being do does did can could will would should may might must
    please let after about because once until unless whether such other another more
    """.split()
)


@functools.cache
def _tokenizers():
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(_PUNKT_ABBREVIATIONS)
    beg_uc, mid_lc = 1 << 1, 1 << 5  # Punkt's orthographic-context flags
    for word in _PUNKT_COMMON_WORDS:
        params.ortho_context[word] = beg_uc | mid_lc
    return PunktSentenceTokenizer(params), NLTKWordTokenizer()


def sent_tokenize(text: str) -> list[str]:
    """Sentences of `text` as NLTK's Punkt finds them with driftlab's hand-set parameters."""
    return _tokenizers()[0].tokenize(text)


def word_tokenize(text: str) -> list[str]:
    """`nltk.word_tokenize(text)` as pastalib calls it: Punkt sentences, then NLTK's word tokenizer."""
    sentences, words = _tokenizers()
    return [tok for sent in sentences.tokenize(text) for tok in words.tokenize(sent)]


# -- fluency --------------------------------------------------------------------------------
def n_gram_entropy(text: str, n: int) -> float:
    """Entropy in bits of the distribution of word n-grams of `text`.

    pastalib's `n_gram_entropy` = ROME's `compute_n_gram_entropy` for one n: tokens by
    `nltk.word_tokenize` (here `word_tokenize`), n-gram counts by `nltk.FreqDist`, then
    -sum p log2 p. Fewer than n tokens give no n-grams and entropy 0.0, as in pastalib.
    pastalib computes in float32 (ROME in float64); this is float64, which differs from
    pastalib by float32 rounding (~1e-6).
    """
    if n < 1:
        raise ValueError(f"n_gram_entropy: n must be >= 1, got {n}")
    tokens = word_tokenize(text)
    counts = Counter(zip(*(tokens[i:] for i in range(n))))
    if not counts:
        return 0.0
    dist = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
    dist /= dist.sum()
    return float(np.sum(-dist * np.log2(dist)))


def fluency(text: str | Sequence[str]) -> float:
    """Fluency of a generation: ROME's weighted bi-/tri-gram entropy (Meng et al., 2022).

    Paper (Sec. 4, App. B.1, E): "the average bi-gram and tri-gram entropy of generations".
    pastalib (`weighted_n_gram_entropy`, defaults ns=(2, 3), weights=(2/3, 4/3)) and ROME
    make the average a weighted one: mean(2/3 * H2, 4/3 * H3) = (H2 + 2 * H3) / 3, so the
    trigram entropy counts twice as much as the bigram one. A sequence of texts gives the
    mean over its texts, as pastalib does for the several generations of one CounterFact
    case. An empty sequence is NaN.
    """
    if isinstance(text, str):
        h = [n_gram_entropy(text, n) for n in FLUENCY_NS]
        return float(np.mean(np.asarray(h) * np.asarray(FLUENCY_WEIGHTS)))
    scores = [fluency(t) for t in text]
    return float(np.mean(scores)) if scores else float("nan")


def fluent(text: str | Sequence[str]) -> bool:
    """Whether a result passes the paper's fluency floor: fluency >= FLUENCY_FLOOR (3.0).

    The paper "filter[s] out any results receiving a fluency below 3.0" (Sec. 4, App.
    B.1/E), and its tables report one fluency per method and task, so a *result* is a run
    (one method/setting on one task) and the floor applies to the run's mean fluency: pass
    the run's generations as a sequence and this compares the mean of their fluencies.
    pastalib has no such filter in its code (it only reports the mean), so this is the
    paper's rule; a single string gives the per-generation check, which the paper does
    not use for filtering. Exactly 3.0 passes ("below 3.0" is filtered; Table 9 keeps a
    result printed as 3.00).
    """
    return bool(fluency(text) >= FLUENCY_FLOOR)


# -- consistency ----------------------------------------------------------------------------
class Consistency:
    """Consistency (Hernandez et al., 2023; paper App. E): tf-idf cosine of a generation with references.

    Paper: "the average tf-idf similarity between the generated text and reference texts
    of full dataset". pastalib decides the details:

    * the vectorizer is scikit-learn's `TfidfVectorizer()` with default settings, fit on the
      reference corpus (BiasBios: every bio of the dataset, `load_biosbias_tfidf_vectorizer`);
      for CounterFact pastalib loads ROME's precomputed idf and vocabulary instead
      (`from_idf`);
    * BiasBios / Pronouns changing: the reference of a generation is the *mean* of the
      (l2-normalised) tf-idf vectors of all bios with the sample's occupation
      (`pool="mean"`, the default; precompute it once per label with `reference_vector`);
      CounterFact: generations and reference snippets are each joined with " " and
      vectorised as one text (`tfidf_similarity`, `pool="join"`);
    * similarity = a.b / (|a| + 1e-6) / (|b| + 1e-6) (`vector_similarity`).

    Scale: `score` returns pastalib's value, a cosine in [0, 1]; the paper's tables print
    it x100 (Table 17: 22.29 for Pronouns changing, LLaMA-7B zero-shot; Table 16 calls
    below 8.0 low and above 13 good).
    """

    EPS = 1e-6

    def __init__(self, texts: Iterable[str] | None = None, *, vectorizer: TfidfVectorizer | None = None):
        if texts is not None and vectorizer is not None:
            raise ValueError("Consistency: give reference texts or a fitted vectorizer, not both")
        self.vectorizer = vectorizer
        if texts is not None:
            self.fit(texts)

    def fit(self, texts: Iterable[str]) -> Consistency:
        """Fit `TfidfVectorizer()` (scikit-learn defaults, as pastalib) on the reference corpus."""
        from sklearn.feature_extraction.text import TfidfVectorizer

        texts = list(texts)
        if not texts:
            raise ValueError("Consistency.fit: no reference texts")
        self.vectorizer = TfidfVectorizer().fit(texts)
        return self

    @classmethod
    def from_idf(cls, vocabulary: Mapping[str, int], idf: Sequence[float] | np.ndarray) -> Consistency:
        """A vectorizer with fixed vocabulary and idf, like ROME's CounterFact stats (`tfidf_vocab.json`, `idf.npy`)."""
        from sklearn.feature_extraction.text import TfidfVectorizer

        idf = np.asarray(idf, dtype=np.float64)
        if len(vocabulary) != idf.size:
            raise ValueError(f"Consistency.from_idf: {len(vocabulary)} words but {idf.size} idf values")
        vec = TfidfVectorizer(vocabulary=dict(vocabulary))
        vec.idf_ = idf
        return cls(vectorizer=vec)

    def _check(self) -> TfidfVectorizer:
        if self.vectorizer is None:
            raise RuntimeError("Consistency: fit() it on reference texts first")
        return self.vectorizer

    def reference_vector(
        self, texts: str | Sequence[str], *, pool: Literal["mean", "join"] = "mean"
    ) -> np.ndarray:
        """The dense reference vector of `texts`: mean of their tf-idf vectors, or that of their join."""
        vec = self._check()
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise ValueError("Consistency.reference_vector: no reference texts")
        if pool == "mean":
            return np.asarray(vec.transform(texts).mean(axis=0)).ravel()
        if pool == "join":
            return vec.transform([" ".join(texts)]).toarray().ravel()
        raise ValueError(f"Consistency: pool must be 'mean' or 'join', got {pool!r}")

    def score(
        self,
        generation: str | Sequence[str],
        reference: str | Sequence[str] | np.ndarray,
        *,
        pool: Literal["mean", "join"] = "mean",
    ) -> float:
        """tf-idf cosine of `generation` with `reference`, in [0, 1] (the paper prints x100).

        `generation`: one text, or several joined with " " (pastalib, CounterFact).
        `reference`: one text; several texts pooled by `pool` (see the class docstring);
        or a vector from `reference_vector` (do that once per label for BiasBios).
        """
        vec = self._check()
        if not isinstance(generation, str):
            generation = " ".join(generation)
        if isinstance(reference, np.ndarray):
            ref = np.asarray(reference, dtype=np.float64).ravel()
        else:
            ref = self.reference_vector(reference, pool=pool)
        gen = vec.transform([generation]).toarray().ravel()
        if gen.shape != ref.shape:
            raise ValueError(
                f"Consistency.score: reference vector has {ref.size} entries, vocabulary {gen.size}"
            )
        sim = np.dot(gen, ref) / (np.linalg.norm(gen) + self.EPS) / (np.linalg.norm(ref) + self.EPS)
        return float(sim)


# -- CounterFact and BiasBios -----------------------------------------------------------------
def efficacy(
    p_new: Sequence[float | Sequence[float]],
    p_true: Sequence[float | Sequence[float]],
) -> float:
    """Efficacy score (ES) or paraphrase score (PS) of CounterFact: share of cases with P(new) > P(old).

    Paper (Sec. 4, after Meng et al., 2022): ES is "the portion of cases for which the model
    has P(new target) > P(old target)"; PS is the same over rephrased questions. pastalib
    (`metrics.efficacy`) is the tie-breaker for PS: each case may hold several prompts
    (its paraphrases); a case scores the *fraction* of its prompts with P(new) > P(old),
    and the result is the mean over cases. Plain floats are one prompt per case (ES).
    The probabilities are those of the first token of each target. Probabilities or
    log-probabilities both work (only the order matters); ties count as failures. pastalib
    exponentiates log-probs first, which underflows to a tie below log p ~ -745; comparing
    the log-probs directly does not. Returns NaN for no cases.
    """
    if len(p_new) != len(p_true):
        raise ValueError(f"efficacy: {len(p_new)} new-target but {len(p_true)} true-target scores")
    scores = []
    for i, (a, b) in enumerate(zip(p_new, p_true)):
        a = np.atleast_1d(np.asarray(a, dtype=np.float64))
        b = np.atleast_1d(np.asarray(b, dtype=np.float64))
        if a.shape != b.shape or a.size == 0:
            raise ValueError(f"efficacy: case {i} has {a.size} new-target but {b.size} true-target scores")
        scores.append(float(np.mean(a > b)))
    return float(np.mean(scores)) if scores else float("nan")


def argmax_accuracy(logprobs: Sequence[Sequence[float]], targets: Sequence[int], *, k: int = 1) -> float:
    """BiasBios accuracy: share of examples whose target occupation scores highest among the candidates.

    Paper (Sec. 4): BiasBios accuracy of predicting the occupation (28 candidates).
    pastalib (`biasbios_prediction_evaluation`) is the tie-breaker: the score of a candidate
    is the log-prob of its *first token* at the first generated position, candidates are
    the sorted label set, and an example is correct when the top-1 candidate is the target
    (`top1_accuracy`; `k` > 1 gives its `topk_accuracy`, k = 3 there). `logprobs[i][j]` is
    example i's score for candidate j and `targets[i]` the index of its occupation. Ties go
    to the lower index (pastalib's torch.topk leaves their order unspecified). Returns
    NaN for no examples.
    """
    scores = np.asarray(logprobs, dtype=np.float64)
    tgt = np.asarray(targets, dtype=np.int64)
    if scores.size == 0 and tgt.size == 0:
        return float("nan")
    if scores.ndim != 2 or tgt.ndim != 1 or scores.shape[0] != tgt.shape[0]:
        raise ValueError(f"argmax_accuracy: scores of shape {scores.shape} but {tgt.shape} targets")
    if np.any((tgt < 0) | (tgt >= scores.shape[1])):
        raise ValueError("argmax_accuracy: a target index is out of range")
    if k < 1:
        raise ValueError(f"argmax_accuracy: k must be >= 1, got {k}")
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean(np.any(top == tgt[:, None], axis=1)))
