"""driftlab from Python: what `import driftlab as dl` gives a notebook.

    import driftlab as dl
    be = dl.load("smollm2-135m", dtype="float32")        # or dl.from_model(model, tokenizer)
    run = dl.selfchat(be, pairs=2, rounds=2, max_new_tokens=16, steer="split-softmax:k=0.9")
    run.summary.overall, run.to_pandas()

Every protocol runs as the CLI runs it (`run_protocol`: resume, progress, records); the keywords
are the CLI's options with underscores (`max_new_tokens=`, `probe_tokens=`, `pair=["a:u"]`), checked
by the protocols' own configs, so a wrong value gets the same one-line error as on the command
line. Without `out=` a run is written to a temporary directory, read back into the returned `Run`
and deleted; with `out=` the directory stays and running the same call again resumes it.
"""

from __future__ import annotations

import difflib
import tempfile
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.bench import Persona, register_custom
from driftlab.chat.base import ChatBackend, Sampling
from driftlab.chat.spec import MEMORY_PREFIX, BackendSpec, Runtime
from driftlab.errors import DriftlabError

if TYPE_CHECKING:
    from driftlab.report.results import Results

__all__ = ["Run", "from_model", "load", "measure", "mmlu", "personas", "selfchat", "spec_of", "steer", "sweep",
           "trace"]

_SAMPLING = tuple(Sampling.model_fields)  # max_new_tokens, temperature, top_p, greedy, ignore_eos, top_k, ...
_RUNTIME = tuple(Runtime.model_fields)  # base_url, concurrency, ray, ...
_SPECS: weakref.WeakKeyDictionary[Any, BackendSpec] = weakref.WeakKeyDictionary()  # backend -> how it was loaded


# -- models ---------------------------------------------------------------------------------
def load(model: str = DEFAULT_MODEL, **options: Any) -> ChatBackend:
    """A backend by name, as `--model` takes it: a preset, a local HF directory, a Hub id
    `org/name[@rev]` or `openai:NAME` (a server). `options` are the CLI's backend options:
    dtype, device, span, device_map, quantize, decode, and for servers and Ray base_url,
    api_key_env, concurrency, timeout, max_retries, ray, actors."""
    from driftlab.chat.factory import make_backend

    spec = backend_spec(model, **options)
    backend = make_backend(spec)
    _SPECS[backend] = spec
    return backend


