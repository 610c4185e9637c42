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

import tempfile
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from driftlab.api.options import keywords_of
from driftlab.api.runs import Run, execute, read_results
from driftlab.assets.registry import DEFAULT_MODEL
from driftlab.bench import Persona, register_custom
from driftlab.chat.base import ChatBackend
from driftlab.chat.spec import MEMORY_PREFIX, BackendSpec, directions_there
from driftlab.errors import DriftlabError

if TYPE_CHECKING:
    from driftlab.protocol.runner import Protocol
    from driftlab.report.results import Results

__all__ = ["Run", "calibrate", "directions", "from_model", "load", "measure", "mmlu", "personas", "replay", "run",
           "selfchat", "spec_of", "steer", "sweep", "trace", "warm"]

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


def steer(model: Any, interventions: Any, *, system: str | tuple[int, int], tokenizer: Any = None,
          directions: Any = None) -> Any:
    """`with dl.steer(model, "split-softmax:k=0.8", system=prompt): model.generate(...)`: your own
    generate and forward run under driftlab's attention interventions (split-softmax, InstABoost,
    key biases, PASTA, trace) inside the block, and exactly as before after it; with `directions`
    also `vector:` and `cap:`. `system` is the system prompt's text (found in each row) or its token
    range. CFG, SPR and pi-floor need driftlab's own decode loop and are refused: use
    `dl.from_model` and a protocol or `chat` instead."""
    from driftlab.chat.steer import steer as steering

    return steering(model, interventions, system=system, tokenizer=tokenizer, directions=directions)


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


def warm(model: str = DEFAULT_MODEL, batches: Iterable[int] = (1, 2, 4, 8), **options: Any) -> list[dict]:
    """Compile a local model's decode loop ahead of a run (`HFChatBackend.warm`): a plain and a
    steered graph per batch bucket of `batches`, kept in driftlab's compile cache for later
    processes. `options`: the backend options of `load` (dtype, device, ...); the decode loop is
    the compiled one. Returns one row per (bucket, kind): graphs, compile seconds, cache hits/misses."""
    if options.get("decode", "compiled") != "compiled":
        raise DriftlabError(f"dl.warm compiles the decode loop; decode={options['decode']!r} has none to compile.",
                            hint="Leave decode out (warm uses decode='compiled').")
    from driftlab.chat.static_decode import warm_buckets

    warm_buckets(batches)  # bad sizes fail before the model loads
    options = {**options, "decode": "compiled"}
    if backend_spec(model, **options).remote:
        raise DriftlabError(f"{model} is not a local model: a server compiles its own decode loop, if any.",
                            hint="Warm a preset, a local directory or a Hub id.")
    backend = load(model, **options)
    try:
        if not hasattr(backend, "warm"):
            raise DriftlabError(f"{model} runs in Ray actors, which compile in their own processes.",
                                hint="Warm it without --ray on each machine that will run it.")
        return backend.warm(tuple(batches))
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def backend_spec(model: str = DEFAULT_MODEL, **options: Any) -> BackendSpec:
    """The `BackendSpec` (what a manifest records) of `load(model, **options)`."""
    from driftlab.api.options import backend_spec as spec

    return spec(model, keywords_of("load"), **options)


def spec_of(backend: ChatBackend) -> BackendSpec:
    """What a run's manifest records about a backend: how `load` made it; for a backend built
    otherwise, its name (`memory:NAME` for a model handed over with `from_model`) and the dtype it
    computes in."""
    if backend in _SPECS:  # as loaded, with the directions it holds now (use_directions may have changed them)
        return _SPECS[backend].model_copy(update={"directions": _directions_of(backend)})
    facts = backend.describe()
    dtype = facts.get("dtype") if facts.get("dtype") in ("bfloat16", "float16", "float32") else "auto"
    memory = facts.get("source") == "memory"
    return BackendSpec(model=(MEMORY_PREFIX if memory else "") + str(backend.name), dtype=dtype,
                       directions=_directions_of(backend))


