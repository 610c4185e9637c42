"""The benchmark personas: system prompt, probe question and measure, plus user-defined ones.

The 100 built-in personas of the persona-drift paper (Table 2) live in `data/personas.jsonl`, one JSON
object per line, in the table's order. Users add their own from a JSONL or TOML file with
the same fields; every entry is validated when loaded (unknown measure, wrong parameter,
duplicate id) and an error names the file, line and field.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from driftlab.bench import ifbench, ifeval
from driftlab.bench.judge import JUDGE
from driftlab.bench.measures import (
    MEASURES,
    needs_complete,
    parse_keywords,
    plugin_measures,
    register_custom,
    validate_params,
)
from driftlab.errors import DriftlabError

Category = Literal["multiple_choice", "persona", "pattern", "memorization", "language"]
#: The five categories of the persona-drift paper, section 3.2 (the built-in personas'); a
#: persona of your own may name any other ("custom" by default).
CATEGORIES: tuple[str, ...] = get_args(Category)
SLUG = r"^[a-z0-9]+(?:[-_][a-z0-9]+)*$"


class MeasureError(ValueError):
    """A measure's value is not a score (NaN, outside [0, 1], not a number)."""


class Persona(BaseModel):
    """One benchmark entry: a system prompt, the probe that tests it and how to score the reply.

    Usable for either side of a self-chat: the agent's persona or the simulated user's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9]+(?:-[a-z0-9]+)*$", description="stable slug, e.g. 'reply-in-french'")
    category: str = Field("custom", pattern=SLUG, description="one of CATEGORIES for the built-ins; any slug else")
    system_prompt: str = Field(min_length=1)
    probe: str = Field(min_length=1)
    measure: str = Field(description="id of a function in MEASURES")
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_code(cls, data: Any) -> Any:
        """In code, `measure` may be the function itself (registered under its name, see
        `driftlab.measure`) or a one-line spec `name:key=value,...` (`judge:model=x,rubric=...`),
        and `id` may be left out (a stable one from the system prompt)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        spec = data.get("measure")
        if isinstance(spec, str) and ":" in spec and not data.get("params"):  # "judge:model=x,rubric=..."
            data["measure"], rest = spec.split(":", 1)
            data["params"] = parse_keywords(rest)
        if callable(data.get("measure")):
            data["measure"] = register_custom(data["measure"], needs_complete=bool(data.pop("needs_complete", False)))
        if "id" not in data and isinstance(data.get("system_prompt"), str):
            data["id"] = "custom-" + hashlib.sha256(data["system_prompt"].encode()).hexdigest()[:8]
        return data

    @field_validator("measure")
    @classmethod
    def _known_measure(cls, name: str) -> str:
        if name not in MEASURES and name != JUDGE:
            plugin_measures()  # another package's, declared through an entry point
        if name not in MEASURES and name != JUDGE:
            close = difflib.get_close_matches(name, MEASURES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown measure {name!r}{hint} (see `docs/personas.md` for the list; a measure "
                             "defined in code must be registered first, with driftlab.measure, also before a resume)")
        return name

    @field_validator("params")
    @classmethod
    def _params_fit_measure(cls, params: dict[str, Any], info: Any) -> dict[str, Any]:
        name = info.data.get("measure")
        if name is None:  # an unknown measure was already reported on its own field
            return params
        try:
            return validate_params(name, params)
        except ValueError as err:  # name the persona: a data file may hold many with one measure
            pid = info.data.get("id")
            raise ValueError(f"persona {pid!r}: {err}" if pid else str(err)) from None

    @property
    def needs_complete(self) -> bool:
        """Whether the measure can only judge a complete reply (JSON, last word, sentence counts, ...).

        For these personas a reply cut off by the token limit scores None ("truncated"), see `score`.
        """
        return needs_complete(self.measure, self.params)

    @overload
    def score(self, text: str, truncated: Literal[False] = False) -> float: ...
    @overload
    def score(self, text: str, truncated: bool) -> float | None: ...
    def score(self, text: str, truncated: bool = False) -> float | None:
        """How well `text` (a reply to `probe`) follows the system prompt: a float in [0, 1].

        `truncated` says the reply was cut off by the token limit (finish_reason "length").
        A measure that needs the whole reply (`needs_complete`) cannot judge a cut-off one,
        whose unclosed JSON or unfinished last sentence would count as a violation: the
        score is then None. Other measures score what there is. An empty or blank reply
        scores 0.
        """
        if truncated and self.needs_complete:
            return None
        if self.measure == JUDGE:
            raise MeasureError(f"persona {self.id!r} is scored by a judge model ({self.params['model']}): it scores "
                               "inside a run (driftlab run, driftlab.selfchat), not as a function of the text alone")
        value = MEASURES[self.measure](text, **self.params)
        try:
            score = float(value)
        except (TypeError, ValueError):
            score = float("nan")
        if not 0.0 <= score <= 1.0:  # also NaN (a bool is a 0/1 score)
            raise MeasureError(f"measure {self.measure!r} returned {value!r}, not a number in [0, 1]")
        return score


@functools.cache
def _builtin() -> tuple[Persona, ...]:
    source = resources.files("driftlab.bench") / "data" / "personas.jsonl"
    return tuple(_parse_jsonl(source.read_text(encoding="utf-8"), "built-in personas.jsonl", builtin=True))


#: The user sets a self-chat draws its users from (`SelfChatConfig.users`): the 100 personas (the
#: papers'), or users of the kinds that push a model off its persona, shipped apart so that the
#: default draw and its data hash stay as they were.
USER_SETS = ("personas", "drift-pushing")


@functools.cache
def _drift_users() -> tuple[Persona, ...]:
    source = resources.files("driftlab.bench") / "data" / "drift_users.jsonl"
    return tuple(_parse_jsonl(source.read_text(encoding="utf-8"), "drift_users.jsonl", builtin=True))


def drift_users() -> list[Persona]:
    """The drift-pushing users: the four user-message kinds the Assistant Axis paper found to move a model
    off its Assistant persona (its Table 5), and role-play requests. Each one's source and the paper's
    example message: `drift_user_sources()`."""
    return [p.model_copy(deep=True) for p in _drift_users()]


def drift_user_sources() -> dict[str, dict[str, str | None]]:
    """persona id -> {"source", "category" (the source's name for the kind), "example" (its message, or None)}."""
    return json.loads((resources.files("driftlab.bench") / "data" / "drift_users_sources.json").read_text("utf-8"))


#: The verifiable-instruction suites whose constraints are personas (`bench.constraints.Suite`).
CONSTRAINT_SUITES = {ifeval.CATEGORY: ifeval.SUITE, ifbench.CATEGORY: ifbench.SUITE}


@functools.cache
def _constraints(category: str) -> tuple[Persona, ...]:
    name = f"{category}_constraints.jsonl"
    source = resources.files("driftlab.bench") / "data" / name
    return tuple(_parse_jsonl(source.read_text(encoding="utf-8"), name, builtin=True))


def constraint_personas(category: str | None = None) -> list[Persona]:
    """Verifiable instructions as standing system prompts, scored by their benchmark's own checkers:
    IFEval's (category "ifeval", `bench.ifeval`) and IFBench's ("ifbench", `bench.ifbench`); both
    when `category` is None. Shipped apart from the 100 so that the default draw and its data hash
    stay as they were; a run takes them where it names them (`--categories ifbench`, `--agents ifbench-...`)."""
    return [p.model_copy(deep=True) for c in ([category] if category else CONSTRAINT_SUITES) for p in _constraints(c)]


def ifeval_constraints() -> list[Persona]:
    """IFEval's constraint personas (`constraint_personas("ifeval")`)."""
    return constraint_personas(ifeval.CATEGORY)


def load_personas(category: str | None = None, extra: str | Path | None = None) -> list[Persona]:
    """The 100 built-in personas, plus the entries of a user file `extra`, optionally of one category
    (categories "ifeval" and "ifbench": the constraint personas)."""
    # Copies: Persona is frozen but `params` is a dict; a caller changing it must not change the cache.
    personas = [p.model_copy(deep=True) for p in _builtin()]
    if category in CONSTRAINT_SUITES:
        personas += constraint_personas(category)
    if extra is not None:
        personas += load_user_personas(extra)
    if category is None:
        return personas
    present = {p.category for p in personas}
    known = [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES) | set(CONSTRAINT_SUITES))
    if category not in known:
        raise DriftlabError(f"unknown category {category!r}", hint=f"use one of: {', '.join(known)}")
    return [p for p in personas if p.category == category]


