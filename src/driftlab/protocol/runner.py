"""One way to run a protocol into a run directory: `run_protocol(protocol, out)`.

A protocol (self-chat, MMLU, a sweep, a PASTA evaluation, ...) says what is specific to it:

    name, config, records     what it is called, what defines it, what it writes
    check()                   cheap checks of what a new plan is drawn from (before any lock)
    connect(run_dir)          its backend(s) (loaded here unless given), capability checks
    plan()                    what it draws from data for a new run (pairs, questions, examples)
    inputs()                  hashes of that data, so a resume can say the data changed
    describe()                run facts recorded beside the plan (models, interventions)
    expected(manifest)        how many records of each kind a complete run holds
    units(state)              the work still to do, read from the recorded plan
    run_unit(unit)            do one unit: its finished records
    finish(state)             files derived from the records (a profile, a ranking)

and `run_protocol` does the rest the same way for all: it takes the run directory's lock
before anything expensive, writes the manifest of a new run or checks the config of an
existing one, continues a resumed run from the plan in its manifest (never from data as it
is now), skips every record already written, appends each unit's records durably, refuses a
record twice, shows progress, and marks the run completed. Units may be produced lazily:
a self-chat's round i+1 is planned after round i has run.

A protocol that runs others (an MMLU run's dialog history, a sweep's points) calls
`run_protocol` on them with `plan=`: the children continue the parent's recorded plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter

from driftlab.bench.probes import PROBE_VERSION_ALIASES
from driftlab.chat.base import ChatBackend
from driftlab.chat.spec import VLLM_REFUSED, BackendSpec
from driftlab.console import WorkProgress, err_console
from driftlab.errors import DriftlabError
from driftlab.records.rundir import RunDir


class ProtocolConfig(BaseModel):
    """What every protocol's config holds: the backend it runs on (recorded in the manifest)."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendSpec = BackendSpec()

    # Settings that may change between a run and its resume: they do not change results.
    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ("backend.device", "backend.device_map", "backend.decode",
                                                 "backend.runtime")
    # Settings added after runs were recorded without them -> what such a run meant (dotted names);
    # a resume compares them as recorded, so a changed default cannot change an old run's meaning.
    LEGACY: ClassVar[dict[str, Any]] = {}


def directions_given(backend: BackendSpec, steers: Iterable[Any]) -> None:
    """A config's check: residual-stream steers (vector, cap) and a gate by projection need the
    backend's persona directions, and a vllm: model refuses the kinds vLLM cannot apply.
    Raised in a config validator, so a run without them stops in one line before anything loads."""
    steers = list(steers)
    if backend.vllm:
        refused = sorted({s.kind for s in steers} & VLLM_REFUSED.keys())
        if refused:
            raise ValueError(f"{backend.model} cannot apply --steer {refused[0]}: {VLLM_REFUSED[refused[0]]}; "
                             "run it on the transformers engine (drop 'vllm:')")
    kinds = sorted({s.kind for s in steers if getattr(s, "hook", None) == "residual"}
                   | {"when-drifting:by=projection" for s in steers if getattr(s, "by", None) == "projection"})
    if kinds and not backend.directions:
        raise ValueError(f"--steer {', '.join(kinds)} needs persona directions, and none were given: compute them "
                         "with `driftlab directions --out DIR`, then pass --directions DIR")


#: Choices renamed since runs recorded them: top-level setting -> {recorded name: today's name}.
#: `config_of` reads a recorded config with today's names and a resume compares them so, so a run
#: recorded under an old name resumes (and a sweep's old points compare equal to new ones).
RENAMED: dict[str, Mapping[Any, Any]] = {"user_probe_version": PROBE_VERSION_ALIASES}

C = TypeVar("C", bound=ProtocolConfig)


@dataclass
class RunState:
    """A run directory being written: its manifest (with the plan), records and their keys."""

    rundir: RunDir
    manifest: dict[str, Any]
    records: list[Any]
    done: set[tuple] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.done = {r.key for r in self.records}

    def add(self, records: list[Any]) -> None:
        """Append finished records durably; a key written before is a bug, never a duplicate."""
        keys = [r.key for r in records]
        twice = [k for k in keys if k in self.done] or [k for k in set(keys) if keys.count(k) > 1]
        if twice:
            raise RuntimeError(f"record {twice[0]} would be written twice to {self.rundir.path}")
        self.rundir.append(records)
        self.records += records
        self.done.update(keys)


