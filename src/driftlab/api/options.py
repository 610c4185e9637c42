"""The one place a run's options become its validated config, for Python keywords and CLI flags alike.

`dl.selfchat(be, pair="a:u", max_new_tokens=16)` and `driftlab run --pair a:u --max-new-tokens 16`
name the same options; both reach `selfchat_config`, which turns them into a `SelfChatConfig`
(and likewise `mmlu_config`, `sweep_config`, `calibrate_config`). The CLI declares its flags
and prints reports; what an option *means* lives only here. A bad value becomes one line that
names the option as its caller spelt it: `Invalid --rounds 0: ...` on the command line,
`Invalid rounds=0: ...` in Python.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from driftlab.bench import Persona
from driftlab.chat.base import Sampling
from driftlab.chat.spec import BackendSpec, Runtime
from driftlab.errors import DriftlabError

M = TypeVar("M", bound=BaseModel)

_SAMPLING = tuple(Sampling.model_fields)  # max_new_tokens, temperature, top_p, greedy, ignore_eos, top_k, ...
_RUNTIME = tuple(Runtime.model_fields)  # base_url, concurrency, ray, ...


@dataclass(frozen=True)
class Spelling:
    """How the caller names options: `--max-new-tokens` on the command line, `max_new_tokens=` in Python."""

    flags: bool
    hint: str

    def name(self, option: str) -> str:
        return "--" + option.replace("_", "-") if self.flags else f"{option}="

    def given(self, option: str, value: Any) -> str:
        """The option with the value it was given, as the caller wrote it (`--n 0`, `n=0`)."""
        if self.flags:
            shown = f" {value}" if isinstance(value, (int, float, str)) and not isinstance(value, bool) else ""
            return self.name(option) + shown
        return f"{option}={value!r}" if isinstance(value, (int, float, str)) else option


FLAGS = Spelling(True, "The command's --help lists every option with its valid values.")
KEYWORDS = Spelling(False, "help(driftlab.<verb>) lists every keyword and its values.")


def keywords_of(verb: str) -> Spelling:
    """The Python spelling, its hint naming the verb whose help lists the keywords."""
    return Spelling(False, f"help(driftlab.{verb}) lists every keyword and its values.")


def validated(schema: type[M], spelling: Spelling = FLAGS, renames: dict[str, str] | None = None, /,
              **values: Any) -> M:
    """`schema(**values)`, a validation error turned into one line naming the option as spelt.

    `renames` maps a field to the option that sets it where they differ (`pair_ids` -> `pair`)."""
    from driftlab.steering.interventions import did_you_mean, literal_choices

    try:
        return schema(**values)
    except ValidationError as err:
        e = err.errors()[0]
        names = [str(p) for p in e["loc"] if isinstance(p, str)]
        renames = renames or {}
        if not names:  # a check across several options
            what = "options" if spelling.flags else "keywords"
            raise DriftlabError(f"Invalid {what}: {_lower(e['msg'])}.", hint=spelling.hint) from None
        field = names[-1]
        option = renames.get(field) or renames.get(names[0]) or (names[0] if len(names) > 1 else field)
        given, msg = e.get("input"), _lower(e["msg"])
        if len(names) > 1 and field not in renames:  # a key inside an option's value: --judge "colour=red"
            inner = f"={given}" if isinstance(given, (int, float, str)) and not isinstance(given, bool) else ""
            msg, shown = f"{field}{inner}: {msg}", spelling.name(option).rstrip("=")
        else:
            shown = spelling.given(option, given)
        if e["type"] == "literal_error":
            choices = literal_choices(e)
            msg = f"use one of {', '.join(choices)}{did_you_mean(given, choices)}"
        raise DriftlabError(f"Invalid {shown}: {msg}.", hint=spelling.hint) from None


def _lower(msg: str) -> str:
    msg = msg.removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def known(values: Iterable[str], allowed: Iterable[str], spelling: Spelling, *, what: str) -> None:
    """Every option is one `allowed` names; a misspelt one is an error with the closest name."""
    names = sorted(set(allowed))
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            mean = f"; did you mean {spelling.name(close[0])}?" if close else "."
            raise DriftlabError(f"unknown {what}: {spelling.name(key)}{mean}",
                                hint=f"known: {', '.join(spelling.name(n) for n in names)}")


# -- which model, where -----------------------------------------------------------------------------
def backend_spec(model: str, spelling: Spelling = FLAGS, /, **options: Any) -> BackendSpec:
    """The `BackendSpec` of `--model` and the backend options (dtype, device, span, device_map,
    quantize, decode; base_url, api_key_env, concurrency, timeout, max_retries, ray, actors)."""
    runtime = {k: options.pop(k) for k in list(options) if k in _RUNTIME}
    known(options, BackendSpec.model_fields.keys() - {"model", "runtime"}, spelling,
          what="option" if spelling.flags else "keyword for driftlab.load()")
    return validated(BackendSpec, spelling, {}, model=model, runtime=validated(Runtime, spelling, {}, **runtime),
                     **options)


# -- protocols' options -> their configs ------------------------------------------------------------
def selfchat_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab run` / `dl.selfchat`: fields of SelfChatConfig, sampling options, `pair` ("a:u" or
    (a, u), one or several; with it `pairs` defaults to 0, else 10), `categories` ("a,b" or a list),
    your own persona (`system`, `probe`, `measure`, `measure_params`) and Persona objects in `agents`.
    `personas` given without `agents` are the agents of the run."""
    from driftlab.protocol.selfchat import SelfChatConfig

    values = _given(options)
    if values.get("personas") and not values.get("agents"):
        # `personas=[p]` asks for a run over p: its personas are the agents (users still come from
        # the whole pool). `agents=` narrows or widens that choice.
        values["agents"] = [p.id if isinstance(p, Persona) else p for p in values["personas"]]
    own = own_persona(values.pop("system", None), values.pop("probe", None), values.pop("measure", None),
                      _json(values.pop("measure_params", None), "measure_params", spelling), spelling)
    if own is not None:
        values["personas"] = [*values.get("personas", []), own]
        values["agents"] = [*(values.get("agents") or []), own]
    values = _persona_objects(values)
    if "pair" in values:
        values["pair_ids"] = [*values.get("pair_ids", []), *(_pair(p, spelling) for p in _listed(values.pop("pair")))]
        values.setdefault("pairs", 0)  # the pairs named are the run, unless random ones are asked for too
    if isinstance(values.get("categories"), str):  # "a,b"; an empty one is no filter, as not given
        values["categories"] = [c.strip() for c in values["categories"].split(",") if c.strip()] or None
    return _config(SelfChatConfig, backend, spelling, values, {"pair_ids": "pair"}, extra=(
        "pair", "system", "probe", "measure", "measure_params"))