def _directions_of(backend: ChatBackend) -> str | None:
    """The spec's record of the directions a live backend holds: their folder, or `memory:` and
    their digest for directions without one (computed into a temporary run that is gone)."""
    held = getattr(backend, "directions", None)
    if held is None:
        return None
    if held.path is not None and directions_there(Path(held.path)):
        return str(held.path)
    return f"{MEMORY_PREFIX}{(held.digest or 'computed')[:16]}"


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
def selfchat(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
             user_backend: ChatBackend | None = None, **options: Any) -> Run:
    """The self-chat drift experiment (`driftlab run`) on `backend` (a loaded backend, a model
    name, or None for the default model).

    Your own system prompt without a persona file: `system=`, `probe=` and `measure=` (a measure
    id, `judge:model=...,rubric=...`, or any function `text -> [0, 1]`; `measure_params=` its
    parameters) make one agent persona, drawn against `pairs` random user personas.
    `personas=[dl.Persona(...)]` runs over several: they are the agents (users come from every
    persona); `agents=[...]` (ids or Personas) says which personas are agents instead. Other keywords are `driftlab run`'s options: pairs, pair ("agent:user", one or a list;
    with it, `pairs` defaults to 0 rather than 10), categories, rounds, max_new_tokens,
    probe_tokens, temperature, top_p, greedy, seed, steer, user_probe, ablation, probe_after,
    judge, batch_size, ...
    """
    from driftlab.api.options import selfchat_config
    from driftlab.protocol.selfchat import SelfChat
    from driftlab.report.metrics import summarize_run

    def make(spec: BackendSpec, backend: ChatBackend | None) -> SelfChat:
        return SelfChat(selfchat_config(spec, keywords_of("selfchat"), options), backend, user_backend)

    return _run(make, backend, out, progress, summarize_run)


def replay(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
           **options: Any) -> Run:
    """Real user turns replayed to `backend` under a system prompt, every agent turn scored (`driftlab
    replay`). Keywords: source ('sharegpt-chain', 'sharegpt', 'mtbench'; `driftlab data pull` first) or
    conversations (a JSONL file of your own), dialogs, rounds, max_words, categories, agents, your own
    persona (system, measure, measure_params), probes, probe_every, max_new_tokens, temperature, top_p,
    greedy, seed, steer, kl, batch_size. `run.summary` is the per-turn compliance frame."""
    from driftlab.api.options import replay_config
    from driftlab.protocol.replay import Replay
    from driftlab.report.replay import compliance_frame

    def make(spec: BackendSpec, backend: ChatBackend | None) -> Replay:
        return Replay(replay_config(spec, keywords_of("replay"), options), backend)

    return _run(make, backend, out, progress, compliance_frame)


def directions(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
               **options: Any) -> Run:
    """Persona directions in the residual stream (`driftlab directions`): keywords personas (ids), system
    (your own prompts), axis (also the Assistant Axis), prompts, starters, max_new_tokens, temperature,
    top_p, greedy, seed, batch_size; from_file and format (one direction from another tool's file,
    judged on the same replies), capping and experiment (the Assistant Axis's thresholds, for
    `cap:q=file`). `run.summary` is the `Directions` (per persona a direction per layer, its held-out
    AUROC and band); give `out` to keep them for `--directions` / `directions=`."""
    from driftlab.activation.directions import Directions
    from driftlab.api.options import directions_config
    from driftlab.protocol.directions import DirectionsProtocol

    return _run(lambda spec, be: DirectionsProtocol(directions_config(spec, keywords_of("directions"), options), be),
                backend, out, progress, Directions.load)


def mmlu(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
         **options: Any) -> Run:
    """MMLU accuracy at a turn of a dialog, plain and steered (`driftlab mmlu`): keywords n, steer,
    turn, turn_counting, histories, ties, history_tokens, seed, data, batch_size. Needs the questions
    once: `driftlab data pull mmlu`."""
    from driftlab.api.options import mmlu_config
    from driftlab.protocol.mmlu import MMLU
    from driftlab.protocol.mmlu import summarize as summarize_mmlu

    return _run(lambda spec, be: MMLU(mmlu_config(spec, keywords_of("mmlu"), options), be), backend, out, progress,
                summarize_mmlu)