class Protocol(ABC, Generic[C]):
    """A unit-of-work protocol run by `run_protocol` (see the module docstring)."""

    name: ClassVar[str]
    records: ClassVar[TypeAdapter]  # the record schema (each record has a `.key`)
    unit: ClassVar[str] = "records"  # what the progress bar counts

    def __init__(self, config: C, backend: ChatBackend | None = None) -> None:
        self.config = config
        self.backend = backend  # loaded by `connect` unless given (a sweep shares one)
        self.progress = True  # set by run_protocol, with the run directory being written:
        self.run_dir = Path()  # where runs of other protocols nest (an MMLU run's dialog history)

    @property
    def label(self) -> str:
        return self.name

    @classmethod
    def config_type(cls) -> type[ProtocolConfig]:
        """The config class this protocol runs on: the `C` of `class X(Protocol[C])`."""
        for klass in cls.__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                args = get_args(base)
                origin = get_origin(base)
                if isinstance(origin, type) and issubclass(origin, Protocol) and args and isinstance(args[0], type):
                    return args[0]
        raise TypeError(f"{cls.__name__} does not say its config: declare it as `class {cls.__name__}(Protocol[MyConfig])`")

    # -- before the lock ---------------------------------------------------------------------
    def check(self) -> None:
        """Cheap checks of what a new run's plan is drawn from (data present, ids known), before
        anything is locked, created or loaded, so a bad option leaves nothing behind. Not
        called on a resume, nor for a run given its plan: those continue a recorded plan,
        whatever became of the data."""

    # -- after the lock ----------------------------------------------------------------------
    def connect(self, run_dir: Path) -> None:
        """Load the backend the config names (unless one was given) and check what it can do."""
        if self.backend is None:
            from driftlab.chat.factory import make_backend

            self.backend = make_backend(self.config.backend, run_dir=run_dir)
        self.require()

    def require(self) -> None:
        """Refuse, in one line, a backend that cannot run this protocol."""

    def plan(self) -> dict[str, Any]:
        """What a new run draws from data (recorded in the manifest; a resume continues it)."""
        return {}

    def inputs(self) -> dict[str, str]:
        """sha256 of the data the plan is drawn from, keyed by data set."""
        return {}

    def draw_plan(self) -> dict[str, Any]:
        """The plan with the hashes of its inputs: what a new manifest (or a parent) records."""
        return {**self.plan(), "inputs": self.inputs()}

    def describe(self) -> dict[str, Any]:
        """Run facts recorded beside the plan (not drawn from data, so never handed to children)."""
        return {"models": {"agent": self.backend.describe()}}

    def ran(self) -> dict[str, Any]:
        """Facts known only once the work is done, recorded in the manifest at completion (`ran`):
        e.g. the decode loop that really ran and the graphs it compiled (`HFChatBackend.ran`).
        Reflects the session that completed the run."""
        backend = getattr(self, "backend", None)
        facts = getattr(backend, "ran", None)
        return {"agent": facts()} if callable(facts) else {}

    @classmethod
    @abstractmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        """Record kind -> how many a complete run of this manifest holds."""

    @abstractmethod
    def units(self, state: RunState) -> Iterable[Any]:
        """The work still to do, from the recorded plan (`state.manifest`) minus `state.done`."""

    @abstractmethod
    def run_unit(self, unit: Any) -> list[Any]:
        """Do one unit of work; return its finished records."""

    def finish(self, state: RunState) -> None:
        """Write what is derived from the complete records (a profile, a ranking, a summary)."""

    @classmethod
    def report(cls, run_dir: Path) -> list[Path]:
        """Draw this protocol's figures of a run directory; the files written. `driftlab report`
        calls it for a protocol it has no report of its own for (a plugin's); none by default."""
        return []


def run_protocol(protocol: Protocol, out: str | Path | RunDir, *, plan: dict[str, Any] | None = None,
                 progress: bool = True) -> RunDir:
    """Run (or resume) `protocol` into the run directory `out` and return it.

    `plan` is the plan of a new run drawn by a parent protocol (default: `protocol.draw_plan()`);
    a run that exists continues the plan its manifest recorded.
    """
    rundir = out if isinstance(out, RunDir) else RunDir(out)
    protocol.progress, protocol.run_dir = progress, rundir.path
    if plan is None and not rundir.exists():  # a plan to draw here, from data that must be there
        protocol.check()
    with rundir.writing():
        protocol.connect(rundir.path)
        manifest = _start(protocol, rundir, plan)
        state = RunState(rundir, manifest, rundir.records(protocol.records))
        todo = max(0, sum(protocol.expected(manifest).values()) - len(state.done))
        with WorkProgress(protocol.label, todo, progress and todo > 0, unit=protocol.unit) as bar:
            for unit in protocol.units(state):
                new = protocol.run_unit(unit)
                state.add(new)
                bar.advance(len(new))
        protocol.finish(state)
        ran = protocol.ran()
        rundir.update_manifest(completed=True, **({"ran": ran} if ran else {}))
    return rundir


