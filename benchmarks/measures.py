"""Persona measures on 1 MB of text: seconds per registered measure, worst over several inputs.

A reply is a few hundred tokens, but a measure must never be what stalls a run (a model that
loops until the token limit, a pasted document in a user file): every measure should score
1 MB in well under a second. The inputs are an ordinary reply repeated and the adversarial
texts that once made a measure's time grow faster than linearly:

* prose:         an ordinary answer repeated (sentences, no brackets: translated_pairs' old regex);
* abbreviations: "e.g. e.g. ..." (sentence splitting re-split its whole sentence at every "e.g.");
* dots:          "....x" (the sentence-end regex retried a run of dots from every position);
* letters:       "A A A ..." (the choice parser copied the rest of the text per letter);
* spaces:        "The answer is" + spaces (two adjacent \\s* in the choice parser);
* buts:          "I love it but hate it, but ..." (VADER's "but" rule is quadratic);
* pairs:         "Je suis là. (I am here.) ..." (one langdetect call per pair);
* nested:        '{"thought": [[[[...' (the JSON decoder's recursion limit: RecursionError).

Each measure is warmed up on a short reply first (its library loaded), then timed once per
input (best of `repeats`). `RESULT measures_max_seconds_1mb` is the worst over measures and inputs.

Sizes: --quick 3 inputs, 1 timing each; default: every input, 1 timing each; --full: every
input, best of 2. Measured with `time python benchmarks/run.py measures` on this project's
2-core CPU, shared with other jobs (load average ~2.5, this run included): the default size took
1 min 5 s (slowest: choice on "A A A ...", 1.08 s, one timing on a loaded machine: over the
1 s target), --quick 36 s.
"""

from __future__ import annotations

from functools import partial

from common import Result, best_time, size_of

from driftlab.bench import MEASURES, load_personas

MB = 1_000_000
PLAIN = (
    "As a tourist in London, I would start with the British Museum, then walk along the South Bank "
    "to see the Houses of Parliament. In the evening, I would catch a show in the West End. "
)


def _fill(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


INPUTS = {
    "prose": _fill(PLAIN, MB),
    "abbreviations": _fill("e.g. ", MB),
    "dots": "." * (MB - 1) + "x",
    "letters": _fill("A ", MB),
    "spaces": "The answer is" + " " * (MB - 18) + "maybe",
    "buts": _fill("I love it but hate it, but fine. ", MB),
    "pairs": _fill("Je suis là. (I am here.) ", MB),
    "nested": '{"thought": ' + "[" * (MB - 12),
}
QUICK_INPUTS = ("prose", "abbreviations", "buts")


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    inputs = {k: v for k, v in INPUTS.items() if not quick or k in QUICK_INPUTS}
    repeats = 2 if full else 1
    params = {}
    for p in load_personas():  # a built-in persona's params where a measure has one, else its defaults
        params.setdefault(p.measure, p.params)
    res = Result(
        title=f"persona measures: seconds to score 1 MB, best of {repeats}, after a warm-up on a short reply "
              f"({size} size)",
        columns=["measure", "prose s", "slowest input", "slowest s"],
    )
    worst: dict[str, float] = {}
    for name in sorted(MEASURES):
        fn, kw = MEASURES[name], params.get(name, {})
        fn(PLAIN, **kw)  # loads the measure's library (VADER, the tagger, langdetect, ...)
        times = {k: best_time(partial(fn, t, **kw), repeats=repeats, warmup=0) for k, t in inputs.items()}
        slow = max(times, key=times.__getitem__)
        worst[name] = times[slow]
        res.rows.append([name, f"{times['prose']:.3f}", slow, f"{times[slow]:.3f}"])
    slowest = max(worst, key=worst.__getitem__)
    res.results = {"size": size, "measures_max_seconds_1mb": f"{worst[slowest]:.3f}", "measures_slowest": slowest}
    res.notes.append(f"{len(MEASURES)} measures x {len(inputs)} inputs of {MB:,} characters; target < 1 s")
    return res