def sweep(backend: ChatBackend | str | None = None, *, out: str | Path | None = None, progress: bool = True,
          **options: Any) -> Run:
    """Every method over a grid of strengths, stability against MMLU cost (`driftlab sweep`): keywords
    methods ("split-softmax,cfg": their default grids) or point (steer specs, one per point), pairs
    (the first N of the 20 ordered pairs of the sweep personas), personas, rounds, max_new_tokens,
    probe_tokens, mmlu_n, mmlu_turn, histories, ties, benchmark ("lm-eval:TASK"), seed, ...
    The summary is the sweep's table (one row per point, paired tests against plain with Holm)."""
    from driftlab.api.options import sweep_config
    from driftlab.protocol.sweep import Sweep
    from driftlab.report.sweep import sweep_table

    return _run(lambda spec, be: Sweep(sweep_config(spec, keywords_of("sweep"), options), be), backend, out, progress,
                sweep_table)


def calibrate(backend: ChatBackend | str | None = None, *, method: str, max_mmlu_drop: float,
              out: str | Path | None = None, progress: bool = True, **options: Any) -> Run:
    """The strongest setting of `method` (split-softmax, instaboost, cfg, spr) whose MMLU drop stays
    within `max_mmlu_drop` (`driftlab calibrate`): keywords steps, and MMLU's n, turn, turn_counting,
    histories, ties, history_tokens, seed, data. `run.summary["best"]["steer"]` is the spec to use
    (None when no setting fits the budget; `run.summary["note"]` says why)."""
    from driftlab.api.options import calibrate_config
    from driftlab.protocol.calibrate import Calibration, summary

    options = {"method": method, "max_mmlu_drop": max_mmlu_drop, **options}

    def make(spec: BackendSpec, backend: ChatBackend | None) -> Calibration:
        return Calibration(calibrate_config(spec, keywords_of("calibrate"), options), backend)

    return _run(make, backend, out, progress, summary)


def run(protocol: Protocol, *, out: str | Path | None = None, progress: bool = True) -> Run:
    """Any protocol object (a built-in's, or your own `Protocol` subclass) run to completion as the
    verbs above run theirs: resumable into `out`, results.json written, a `Run` returned (its
    summary: the `Results`)."""
    from driftlab.protocol.runner import Protocol

    if not isinstance(protocol, Protocol):
        raise DriftlabError(f"dl.run takes a protocol object, not {type(protocol).__name__} {protocol!r}.",
                            hint="e.g. dl.run(MMLU(MMLUConfig(...), backend)); for a built-in by name use dl.selfchat, "
                                 "dl.mmlu, dl.sweep or dl.calibrate.")
    return _run(lambda spec, be: protocol, BackendSpec(), out, progress, None)


def _run(make: Callable[[BackendSpec, ChatBackend | None], Any], backend: ChatBackend | BackendSpec | str | None,
         out: str | Path | None, progress: bool, summarize: Callable[[Path], Any] | None) -> Run:
    """Build the protocol on the backend, run it into `out` (or a temporary directory) and read it back;
    the Run's summary is `summarize`'s, or (None) its Results."""
    if backend is None or isinstance(backend, str):
        spec, backend = backend_spec(backend or DEFAULT_MODEL), None  # loaded by the protocol, after its checks
    elif isinstance(backend, BackendSpec):
        spec, backend = backend, None
    else:
        spec = spec_of(backend)
    protocol = make(spec, backend)
    with tempfile.TemporaryDirectory(prefix="driftlab-") as tmp:
        rundir = execute(protocol, out if out is not None else Path(tmp) / "run", progress=progress)
        found = read_results(rundir.path)
        return Run(protocol.name, rundir.path if out is not None else None, rundir.read_manifest(),
                   rundir.records(), found if summarize is None else summarize(rundir.path), found)