def get_persona(persona_id: str, extra: str | Path | None = None) -> Persona:
    """The persona with this id (built-in, or from the user file `extra`)."""
    personas = {p.id: p for p in load_personas(extra=extra)}
    if persona_id in personas:
        return personas[persona_id]
    close = difflib.get_close_matches(persona_id, personas, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else "`driftlab personas list` shows all ids"
    raise DriftlabError(f"no persona with id {persona_id!r}", hint=hint)


def load_user_personas(path: str | Path) -> list[Persona]:
    """Personas from a user file: JSONL (one object per line) or TOML (`[[persona]]` tables).

    Ids must not clash with the built-ins or each other. Raises DriftlabError naming the
    line and field of the first invalid entry.
    """
    path = Path(path)
    if not path.is_file():
        raise DriftlabError(f"persona file not found: {path}", hint="give the path of a .jsonl or .toml file")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a BOM from Windows editors is harmless
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise DriftlabError(
            f"persona file {path} is not UTF-8 text (invalid byte at line {line})",
            hint="save it as UTF-8, e.g. `iconv -f LATIN1 -t UTF-8 OLD > NEW`",
        ) from None
    except OSError as err:
        raise DriftlabError(
            f"cannot read persona file {path}: {err.strerror or err}", hint="check its permissions"
        ) from None
    if path.suffix == ".toml":
        personas = _parse_toml(text, str(path))
    elif path.suffix == ".jsonl":
        personas = _parse_jsonl(text, str(path))
    else:
        raise DriftlabError(f"unsupported persona file type: {path.name}", hint="use a .jsonl or .toml file")
    return personas


# --------------------------------------------------------------------------- parsing


def _parse_jsonl(text: str, source: str, builtin: bool = False) -> list[Persona]:
    entries: list[tuple[int, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DriftlabError(
                f"{source}, line {lineno}: not valid JSON ({err.msg}, column {err.colno})",
                hint="each non-blank line must be one JSON object",
            ) from None
    return _build(entries, source, builtin)


def _parse_toml(text: str, source: str) -> list[Persona]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise DriftlabError(
            f"{source}: not valid TOML ({err})", hint="check the quoting around that line"
        ) from None
    unknown = sorted(set(data) - {"persona"})
    if unknown or not isinstance(data.get("persona", []), list):
        raise DriftlabError(
            f"{source}: unexpected top-level key(s) {', '.join(unknown) or 'persona'}",
            hint="write each entry as a [[persona]] table",
        )
    # tomllib reports no positions; the n-th [[persona]] header's line locates the n-th entry.
    header_lines = [
        i
        for i, line in enumerate(text.splitlines(), start=1)
        if line.strip().replace(" ", "") == "[[persona]]"
    ]
    tables = data.get("persona", [])
    lines = header_lines if len(header_lines) == len(tables) else [0] * len(tables)
    return _build(list(zip(lines, tables)), source)


def _build(entries: list[tuple[int, Any]], source: str, builtin: bool = False) -> list[Persona]:
    builtin_ids = set() if builtin else {p.id for p in _builtin()}
    seen: dict[str, int] = {}
    personas = []
    for lineno, entry in entries:
        where = f"{source}, line {lineno}" if lineno else source
        if not isinstance(entry, dict):
            raise DriftlabError(
                f"{where}: expected an object with id, category, system_prompt, probe, measure, params"
            )
        try:
            persona = Persona.model_validate(entry)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "entry"
            message = first["msg"].removeprefix("Value error, ")
            raise DriftlabError(f"{where}, field '{field}': {message}", hint=_hint(field)) from None
        if persona.id in builtin_ids:
            raise DriftlabError(
                f"{where}, field 'id': {persona.id!r} is a built-in persona", hint="pick another id"
            )
        if persona.id in seen:
            raise DriftlabError(
                f"{where}, field 'id': {persona.id!r} already used on line {seen[persona.id]}",
                hint="ids must be unique",
            )
        seen[persona.id] = lineno
        personas.append(persona)
    return personas


def _hint(field: str) -> str:
    return {
        "id": "ids are lower-case words joined by '-', e.g. 'my-pirate'",
        "category": f"lower-case words joined by '-' or '_', e.g. one of the built-in {', '.join(CATEGORIES)}",
        "measure": "`driftlab personas measures` lists the measure ids",
        "params": "`driftlab personas measures` lists each measure's parameters",
    }.get(field.split(".")[0], "see docs/personas.md for the entry format")