def _start(protocol: Protocol, rundir: RunDir, plan: dict[str, Any] | None) -> dict[str, Any]:
    """Write the manifest of a new run, or check the config of an existing one; return it."""
    config = protocol.config.model_dump(mode="json")
    ignore = protocol.config.RESUME_IGNORES
    if rundir.exists():
        recorded = rundir.read_manifest()
        config = _named_as_recorded(_pinned_as_recorded(_dtype_as_recorded(config, recorded), recorded), recorded)
        legacy = getattr(protocol.config, "LEGACY", {})
        manifest = rundir.start(config, {}, ignore, protocol=protocol.name, legacy=legacy)
        _same_weights(rundir.path, manifest, protocol)
        _same_dtype(rundir.path, manifest, protocol)
        try:
            now = protocol.inputs()
        except (DriftlabError, OSError):  # the data is gone: the recorded plan is all the run needs
            now = {}
        changed = [k for k, v in now.items() if manifest.get("inputs", {}).get(k) not in (None, v)]
        if changed and protocol.progress:
            err_console().print(
                f"note: the {' and '.join(changed)} changed since {rundir.path} started; it continues with the plan "
                "recorded in its manifest.", highlight=False, markup=False)
        return manifest
    fresh = plan if plan is not None else protocol.draw_plan()
    return rundir.start(config, {**fresh, **protocol.describe()}, ignore, protocol=protocol.name)


def _same_weights(path: Path, manifest: dict[str, Any], protocol: Protocol) -> None:
    """Refuse to resume a run on other weights than it started with: a Hub model whose
    branch moved (a new commit pulled into the cache) would mix two models in one run."""
    recorded = manifest.get("models") or {}
    if not any(isinstance(m, dict) and m.get("hub") for m in recorded.values()):
        return
    now = protocol.describe().get("models") or {}
    for role, old in recorded.items():
        before = (old or {}).get("hub") or {}
        after = (now.get(role) or {}).get("hub") or {}
        if before.get("sha") and before.get("sha") != after.get("sha"):
            found = f"commit {after['sha']}" if after.get("sha") else "weights that are not that snapshot"
            pin = f"Resume with --model {before.get('id')}@{before['sha']} (the recorded commit), or start" \
                if role == "agent" else "Start"
            raise DriftlabError(
                f"{path} was run on {before.get('id')} at commit {before['sha']} ({role} model), but "
                f"{before.get('requested', before.get('id'))} now loads {found}.",
                hint=f"{pin} a new --out directory for the new weights.",
            )


def recorded_dtype(manifest: dict[str, Any]) -> str | None:
    """The dtype the run's (agent) model computed in, as its manifest recorded it."""
    return ((manifest.get("models") or {}).get("agent") or {}).get("dtype")


def _dtype_as_recorded(config: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """`--dtype X` on the resume of a run started as `--dtype auto` that resolved to X is the same
    dtype: compare it as recorded. (`auto` depends on the machine: bf16 where the CPU has native
    bf16, float32 elsewhere.)"""
    old = (config_of(manifest).get("backend") or {}).get("dtype")
    new = (config.get("backend") or {}).get("dtype")
    if old == "auto" and new != "auto" and new == recorded_dtype(manifest):
        return {**config, "backend": {**config["backend"], "dtype": "auto"}}
    return config


def _same_dtype(path: Path, manifest: dict[str, Any], protocol: Protocol) -> None:
    """Refuse to resume a run in another dtype than it started in (`--dtype auto` resolves by
    machine): its records would mix two precisions."""
    before = recorded_dtype(manifest)
    after = recorded_dtype({"models": protocol.describe().get("models") or {}})
    if before and after and before != after:
        raise DriftlabError(f"{path} was computed in {before}, and this resume would compute in {after} "
                            "(--dtype auto picks by machine).",
                            hint=f"Resume with --dtype {before}, or start a new --out directory.")


def _pinned_as_recorded(config: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """`--model ID@SHA` on the resume of a run started as `--model ID` that recorded commit SHA
    is the same model: compare it as recorded (and so continue on exactly those weights)."""
    old = (config_of(manifest).get("backend") or {}).get("model")
    hub = ((manifest.get("models") or {}).get("agent") or {}).get("hub") or {}
    new = (config.get("backend") or {}).get("model")
    if old and hub.get("sha") and new == f"{old}@{hub['sha']}":
        return {**config, "backend": {**config["backend"], "model": old}}
    return config


def _named_as_recorded(config: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """A choice recorded under its old name (`RENAMED`: user_probe_version '000' is 'own') is the
    choice given now: compare it as recorded. The manifest keeps what it recorded."""
    recorded = manifest.get("config") or {}
    return {k: recorded[k] if k in RENAMED and k in recorded and _renamed(k, recorded[k]) == v else v
            for k, v in config.items()}


def _renamed(key: str, value: Any) -> Any:
    """Today's name of a recorded value of the setting `key` (`RENAMED`); other values as recorded."""
    names = RENAMED.get(key) or {}
    return names.get(value, value) if isinstance(value, str) else value


def config_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's config in today's layout and names: format-2 manifests kept the model settings
    flat; choices renamed since (`RENAMED`) read as today's names."""
    config = dict(manifest.get("config") or {})
    if "backend" not in config and "model" in config:
        backend = {k: config.pop(k) for k in ("model", "dtype", "device", "span", "runtime") if k in config}
        config = {"backend": backend, **config}
    return {k: _renamed(k, v) for k, v in config.items()}