# A replayed persona of your own is scored on every turn; its probe is asked only with `probes`.
REPLAY_PROBE = "What do you do in London as a tourist?"


def replay_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab replay` / `dl.replay`: fields of ReplayConfig, sampling options, `categories` ("a,b" or a
    list), `agents`, and your own persona (`system`, `measure`, `measure_params`, optional `probe`). Named
    agents or your own persona are the agents whatever their category."""
    from driftlab.protocol.replay import ReplayConfig

    values = _given(options)
    if (values.get("system") is not None or values.get("measure") is not None) and values.get("probe") is None:
        values["probe"] = REPLAY_PROBE
    own = own_persona(values.pop("system", None), values.pop("probe", None), values.pop("measure", None),
                      _json(values.pop("measure_params", None), "measure_params", spelling), spelling)
    if own is not None:
        values["personas"] = [*values.get("personas", []), own]
        values["agents"] = [*(values.get("agents") or []), own]
    if isinstance(values.get("agents"), str):
        values["agents"] = [a.strip() for a in values["agents"].split(",") if a.strip()]
    values = _persona_objects(values)
    if isinstance(values.get("categories"), str):
        values["categories"] = [c.strip() for c in values["categories"].split(",") if c.strip()] or None
    if values.get("agents") and "categories" not in values:
        values["categories"] = None  # the agents named are the run's, whatever their category
    if values.get("conversations") is not None:
        values["conversations"] = str(values["conversations"])
    return _config(ReplayConfig, backend, spelling, values, {}, extra=("system", "probe", "measure", "measure_params"))


def directions_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab directions` / `dl.directions`: personas ("a,b" or a list of ids), system (one prompt or
    several), axis, prompts (a list, or a file with one user prompt per line), starters, sampling
    options, seed, batch_size."""
    from driftlab.protocol.directions import DirectionsConfig

    values = _given(options)
    if isinstance(values.get("personas"), str):
        values["personas"] = [p.strip() for p in values["personas"].split(",") if p.strip()]
    if "system" in values:
        values["systems"] = _listed(values.pop("system"))
    prompts = values.get("prompts")
    if isinstance(prompts, (str, Path)):
        path = Path(prompts)
        if not path.is_file():
            raise DriftlabError(f"{spelling.name('prompts').rstrip('=')} {prompts}: no such file.",
                                hint="Give a text file with one user prompt per line.")
        values["prompts"] = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return _config(DirectionsConfig, backend, spelling, values, {"systems": "system"}, extra=("system",))


def mmlu_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab mmlu` / `dl.mmlu`: the fields of MMLUConfig (n, steer, turn, turn_counting, histories,
    ties, history_tokens, seed, data, batch_size)."""
    from driftlab.protocol.mmlu import MMLUConfig

    return _config(MMLUConfig, backend, spelling, _given(options), {})