def from_model(model: Any, tokenizer: Any, **options: Any) -> ChatBackend:
    """A backend on a transformers model you already hold (fine-tuned, PEFT-wrapped, placed on your
    devices): driftlab's attention is installed until `close()` (or the end of a `with` block),
    which gives the model its own back. `options`: span_mode, decode, name (what manifests
    record, as memory:NAME), prefix_cache_bytes."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend.from_model(model, tokenizer, **options)


def steer(model: Any, interventions: Any, *, system: str | tuple[int, int], tokenizer: Any = None) -> Any:
    """`with dl.steer(model, "split-softmax:k=0.8", system=prompt): model.generate(...)`: your own
    generate and forward run under driftlab's attention interventions (split-softmax, InstABoost,
    key biases, PASTA, trace) inside the block, and exactly as before after it. `system` is the
    system prompt's text (found in each row) or its token range. CFG and SPR need driftlab's own
    decode loop and are refused: use `dl.from_model` and a protocol or `chat` instead."""
    from driftlab.chat.steer import steer as steering

    return steering(model, interventions, system=system, tokenizer=tokenizer)


def trace(model: Any, messages: Any, *, steer: Any = None, tokenizer: Any = None) -> Any:
    """pi for a conversation, without generating: a typed `Trace` (pi per prompt token x layer x
    head on the system span, its spans and token strings; `.to_pandas()`, `.plot()`). `model` is a
    driftlab backend (`dl.load`, `dl.from_model`) or a transformers model with its `tokenizer`
    (held for this call only). `steer`: interventions to trace under (e.g. "split-softmax:k=0.8")."""
    from driftlab.chat.trace import trace as tracing

    if hasattr(model, "capabilities"):
        return tracing(model, messages, steer)
    if tokenizer is None:
        raise DriftlabError("dl.trace of a transformers model needs its tokenizer.",
                            hint="dl.trace(model, messages, tokenizer=tokenizer), or a backend: dl.from_model(model, "
                                 "tokenizer).")
    with from_model(model, tokenizer, prefix_cache_bytes=0) as backend:
        return tracing(backend, messages, steer)


def backend_spec(model: str = DEFAULT_MODEL, **options: Any) -> BackendSpec:
    """The `BackendSpec` (what a manifest records) of `load(model, **options)`."""
    runtime = {k: options.pop(k) for k in list(options) if k in _RUNTIME}
    _known(options, BackendSpec.model_fields.keys() - {"model", "runtime"}, _RUNTIME, what="keyword for driftlab.load()")
    return _validated(BackendSpec, model=model, runtime=_validated(Runtime, **runtime), **options)


def spec_of(backend: ChatBackend) -> BackendSpec:
    """What a run's manifest records about a backend: how `load` made it; for a backend built
    otherwise, its name (`memory:NAME` for a model handed over with `from_model`) and the dtype it
    computes in."""
    if backend in _SPECS:
        return _SPECS[backend]
    facts = backend.describe()
    dtype = facts.get("dtype") if facts.get("dtype") in ("bfloat16", "float16", "float32") else "auto"
    memory = facts.get("source") == "memory"
    return BackendSpec(model=(MEMORY_PREFIX if memory else "") + str(backend.name), dtype=dtype)


def personas(category: str | None = None, extra: str | Path | None = None) -> list[Persona]:
    """The benchmark's 100 system prompts (probe and measure each), optionally of one category,
    plus those of a JSONL/TOML file `extra` (docs/personas.md)."""
    from driftlab.bench import load_personas

    return load_personas(category, extra)


# -- results of any run ---------------------------------------------------------------------------
def results(run_dir: str | Path) -> Results:
    """The `Results` of any run directory (any protocol, a plugin's too): estimates with n, interval
    and test, and the run's identity on every row of `.to_pandas()`."""
    from driftlab.report.results import summarize

    return summarize(run_dir)


def compare(run_dirs: Iterable[str | Path], out: str | Path) -> Path:
    """One page (OUT/compare.html, compare.csv, compare.png) of several runs' headline estimates."""
    from driftlab.report.compare import compare_page

    return compare_page(list(run_dirs), out)


# -- your own measures ----------------------------------------------------------------------------
def measure(fn: Callable[[str], float] | None = None, *, name: str | None = None,
            needs_complete: bool = False) -> Any:
    """Register a function `text -> float in [0, 1]` as a measure (decorator or call); a `Persona`
    then names it (`measure="my_measure"`) or takes the function itself. `needs_complete` marks a
    measure that cannot judge a reply cut at the token limit (it is then left unscored). A run
    records the name; re-run the registration before resuming it in a new process."""
    def decorate(f: Callable[[str], float]) -> Callable[[str], float]:
        register_custom(f, name=name, needs_complete=needs_complete)
        return f

    return decorate if fn is None else decorate(fn)


# -- protocols ------------------------------------------------------------------------------------
@dataclass
class Run:
    """A finished run: its manifest, records and summary, in memory.

    `summary` is what the protocol's report is drawn from: a `RunSummary` for a self-chat
    (`.overall`, `.per_round`, `.comparisons`), a dict for MMLU (accuracy per condition, the drop
    with its paired test), a DataFrame for a sweep (one row per point). `path` is the run
    directory, or None when it was a temporary one. `results` is the same run in the one shape every
    protocol shares (`Results`: estimates with n, interval and test; `.to_pandas()` concatenates
    across runs), what `driftlab report` writes as results.json.
    """

    protocol: str
    path: Path | None
    manifest: dict[str, Any]
    records: list[dict[str, Any]]
    summary: Any
    results: Results

    def to_pandas(self):
        """The records as a DataFrame, with the run's protocol, model, revision, dtype, steer and
        run_seed as columns, so the frames of several runs concatenate (`seed`, where records have
        one, is each generation's own)."""
        import pandas as pd

        config = self.manifest.get("config") or {}
        agent = (self.manifest.get("models") or {}).get("agent") or {}
        steer = config.get("steer") or []
        columns = {"protocol": self.protocol, "model": (config.get("backend") or {}).get("model"),
                   "revision": (agent.get("hub") or {}).get("sha"), "dtype": agent.get("dtype"),
                   "steer": ",".join(steer) if isinstance(steer, list) else steer, "run_seed": config.get("seed")}
        return pd.DataFrame(self.records).assign(**columns)

    def __repr__(self) -> str:
        where = self.path or "in memory"
        return f"Run({self.protocol}, {len(self.records)} records, {where})"


def selfchat(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
             user_backend: ChatBackend | None = None, system: str | None = None, probe: str | None = None,
             measure: str | Callable[[str], float] | None = None, **options: Any) -> Run:
    """The self-chat drift experiment (`driftlab run`) on `backend` (a loaded backend, a model
    name, or None for the default model).

    Your own system prompt without a persona file: `system=`, `probe=` and `measure=` (a measure
    id or any function `text -> [0, 1]`) make one agent persona, drawn against `pairs` random user
    personas. `personas=[dl.Persona(...)]` adds several; `agents=[...]` (ids or Personas) restricts
    the agents drawn. Other keywords are `driftlab run`'s options: pairs, pair (["agent:user"]; with
    it, `pairs` defaults to 0 rather than 10),
    rounds, max_new_tokens, probe_tokens, temperature, top_p, greedy, seed, steer, user_probe,
    ablation, probe_after, batch_size, ...
    """
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
    from driftlab.report.metrics import summarize_run

    options = _own_persona(options, system, probe, measure)
    options = _personas_in_agents(options)

    def make(spec: BackendSpec, backend: ChatBackend) -> SelfChat:
        return SelfChat(_config(SelfChatConfig, spec, options), backend, user_backend)

    return _run(make, backend, out, progress, lambda path: summarize_run(path))


def mmlu(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
         **options: Any) -> Run:
    """MMLU accuracy at a turn of a dialog, plain and steered (`driftlab mmlu`): keywords n, steer,
    turn, turn_counting, histories, ties, history_tokens, seed, data, batch_size. Needs the questions
    once: `driftlab data pull mmlu`."""
    from driftlab.protocol.mmlu import MMLU, MMLUConfig
    from driftlab.protocol.mmlu import summarize as summarize_mmlu

    return _run(lambda spec, be: MMLU(_config(MMLUConfig, spec, options), be), backend, out, progress,
                summarize_mmlu)


def sweep(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
          **options: Any) -> Run:
    """Every method over a grid of strengths, stability against MMLU cost (`driftlab sweep`): keywords
    grid ({method: [specs]}), pair, rounds, max_new_tokens, probe_tokens, mmlu_n, mmlu_histories, seed, ...
    The summary is the sweep's table (one row per point, paired tests against plain with Holm)."""
    from driftlab.protocol.sweep import Sweep, SweepConfig
    from driftlab.report.sweep import sweep_table

    return _run(lambda spec, be: Sweep(_config(SweepConfig, spec, options), be), backend, out, progress,
                sweep_table)


def _run(make: Callable[[BackendSpec, ChatBackend | None], Any], backend: ChatBackend | str | None,
         out: str | Path | None, progress: bool, summarize: Callable[[Path], Any]) -> Run:
    """Build the protocol on the backend, run it into `out` (or a temporary directory) and read it back."""
    from driftlab.protocol.runner import run_protocol

    if backend is None or isinstance(backend, str):
        spec, backend = backend_spec(backend or DEFAULT_MODEL), None  # loaded by the protocol, after its checks
    else:
        spec = spec_of(backend)
    protocol = make(spec, backend)
    with tempfile.TemporaryDirectory(prefix="driftlab-") as tmp:
        rundir = run_protocol(protocol, out if out is not None else Path(tmp) / "run", progress=progress)
        from driftlab.report.results import summarize as results_of

        results = results_of(rundir.path)
        if out is not None:  # a run directory that stays says its results as `driftlab report` would
            results.write(rundir.path)
        return Run(protocol.name, rundir.path if out is not None else None, rundir.read_manifest(),
                   rundir.records(), summarize(rundir.path), results)


# -- keywords -> configs ----------------------------------------------------------------------------
def _config(schema: type[BaseModel], spec: BackendSpec, options: dict[str, Any]) -> Any:
    """A protocol config from the CLI's options as keywords: sampling options go into `sampling`,
    `pair=["a:u"]` into `pair_ids`, a single steer into a list; anything else must be a field."""
    values = dict(options)
    fields = set(schema.model_fields)
    sampling = {k: values.pop(k) for k in list(values) if k in _SAMPLING and "sampling" in fields}
    if sampling:
        values["sampling"] = _validated(Sampling, **sampling)
    if "pair" in values:
        values["pair_ids"] = [*values.get("pair_ids", []), *(_pair(p) for p in _listed(values.pop("pair")))]
    if values.get("pair_ids") and "pairs" not in values and "pairs" in fields and schema.__name__ != "SweepConfig":
        values["pairs"] = 0  # the pairs named are the run, unless random ones are asked for too
    if "steer" in values and not isinstance(values["steer"], (list, tuple)):
        values["steer"] = [] if values["steer"] is None else [values["steer"]]
    _known(values, fields - {"backend"}, (*_SAMPLING, "pair"), what=f"keyword for driftlab.{_doc_of(schema)}()")
    return _validated(schema, backend=spec, **values)


#: How the parts of one's own persona are spelt, in Python and on the command line (errors name them so).
KEYWORDS = {"system": "system=", "probe": "probe=", "measure": "measure=", "params": "measure_params="}
FLAGS = {"system": "--system", "probe": "--probe", "measure": "--measure", "params": "--measure-params"}


def own_persona(system: str | None, probe: str | None, measure: str | Callable[[str], float] | None,
                params: dict[str, Any] | None = None, names: dict[str, str] = KEYWORDS) -> Persona | None:
    """One persona of the caller's from its system prompt, probe and measure (an id, a one-line
    `judge:model=...` spec, or a function), or None when none is given; errors name the parts as
    `names` spells them (keywords for `dl.selfchat`, flags for `driftlab run`)."""
    given = {"system": system, "probe": probe, "measure": measure}
    if all(v is None for v in given.values()) and not params:
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        parts = [names[k] for k in given]
        raise DriftlabError(f"your own persona needs {', '.join(parts[:-1])} and {parts[-1]}; "
                            f"{', '.join(names[k] for k in missing)} missing.",
                            hint="the measure is a measure id (`driftlab personas measures`), judge:model=...,rubric=..., "
                                 "or in Python a function text -> float in [0, 1].")
    try:
        return Persona(system_prompt=system, probe=probe, measure=measure, params=params or {})
    except ValidationError as err:
        e = err.errors()[0]
        # params given apart (a dict, --measure-params) or inside a one-line measure (judge:model=...)
        field = {"system_prompt": "system", "params": "params" if params else "measure"}.get(
            str(e["loc"][0]) if e["loc"] else "", "measure")
        raise DriftlabError(f"Invalid {names[field]}: {e['msg'].removeprefix('Value error, ')}.",
                            hint="`driftlab personas measures` lists the measures and their parameters.") from None


def _own_persona(options: dict[str, Any], system: str | None, probe: str | None,
                 measure: str | Callable[[str], float] | None) -> dict[str, Any]:
    """`system=, probe=, measure=`: one persona of the caller's, the agent of every pair."""
    persona = own_persona(system, probe, measure)
    if persona is None:
        return options
    return {**options, "personas": [*options.get("personas", []), persona],
            "agents": [*(options.get("agents") or []), persona.id]}


def _personas_in_agents(options: dict[str, Any]) -> dict[str, Any]:
    """`agents=` may hold Persona objects: they join `personas` and are named by id."""
    agents = options.get("agents")
    if not agents:
        return options
    own = [a for a in agents if isinstance(a, Persona)]
    known = {p.id for p in options.get("personas", [])}
    return {**options, "agents": [a.id if isinstance(a, Persona) else a for a in agents],
            "personas": [*options.get("personas", []), *(p for p in own if p.id not in known)]}


def _pair(value: Any) -> tuple[str, str]:
    if isinstance(value, str):
        agent, sep, user = value.partition(":")
        if sep and agent.strip() and user.strip():
            return agent.strip(), user.strip()
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        return str(value[0]), str(value[1])
    raise DriftlabError(f"pair {value!r} is not 'AGENT_ID:USER_ID' or (agent_id, user_id).",
                        hint="See ids with `driftlab personas list`.")


def _listed(value: Any) -> Iterable[Any]:
    return [value] if isinstance(value, str) or (isinstance(value, tuple) and len(value) == 2
                                                  and all(isinstance(v, str) for v in value)) else value


def _known(values: dict[str, Any], fields: Iterable[str], extra: Iterable[str], *, what: str) -> None:
    names = sorted({*fields, *extra})
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            raise DriftlabError(f"unknown {what}: {key}=" + (f"; did you mean {close[0]}=?" if close else "."),
                                hint=f"known: {', '.join(names)}")


def _validated(schema: type[BaseModel], **values: Any) -> Any:
    """`schema(**values)`, a validation error turned into one line naming the keyword."""
    try:
        return schema(**values)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"] if not isinstance(p, int)) or schema.__name__
        given = e.get("input")
        shown = f"={given!r}" if isinstance(given, (int, float, str)) else ""
        raise DriftlabError(f"invalid {where}{shown}: {e['msg'].removeprefix('Value error, ')}.",
                            hint=f"see help(driftlab.{_doc_of(schema)}) for every keyword and its values") from None


def _doc_of(schema: type[BaseModel]) -> str:
    return {"SelfChatConfig": "selfchat", "MMLUConfig": "mmlu", "SweepConfig": "sweep"}.get(schema.__name__, "load")
