"""Precompiled decode steps: a graph compiled once per machine, not once per process.

Why: a new process whose inductor cache hits still spends its compile time in dynamo, tracing
the model again (40 s for two Llama-2-7B graphs on an H100: docs/performance.md). torch's
`aot_compile` saves what dynamo made, so a later process loads it instead (the tiny shape on a
CPU: 7.4 s against 13.4 s for the process, no graph traced; benchmarks/precompile.py).

What a saved artifact checks by itself is little: only tensor metadata, dynamic-shape facts and
torch's global state survive saving (`torch.compiler.keep_portable_guards_unsafe`); dynamo's
other guards (a Python value the trace read, a module's hooks, a class) are dropped. driftlab
makes up for each dropped guard by construction, so an artifact never runs where its trace
does not hold:
* every dropped guard on a call's arguments (the attention state's flags, the cache's layout,
  `use_cache`) becomes a check stored beside the artifact: the value's fingerprint at compile
  time, compared on every call (`fingerprint`, `resolve`);
* every dropped guard on the model, its classes or module globals is covered by the key the
  artifacts are stored under (`Artifacts._base`): torch's, transformers' and driftlab's code (a
  hash of driftlab's sources), the model's class, config, dtype, device and hooks, the attention
  kernel setting and the compile options;
* a dropped guard of another kind, or a value with no fingerprint, keeps that graph out of the
  store: the process compiles it as before (`torch.compile`), said once.

`DRIFTLAB_PRECOMPILED`: 1 on, 0 off; unset, on for compiled decoding except on CUDA, where
whether CUDA graphs survive a load is not yet measured (pytorch/pytorch#155703).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "DRIFTLAB_PRECOMPILED"
# Guards an artifact keeps (keep_portable_guards_unsafe's choice): checked by the artifact itself.
_PORTABLE = ("GLOBAL_STATE", "SHAPE_ENV")
# Dropped guards whose subject the store's key covers: the model and its submodules (class,
# config, hooks), classes and module globals (code versions), torch's global modes (GLOBAL_STATE).
# A module global's value (G[...], anywhere in the source) is code: the versions cover it.
_COVERED = re.compile(r"^(model\b|dict\(type\(|type\(|args$|$)|G\[")
# Dropped guards on a value's type or attributes, not its value (a cache's length is dynamic).
_TYPE_GUARDS = ("TYPE_MATCH", "HASATTR", "NOT_PRESENT_IN_GENERIC_DICT", "CLASS_MATCH")
# Artifacts stored per key, at most: past it a check varies with every call, so the store would grow.
MAX_VARIANTS = 8
_PATH = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']+)'\]")
_MARKS = ("_has_dynamo_dim_marking", "_dynamo_static_indices")


def setting() -> str:
    """DRIFTLAB_PRECOMPILED: "1", "0" or "" (unset: auto); anything else is one line, raised when a
    compiled decoder is made, before any work."""
    from driftlab.errors import DriftlabError

    value = os.environ.get(ENV, "").strip()
    if value not in ("", "1", "0"):
        raise DriftlabError(f"{ENV}={os.environ[ENV]!r} is not 1 or 0.",
                            hint=f"Set {ENV}=1 to precompile decode steps, 0 not to, or leave it unset (auto).")
    return value


def wanted(device: torch.device, options: dict[str, Any]) -> bool:
    """Whether compiled steps go through the store on `device` under torch.compile's `options`
    (DRIFTLAB_PRECOMPILED; inductor only: another backend's graphs cannot be saved)."""
    setting_ = setting()
    if options.get("backend", "inductor") != "inductor" or setting_ == "0":
        return False
    return setting_ == "1" or device.type != "cuda"


def decode_forward(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The function compiled: module-level, with no closure. Compiling `model.forward` itself
    fails to save: transformers' decorator closes over `func`, a guard no new process can bind."""
    return model.forward(*args, **kwargs)


@functools.cache
def source_hash() -> str:
    """A hash of driftlab's own Python sources: a trace reads driftlab's code, whose version
    number does not change with every edit of a checkout."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(value: Any, depth: int = 0) -> str | None:
    """A string equal for values a trace cannot tell apart through a dropped guard (None: no
    fingerprint, so the guard cannot be checked). Tensors are the artifact's own guards' business."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, (torch.dtype, torch.device)):
        return repr(value)
    if depth > 3:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) > 512:
            return None
        items = [fingerprint(v, depth + 1) for v in value]
        return None if None in items else f"{type(value).__name__}[{','.join(items)}]"
    if isinstance(value, dict):
        return f"dict{sorted(map(str, value))}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def resolve(name: str, kwargs: dict[str, Any]) -> Any:
    """The value a guard's source names (`kwargs['driftlab'].lean`, `kwargs['past_key_values'].layers[0]`).
    Raises LookupError where the call has no such value, AttributeError where an object lacks it."""
    if name == "kwargs":
        return kwargs
    value: Any = kwargs
    rest = name.removeprefix("kwargs")
    if rest == name:
        raise LookupError(name)
    while rest:
        m = _PATH.match(rest)
        if m is None:
            raise LookupError(name)
        attr, index, key = m.groups()
        value = getattr(value, attr) if attr else value[int(index)] if index else value[key]
        rest = rest[m.end():]
    return value


def checkable(check: str, kwargs: dict[str, Any]) -> str | None:
    """The fingerprint a check (`KIND SOURCE`: a dropped guard's kind and source) compares, or None
    where it cannot be had: `type` for a guard on the value's type or attributes, `len` for a
    sequence's length, `value` for the rest (a constant, an equality, an identity)."""
    kind, name = check.split(" ", 1)
    try:
        value = resolve(name, kwargs)
    except (LookupError, AttributeError, IndexError, KeyError, TypeError):
        return None
    if kind == "type":
        return f"{type(value).__module__}.{type(value).__qualname__}"
    if kind == "len":
        return f"len:{len(value)}" if hasattr(value, "__len__") else None
    return fingerprint(value)


def check_of(guard_type: str, name: str) -> str:
    """The check standing in for a dropped guard: its kind (see `checkable`) and source."""
    kind = "type" if guard_type in _TYPE_GUARDS else "len" if guard_type == "SEQUENCE_LENGTH" else "value"
    return f"{kind} {name}"


def checks_hold(checks: dict[str, str], kwargs: dict[str, Any]) -> bool:
    """Whether a call's values match those an artifact was traced with."""
    return all(checkable(check, kwargs) == want for check, want in checks.items())


def classify(entries: list, kwargs: dict[str, Any]) -> tuple[list[bool], dict[str, str], list[str]]:
    """Sort a trace's guards (torch's GuardFilterEntry) for saving: which the artifact keeps
    (portable ones), the checks that stand in for dropped guards on the call's arguments (with
    their fingerprints for this call), and the dropped guards nothing covers."""
    keep, checks, uncovered = [], {}, []
    for g in entries:
        portable = g.guard_type in _PORTABLE or (g.guard_type == "TENSOR_MATCH" and not g.is_global)
        keep.append(portable)
        if portable or _COVERED.search(g.name) and not g.name.startswith("kwargs"):
            continue
        check = check_of(g.guard_type, g.name)
        want = checkable(check, kwargs)
        if want is None:
            uncovered.append(f"{g.guard_type} on {g.name}")
        else:
            checks[check] = want
    return keep, checks, uncovered


class Uncovered(Exception):
    """A dropped guard neither a check nor the store's key covers: the graph stays in-process."""


def _module_globals(refs: list[str]) -> dict[str, Any]:
    """Dynamo's generated module globals (`___module_<name>_<id>_c<n>`), bound to the modules."""
    found = {}
    for ref in refs:
        m = re.fullmatch(r"___module_(.+)_\d+_c\d+", ref)
        parts = m.group(1).split("_") if m else []
        for name in (".".join(parts), "_".join(parts)):
            try:
                found[ref] = importlib.import_module(name)
                break
            except ImportError:
                continue
    return found


def load(path: Path) -> Callable:
    """A saved artifact, the module globals its bytecode names bound (load_compiled_function
    names the missing ones in its error, a set per attempt)."""
    scope = dict(decode_forward.__globals__)
    for _ in range(8):
        try:
            with path.open("rb") as f:
                return torch.compiler.load_compiled_function(f, f_globals=scope)
        except RuntimeError as err:
            refs = re.findall(r"'(___module_[^']+)'", str(err))
            if not refs:
                raise
            scope.update(_module_globals(refs))
    raise RuntimeError(f"could not bind the module globals of {path}")


def _aot_options(options: dict[str, Any], on_guards: Callable) -> dict[str, Any]:
    """torch.compile's options for aot_compile: the guard filter, and `mode` as inductor options
    (torch.compile takes a mode or options, not both)."""
    options = dict(options)
    inductor: dict[str, Any] = {"guard_filter_fn": on_guards}
    if options.pop("mode", None) == "reduce-overhead":
        inductor["triton.cudagraphs"] = True
    return {**options, "options": inductor}


def _config(model: Any) -> dict[str, Any]:
    """The model's config as the key holds it: every value but the metadata saving a model writes
    (where it was loaded from, its class names, the transformers version: no trace reads them, and
    a model saved and loaded again is the same model)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    for name in ("_name_or_path", "architectures", "transformers_version"):
        config.pop(name, None)
    return config


class _Unmarked:
    """mark_static's attributes off the call's tensors while a loaded artifact runs (its guard
    refuses a marked tensor), back on after (the decoder marks each cache once)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        layers = getattr(kwargs.get("past_key_values"), "layers", [])
        tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        tensors += list(kwargs.values())
        self.saved = [(t, a, getattr(t, a)) for t in tensors if isinstance(t, torch.Tensor)
                      for a in _MARKS if hasattr(t, a)]

    def __enter__(self) -> None:
        for t, attr, _ in self.saved:
            delattr(t, attr)

    def __exit__(self, *exc: object) -> None:
        for t, attr, value in self.saved:
            setattr(t, attr, value)


class Artifacts:
    """One decoder's precompiled steps, called in place of its torch.compile'd forward: per call,
    the stored artifact whose checks hold (loaded once per process), else one aot-compiled now
    and saved. A graph the store cannot hold safely (`Uncovered`), or an artifact that fails to
    save or load, runs through `fallback` (the process's torch.compile) from then on."""

    def __init__(self, model: Any, options: dict[str, Any], fallback: Callable, root: Path) -> None:
        self.model, self.options, self.fallback, self.root = model, options, fallback, root
        self.variants: dict[str, list[tuple[dict[str, str], Callable]]] = {}
        self._facts: dict[str, str] = {}  # each key's facts, written beside its index (`<key>.key.json`)
        self.loaded = self.saved = 0
        self.load_s = self.compile_s = 0.0
        self.refused: str | None = None
        device = model.device
        from importlib.metadata import version

        self._fixed = json.dumps({  # what a call cannot change, serialised once (the key is made every step)
            "versions": [torch.__version__, version("transformers"), source_hash()],
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": _config(model), "dtype": str(model.dtype), "device": device.type,
            "capability": torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            "options": repr(sorted(options.items())),
        }, sort_keys=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.refused is None:
            try:
                step = self._pick(args, kwargs)
            except Exception as err:  # noqa: BLE001 - any failure to save or load: compile in-process
                self._refuse(err)
            else:
                with _Unmarked(kwargs):
                    return step(self.model, *args, **kwargs)
        return self.fallback(*args, **kwargs)

    def ran(self) -> dict[str, Any]:
        """What the store did, for the decoder's `ran`: artifacts loaded and saved, seconds."""
        facts: dict[str, Any] = {"loaded": self.loaded, "saved": self.saved, "load_s": round(self.load_s, 2),
                                 "compile_s": round(self.compile_s, 2), "store": str(self.root)}
        if self.refused:
            facts["refused"] = self.refused
        return facts

    def _refuse(self, err: Exception) -> None:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        self.refused = f"{type(err).__name__}: {first}"[:300]
        logger.warning("precompiled decode steps: %s; this process compiles its steps itself (torch.compile)",
                       self.refused)

    def _base(self, args: tuple, kwargs: dict[str, Any]) -> str:
        """The store's key for a call: all that shapes a trace and no artifact check covers."""
        from torch.nn.modules import module as nn_module

        model = self.model
        hooks = [i for i, m in enumerate(model.modules())
                 if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._state_dict_hooks]
        facts = {
            "attention": getattr(model.config, "_attn_implementation", None), "hooks": hooks,
            "global_hooks": [len(nn_module._global_forward_hooks), len(nn_module._global_forward_pre_hooks)],
            "kernel": os.environ.get("DRIFTLAB_ATTENTION_KERNEL"), "args": len(args), "kwargs": sorted(kwargs),
            "tensors": {k: [str(v.dtype), v.dim(), v.shape[0]] for k, v in kwargs.items() if isinstance(v, torch.Tensor)},
        }
        text = f'{{"fixed": {self._fixed}, "call": {json.dumps(facts, sort_keys=True)}}}'
        base = hashlib.sha256(text.encode()).hexdigest()[:24]
        self._facts[base] = text
        return base

    def _pick(self, args: tuple, kwargs: dict[str, Any]) -> Callable:
        base = self._base(args, kwargs)
        if base not in self.variants:
            self.variants[base] = self._stored(base)
        for checks, step in self.variants[base]:
            if checks_hold(checks, kwargs):
                return step
        if len(self.variants[base]) >= MAX_VARIANTS:
            raise Uncovered(f"{MAX_VARIANTS} artifacts of one step differ in {self._varying(base, kwargs)}: "
                            "a value that changes call by call would grow the store without end")
        checks, step = self._compile(base, args, kwargs)
        self.variants[base].append((checks, step))
        return step

    def _varying(self, base: str, kwargs: dict[str, Any]) -> str:
        """A check the stored artifacts of `base` and this call disagree on."""
        for checks, _ in self.variants[base]:
            for check, want in checks.items():
                if checkable(check, kwargs) != want:
                    return check.split(" ", 1)[1]
        return "no check"

    def _index(self, base: str) -> Path:
        return self.root / f"{base}.json"

    def _stored(self, base: str) -> list[tuple[dict[str, str], Callable]]:
        """The artifacts stored under `base`, loaded."""
        index = self._index(base)
        if not index.is_file():
            return []
        found = []
        for entry in json.loads(index.read_text()):
            path = self.root / entry["file"]
            if path.is_file():
                start = time.perf_counter()
                found.append((entry["checks"], load(path)))
                self.load_s += time.perf_counter() - start
                self.loaded += 1
        return found

    def _compile(self, base: str, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, str], Callable]:
        """aot_compile the step for this call, and store it with its checks."""
        found: dict[str, Any] = {}

        def on_guards(entries: list) -> list[bool]:
            keep, checks, uncovered = classify(entries, kwargs)
            found.update(checks=checks, uncovered=uncovered)
            return keep

        start = time.perf_counter()
        compiled = torch.compile(decode_forward, **_aot_options(self.options, on_guards))
        step = compiled.aot_compile(((self.model, *args), kwargs))
        self.compile_s += time.perf_counter() - start
        if found["uncovered"]:
            raise Uncovered(f"a guard driftlab cannot check ({found['uncovered'][0]}) keeps this graph out of the store")
        self._save(base, found["checks"], step)
        return found["checks"], step

    def _save(self, base: str, checks: dict[str, str], step: Any) -> None:
        """Write the artifact, then list it in the key's index (each replaced whole, atomically:
        a process reading meanwhile sees the old index or the new one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{base}-{hashlib.sha256(json.dumps(checks, sort_keys=True).encode()).hexdigest()[:12]}.aot"
        with tempfile.NamedTemporaryFile(dir=self.root, delete=False, suffix=".part") as f:
            tmp = f.name
        step.save_compiled_function(tmp)
        os.replace(tmp, self.root / name)
        index = self._index(base)
        entries = json.loads(index.read_text()) if index.is_file() else []
        entries = [e for e in entries if e["file"] != name] + [{"file": name, "checks": checks}]
        with tempfile.NamedTemporaryFile("w", dir=self.root, delete=False, suffix=".part") as f:
            json.dump(entries, f)
        os.replace(f.name, index)
        (self.root / f"{base}.key.json").write_text(self._facts[base])  # what the key holds, for people
        self.saved += 1
