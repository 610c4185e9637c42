"""The LLM-judge measure: what to ask a judge model, and how to read its answer.

For a system prompt whose compliance no regular expression can check ("be warm but never
familiar"), a second model reads the system prompt, the probe and the reply, and rates the
reply 0-10 against a rubric; the score is the rating / 10. This module is the text side only
(bench knows no backends): the prompt, the parameters a persona gives (`judge:model=...,rubric=...`)
and the parsing of a verdict. Asking the model, greedy, with every verdict cached in the run
directory, is `driftlab.protocol.judge`.

For a persona, `measure: "judge"` (params: `JudgeParams`) names a judge in place of a function
of `MEASURES`, which hold only functions of the text; a judge may also be asked
about every probe of a run beside its deterministic measure (`--judge`), so the report can say
how well the two agree before anyone trusts the judge alone.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from driftlab.bench.measures import parse_keywords, register_params

JUDGE = "judge"
RUBRIC = ("How fully does the reply follow the system prompt's instruction? 0 means it ignores it entirely, "
          "10 means it follows it completely; judge only compliance with the instruction, not helpfulness.")
SYSTEM = "You are a strict, impartial grader of chatbot replies. You answer with a single integer from 0 to 10."
TEMPLATE = """A chatbot was given this system prompt:
<system_prompt>
{system_prompt}
</system_prompt>

A user then asked:
<question>
{probe}
</question>

The chatbot replied:
<reply>
{reply}
</reply>

{rubric}
Answer with one integer from 0 to 10 and nothing else."""
# A rating: 0-10 standing alone ("7", "Rating: 7/10"), not part of a longer number or decimal ("0.7", "17").
_RATING = re.compile(r"(?<![\w.])(10|[0-9])(?![\w.]?\d)")


class JudgeParams(BaseModel):
    """Which model judges and by what rubric (a persona's `params`, or a run's `--judge`).

    `model` is any model driftlab runs: a preset, a local directory, a Hub id, or `openai:NAME`
    behind `base_url` (e.g. a `driftlab serve`, vLLM). The judge always decodes greedily.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="a preset, local directory, Hub id or openai:NAME")
    rubric: str = Field(RUBRIC, min_length=1, description="what a rating of 0 and of 10 mean")
    base_url: str | None = Field(None, description="the OpenAI-compatible server of an openai: judge")
    max_tokens: int = Field(8, ge=1, le=512, description="most tokens of a verdict (a number needs few)")

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        """`"smollm2-135m"` is `{"model": "smollm2-135m"}`; `"model=x,rubric=..."` is read as keywords."""
        if isinstance(data, str):
            return parse_keywords(data) if "=" in data.split(",")[0] else {"model": data}
        return data


def judge_conversation(params: JudgeParams, system_prompt: str, probe: str, reply: str) -> list[dict[str, str]]:
    """The conversation (system and user message) a judge answers with its rating."""
    text = TEMPLATE.format(system_prompt=system_prompt, probe=probe, reply=reply, rubric=params.rubric)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def verdict_score(verdict: str) -> float:
    """A judge's answer as a score in [0, 1] (its first rating 0-10, / 10); a ValueError if it gave none."""
    found = _RATING.search(verdict)
    if found is None:
        raise ValueError(f"the judge answered {verdict[:80]!r}, which holds no rating from 0 to 10")
    return int(found.group(1)) / 10


register_params(JUDGE, JudgeParams)  # a persona's judge params are checked like any measure's