def sweep_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab sweep` / `dl.sweep`: the grid as `methods` ("split-softmax,cfg": their default grids)
    or `point` (steer specs, repeatable) or `grid` ({method: [specs]}); `pairs` (the first N of the 20
    ordered pairs of the sweep personas) or `pair`; `histories`, `ties` (of the MMLU pricing); the
    fields of SweepConfig otherwise."""
    from driftlab.protocol.sweep import SweepConfig, paper_pairs

    values = _given(options)
    values = _grid(values, spelling)
    renames = {"grid": "point", "mmlu_histories": "histories", "mmlu_ties": "ties", "pair_ids": "pair"}
    for option in ("histories", "ties"):
        if option in values:
            values[f"mmlu_{option}"] = values.pop(option)
    if "pair" in values:
        values["pair_ids"] = [_pair(p, spelling) for p in _listed(values.pop("pair"))]
    if "pairs" in values:
        pairs = values.pop("pairs")
        if not (isinstance(pairs, int) and 1 <= pairs <= 20) or "pair_ids" in values:
            raise DriftlabError(f"Invalid {spelling.given('pairs', pairs)}: " + (
                "give pairs or pair, not both" if "pair_ids" in values else "use 1 to 20") + ".", hint=spelling.hint)
        values["pair_ids"] = paper_pairs(values.get("personas", "table2") if values.get("personas") in (
            "table2", "reference") else "table2")[:pairs]
        renames["pair_ids"] = "pairs"
    return _config(SweepConfig, backend, spelling, values, renames, extra=(
        "methods", "point", "pairs", "pair", "histories", "ties"))


def calibrate_config(backend: BackendSpec, spelling: Spelling, options: dict[str, Any]) -> Any:
    """`driftlab calibrate` / `dl.calibrate`: `method`, `max_mmlu_drop`, `steps`, and MMLU's options
    for every point (n, turn, turn_counting, histories, ties, history_tokens, seed, data)."""
    from driftlab.protocol.calibrate import CalibrationConfig
    from driftlab.protocol.mmlu import MMLUConfig

    values = _given(options)
    own = {k: values.pop(k) for k in ("method", "max_mmlu_drop", "steps") if k in values}
    if "max_mmlu_drop" in own:
        own["max_drop"] = own.pop("max_mmlu_drop")
    known(values, MMLUConfig.model_fields.keys() - {"backend", "steer", "plain", "history"}, spelling,
          what=_what(spelling, "calibrate"))
    mmlu = _config(MMLUConfig, backend, spelling, values, {})
    return validated(CalibrationConfig, spelling, {"max_drop": "max_mmlu_drop"}, mmlu=mmlu, **own)


def _config(schema: type[M], backend: BackendSpec, spelling: Spelling, values: dict[str, Any],
            renames: dict[str, str], extra: Iterable[str] = ()) -> M:
    """A protocol config from option values: sampling options go into `sampling`, one steer into a
    list, paths into strings; any other option must be one of the config's fields."""
    fields = set(schema.model_fields)
    sampling = {k: values.pop(k) for k in list(values) if k in _SAMPLING and "sampling" in fields}
    known(values, (fields - {"backend"}) | set(extra), spelling, what=_what(spelling, _verb(schema)))
    if sampling:
        values["sampling"] = validated(Sampling, spelling, {}, **sampling)
    if "steer" in values and not isinstance(values["steer"], (list, tuple)):
        values["steer"] = [values["steer"]]
    values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
    return validated(schema, spelling, renames, backend=backend, **values)


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options given: None means "not given", so the config's default holds."""
    return {k: v for k, v in options.items() if v is not None}


def _what(spelling: Spelling, verb: str) -> str:
    return "option" if spelling.flags else f"keyword for driftlab.{verb}()"


def _verb(schema: type[BaseModel]) -> str:
    return {"SelfChatConfig": "selfchat", "MMLUConfig": "mmlu", "SweepConfig": "sweep",
            "DirectionsConfig": "directions", "ReplayConfig": "replay"}.get(schema.__name__,
                                                                                           "calibrate")


def _grid(values: dict[str, Any], spelling: Spelling) -> dict[str, Any]:
    """A sweep's grid from `methods` (their default grids) or `point` (specs), or as given (`grid`)."""
    from driftlab.protocol.sweep import GRID
    from driftlab.steering import Interventions

    given = [k for k in ("methods", "point", "grid") if k in values]
    if len(given) > 1:
        raise DriftlabError(f"Give one of {', '.join(spelling.name(k) for k in given)}: each sets the whole grid.",
                            hint="methods: their default grids; point: steer specs, one per point.")
    if "point" in values:
        grid: dict[str, list[Any]] = {}
        for spec in _listed(values.pop("point")):
            (item,) = Interventions.parse([spec]).items
            grid.setdefault(item.kind, []).append(item)
        return {**values, "grid": grid}
    methods = values.pop("methods", None)
    if methods is None:
        if "grid" in values or values.get("benchmark", "mmlu") == "mmlu":
            return values
        chosen = [m for m in GRID if GRID[m][0].hook != "conversation"]  # lm-eval sends raw text: no edits
        _note(f"sweep: {spelling.given('benchmark', values['benchmark'])}: methods {','.join(chosen)} (spr edits the "
              "conversation, which lm-eval's raw text has not).")
    else:
        chosen = [m.strip() for m in methods.split(",") if m.strip()] if isinstance(methods, str) else list(methods)
        unknown = [str(m) for m in chosen if m not in GRID]
        if unknown or not chosen:
            why = f"unknown method {', '.join(unknown)}" if unknown else "no method named"
            raise DriftlabError(f"Invalid {spelling.given('methods', methods)}: {why}.",
                                hint=f"Use some of: {', '.join(GRID)}.")
    return {**values, "grid": {m: list(GRID[m]) for m in chosen}}


def _note(text: str) -> None:
    from driftlab.console import err_console

    err_console().print(text, highlight=False, markup=False)


def _json(value: Any, option: str, spelling: Spelling) -> dict[str, Any] | None:
    """A dict option given as JSON text (the command line's only way) or as a dict."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise DriftlabError(f"{spelling.name(option).rstrip('=')} is not JSON ({err}).",
                            hint='e.g. \'{"lang": "fr"}\' for the language measure') from None


# -- your own persona -------------------------------------------------------------------------------
def own_persona(system: str | None, probe: str | None, measure: str | Callable[[str], float] | None,
                params: dict[str, Any] | None = None, spelling: Spelling = KEYWORDS) -> Persona | None:
    """One persona of the caller's from its system prompt, probe and measure (an id, a one-line
    `judge:model=...` spec, or a function), or None when none is given."""
    given = {"system": system, "probe": probe, "measure": measure}
    if all(v is None for v in given.values()) and not params:
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        parts = [spelling.name(k) for k in given]
        raise DriftlabError(f"your own persona needs {', '.join(parts[:-1])} and {parts[-1]}; "
                            f"{', '.join(spelling.name(k) for k in missing)} missing.",
                            hint="the measure is a measure id (`driftlab personas measures`), judge:model=...,rubric=..., "
                                 "or in Python a function text -> float in [0, 1].")
    try:
        return Persona(system_prompt=system, probe=probe, measure=measure, params=params or {})
    except ValidationError as err:
        e = err.errors()[0]
        # params given apart (a dict, --measure-params) or inside a one-line measure (judge:model=...)
        option = {"system_prompt": "system", "params": "measure_params" if params else "measure"}.get(
            str(e["loc"][0]) if e["loc"] else "", "measure")
        raise DriftlabError(f"Invalid {spelling.name(option).rstrip('=')}: {_lower(e['msg'])}.",
                            hint="`driftlab personas measures` lists the measures and their parameters.") from None


def _persona_objects(values: dict[str, Any]) -> dict[str, Any]:
    """`agents` may hold Persona objects: they join `personas` and are named by id."""
    agents = values.get("agents")
    if not agents:
        return values
    own = [a for a in agents if isinstance(a, Persona)]
    known_ids = {p.id for p in values.get("personas", [])}
    extra = []
    for p in own:
        if p.id not in known_ids:
            extra.append(p)
            known_ids.add(p.id)
    return {**values, "agents": [a.id if isinstance(a, Persona) else a for a in agents],
            "personas": [*values.get("personas", []), *extra]}


def _pair(value: Any, spelling: Spelling) -> tuple[str, str]:
    if isinstance(value, str):
        agent, sep, user = value.partition(":")
        if sep and agent.strip() and user.strip():
            return agent.strip(), user.strip()
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        return str(value[0]), str(value[1])
    raise DriftlabError(f"{spelling.name('pair').rstrip('=')} {value!r} is not AGENT_ID:USER_ID" +
                        ("." if spelling.flags else " or (agent_id, user_id)."),
                        hint="See ids with `driftlab personas list`.")


def _listed(value: Any) -> list[Any]:
    """One value or several: a string (or an (agent, user) pair of strings) is one."""
    one = isinstance(value, str) or not isinstance(value, (list, tuple)) or (
        isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, str) for v in value))
    return [value] if one else list(value)
