"""Precompiled decode steps: a probe for the target of at most 10 s of compiling in a new process.

It precompiles driftlab's decode step with torch 2.13's experimental `aot_compile`, saves one
artifact per graph key, and loads them in a new process instead of dynamo re-tracing the model.
Re-tracing is what a new process still pays once inductor's and AOTAutograd's caches hit: 18 s per
steered 7B graph on an H100 (docs/performance.md), about 8 s for the tiny shape's two graphs on a
CPU (compile_warm below). A probe, not a feature: driftlab does not precompile yet.

`python benchmarks/run.py precompile`; PRECOMPILE_DEVICE=cuda for a GPU; PRECOMPILE_SHAPE=tiny
(default), qwen2.5-7b or llama2-7b (gpu.py's shapes, built on the device with the same seeded
random weights in each process); the tokenizer from GPUBENCH_TOKENIZER or the pulled SmolLM2.
Four phases, each a process, one after another:
  1. compile_cold: torch.compile as driftlab does today, empty caches;
  2. compile_warm: the same again, inductor's and AOTAutograd's caches on disk (today's second process);
  3. aot_compile: aot_compile per graph key, each artifact saved;
  4. aot_load: a new process that loads the artifacts.
Each chats plain and with three steers at two prompt lengths (batch 2). RESULT lines: per phase the
process's wall, the graphs traced, the compile seconds, and whether its greedy tokens equal phase 1's;
then a fifth process runs a model of other weights through the artifacts, against the dynamic loop.
On CUDA the step takes driftlab's CUDA options (mode reduce-overhead): whether CUDA graphs survive
aot_compile and a load is the open question (pytorch/pytorch#155703 on GitHub). Each phase says
how many CUDA graphs its steps recorded (`ran()`'s cudagraph_recordings: none on a CPU) and then
times a plain call of 32 tokens on the warmed step (ms/token): on CUDA, aot_load recording graphs
and decoding as fast as compile_warm is the answer yes.

What the CPU said (docs/results/bench/precompile-cpu.txt: 2026-11-27, a 2-core AMD EPYC with
AVX-512, torch 2.13.0+cpu, the tiny shape in float32, one run): the new process that loads the
artifacts took 8.1 s, tracing no graph (1.93 s and 0.10 s to load the plain and steered keys),
against 13.5 s for today's second process (7.69 s of it re-tracing 2 graphs). Greedy tokens were
the same in all four phases: plain, InstABoost, split-softmax, and both with pi tracing, at two
prompt lengths (one artifact per key serves every cache length; the length stays symbolic). And
the loaded artifacts run a model of other weights as the dynamic loop does (RESULT
aot_other_weights.*): the parameters are graph inputs, not constants.
What it took, each found by a failure:
  * a module-level wrapper `decode_forward(model, *args, **kwargs)` (compiling `model.forward`
    itself fails: transformers' decorator closes over `func`, a guard source no new process has);
  * `specialize_float=True` around aot_compile (else TensorifyScalarRestartAnalysis escapes);
  * `guard_filter_fn=torch.compiler.keep_portable_guards_unsafe` (ID_MATCH and CLOSURE_MATCH guards
    cannot be serialized). So the artifact checks little: the key under which it is stored must
    say everything that shapes the trace (model config, dtype, device, attention implementation,
    driftlab's traced code, batch bucket, steered, bias slots, residual state, compile options);
  * loading with `f_globals` holding dynamo's generated module globals (`___module_<name>_<id>_c0`,
    e.g. `collections`), bound here by importing the named module;
  * before calling a loaded artifact, dropping mark_static's attributes from the tensors driftlab marks
    (`_has_dynamo_dim_marking`, `_dynamo_static_indices`): its guard refuses a marked tensor.
Dead ends, same machine and versions:
  * dynamo's caching precompile (TORCH_CACHING_PRECOMPILE=1 + torch.compiler.save_cache_artifacts):
    on `model.forward` the closure guard above; with a wrapper it loads one graph (16 s -> 0.0 s),
    but two graphs of one function crash at load ("Name '__builtins_dict___N' already exists in
    scope"), and per-key wrapper copies load yet still re-trace.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import Result


def decode_forward(model, *args, **kwargs):
    """The compiled function: module-level, no closure (see the docstring)."""
    return model.forward(*args, **kwargs)


def module_globals(refs: list[str]) -> dict:
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
    """A saved artifact, its missing module globals bound (load_compiled_function names them in
    its error, one set per attempt)."""
    scope = dict(decode_forward.__globals__)
    for _ in range(5):
        try:
            with path.open("rb") as f:
                return torch.compiler.load_compiled_function(f, f_globals=scope)
        except RuntimeError as err:
            refs = re.findall(r"'(___module_[^']+)'", str(err))
            if not refs:
                raise
            scope.update(module_globals(refs))
    raise RuntimeError(f"could not bind the external references of {path}")


def unmark(kwargs: dict) -> None:
    """Drop mark_static's attributes (driftlab's `_call` marks the cache and, with a static batch,
    the row inputs): a loaded artifact's guard refuses a marked tensor."""
    layers = getattr(kwargs.get("past_key_values"), "layers", [])
    tensors = [t for layer in layers for t in (layer.keys, layer.values)]
    tensors += [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        for attr in ("_has_dynamo_dim_marking", "_dynamo_static_indices"):
            if hasattr(t, attr):
                delattr(t, attr)


def aot_options(options: dict) -> dict:
    """driftlab's torch.compile options for aot_compile: portable guards only (others cannot be
    saved), and `mode` as inductor options, since torch.compile takes a mode or options, not both."""
    options = dict(options)
    inductor = {"guard_filter_fn": torch.compiler.keep_portable_guards_unsafe}
    if options.pop("mode", None) == "reduce-overhead":
        inductor["triton.cudagraphs"] = True
    return {**options, "options": inductor}


def precompile_calls(store: Path, seen: dict) -> None:
    """Make every StaticDecoder call its step through one aot-compiled (or loaded) artifact per graph
    key instead of its torch.compile'd forward, which is then never traced. The decoder's own
    `_call` still marks the inputs and patches dynamo's configs around the call."""
    import driftlab.chat.static_decode as sd
    from driftlab.activation.state import KWARG as RESIDUAL_KWARG

    marked_call = sd.StaticDecoder._call

    def artifact(self, args: tuple, kwargs: dict) -> Callable:
        # driftlab's graph key (HFChatBackend._static_step): batch bucket, steered, bias slots,
        # residual state; the model, dtype, device and code are this process's own.
        state = kwargs.get("driftlab")
        slots = state.bias_heads.shape[0] if state is not None and not state.lean else 0
        residual = "_res" if RESIDUAL_KWARG in kwargs else ""
        key = f"b{kwargs['input_ids'].shape[0]}_{f'steered{slots}' if slots else 'plain'}{residual}"
        held = self.__dict__.setdefault("_artifacts", {})
        if key not in held:
            path, start = store / f"{key}.aot", time.perf_counter()
            if path.exists():
                held[key], how = load(path), "load"
            else:
                options = {k: v for k, v in self._options().items() if k != "static_batch"}
                with torch._dynamo.config.patch(specialize_float=True):
                    compiled = torch.compile(decode_forward, **aot_options(options))
                    held[key] = compiled.aot_compile(((self.model, *args), kwargs))
                held[key].save_compiled_function(str(path))
                how = "aot_compile"
            seen[key] = (how, round(time.perf_counter() - start, 2))
        return held[key]

    def call(self, compiled: Callable, args: tuple, kwargs: dict):
        def step(*args, **kwargs):
            fn = artifact(self, args, kwargs)
            unmark(kwargs)
            return fn(self.model, *args, **kwargs)

        return marked_call(self, step, args, kwargs)

    sd.StaticDecoder._call = call


SHORT = [{"role": "system", "content": "Always answer in French."},
         {"role": "user", "content": "Hello there, how are you?"}]


def chats(backend) -> list:
    """Greedy tokens of two rows, plain and under three steers, at two prompt lengths."""
    from driftlab.chat import ChatRequest, Sampling
    from driftlab.steering import Interventions

    long = [{"role": "system", "content": "Always answer in French. " * 40},
            {"role": "user", "content": "Hello there, how are you? " * 20}]
    tokens = []
    for conv in (SHORT, long):
        for steer in ([], ["instaboost:m=5"], ["split-softmax:k=0.5"], ["instaboost:m=5", "split-softmax:k=0.5", "trace"]):
            request = ChatRequest([conv, conv], Sampling(greedy=True, max_new_tokens=6),
                                  interventions=Interventions.parse(steer))
            tokens.append([r.token_ids for r in backend.generate(request)])
    return tokens


def other_weights(shape: str, device: torch.device, dtype: torch.dtype) -> dict:
    """A model of other (seed 1) weights through the step, loaded or compiled, and through the
    dynamic loop: the same tokens if the step reads a model's own weights."""
    from gpu import build, shape_config
    from transformers import AutoModelForCausalLM

    tokens = {}
    for decode in ("compiled", "dynamic"):
        torch.manual_seed(1)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shape_config(shape), dtype=dtype).eval()
        tokens[decode] = chats(build(shape, device, dtype, model=model, decode=decode)[0])
    return tokens


def phase(args) -> None:
    """One process: build the backend (the same seeded random weights in every phase), chat, and
    print one JSON line; with --other, a model of other weights instead (`other_weights`)."""
    seen: dict = {}
    if args.precompile:
        precompile_calls(Path(args.store), seen)
    from gpu import build

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.other:
        print("PHASE " + json.dumps({"other": other_weights(args.shape, device, dtype), "keys": dict(seen)}))
        return
    start = time.perf_counter()
    backend, _ = build(args.shape, device, dtype, decode="compiled")
    tokens = chats(backend)
    wall = time.perf_counter() - start
    decode = backend.ran()["decode"]
    print("PHASE " + json.dumps({"wall_s": round(wall, 2), "graphs": decode["graphs"],
                                 "compile_s": round(decode["compile_s"], 2), "keys": dict(seen), "tokens": tokens,
                                 "recordings": decode.get("cudagraph_recordings", 0),
                                 "ms_per_token": round(ms_per_token(backend), 2)}))


def ms_per_token(backend, n: int = 32) -> float:
    """A plain call of `n` greedy tokens on the warmed step, per token: whether a loaded artifact
    decodes as fast as a compiled one (on CUDA, replaying its CUDA graphs or not)."""
    from driftlab.chat import ChatRequest, Sampling

    start = time.perf_counter()
    backend.generate(ChatRequest([SHORT, SHORT], Sampling(greedy=True, max_new_tokens=n, ignore_eos=True)))
    return (time.perf_counter() - start) * 1000 / n


PHASES = [("compile_cold", False, "ind1"), ("compile_warm", False, "ind1"),
          ("aot_compile", True, "ind2"), ("aot_load", True, "ind2")]
# Then the artifacts again, in a fifth process, on a model of other weights.


def _phase(result: Result, name: str, device: str, shape: str, store: Path, cache: Path, *, precompile: bool,
           other: bool = False) -> dict | None:
    """One phase in its own process (its inductor cache at `cache`): its PHASE facts, with its
    wall as `process_s`, or None (a note and a `<name>.failed` RESULT) if it failed."""
    argv = [sys.executable, __file__, "--phase", "--device", device, "--shape", shape, "--store", str(store),
            *(["--precompile"] if precompile else []), *(["--other"] if other else [])]
    start = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PHASE ")), None)
    if line is None:
        result.notes.append(f"{name} failed: {(done.stderr.strip().splitlines() or [str(done.returncode)])[-1]}")
        result.results[f"{name}.failed"] = "1"
        return None
    return {**json.loads(line.removeprefix("PHASE ")), "process_s": f"{time.perf_counter() - start:.1f}"}


def settings() -> tuple[str, str]:
    """PRECOMPILE_DEVICE and PRECOMPILE_SHAPE, and the tokenizer, checked before any process starts:
    one line for a bad one (a device this machine lacks, an unknown shape, no tokenizer)."""
    from gpu import shape_config, tokenizer_dir

    from driftlab.chat.loading import pick_device
    from driftlab.errors import DriftlabError

    device, shape = os.environ.get("PRECOMPILE_DEVICE", "cpu"), os.environ.get("PRECOMPILE_SHAPE", "tiny")
    try:
        shape_config(shape)
    except ValueError as err:
        raise SystemExit(f"PRECOMPILE_SHAPE={shape!r}: {err}.") from None
    try:
        picked = str(pick_device(device))
    except DriftlabError as err:
        raise SystemExit(f"PRECOMPILE_DEVICE={device!r}: {err.message} Use cpu or cuda[:N].") from None
    if picked.startswith("mps"):
        raise SystemExit(f"PRECOMPILE_DEVICE={device!r}: use cpu or cuda[:N].")
    tokenizer_dir()
    return picked, shape


def run(quick: bool = False, full: bool = False) -> Result:
    """The four phases and the other-weights check, each its own process; `quick` and `full` change
    nothing (one size)."""
    device, shape = settings()
    root = Path(tempfile.mkdtemp(prefix="precompile-"))
    store = root / "aot"
    store.mkdir()
    result = Result(f"the decode step in a new process: torch.compile vs aot_compile ({shape}, {device})",
                    ["phase", "process s", "graphs traced", "compile s", "per key", "tokens as phase 1",
                     "CUDA graphs recorded", "ms/token"])
    first = None
    for name, precompile, cache in PHASES:
        got = _phase(result, name, device, shape, store, root / cache, precompile=precompile)
        if got is None:
            continue
        first = first or got["tokens"]
        keys = ", ".join(f"{key} {how} {s} s" for key, (how, s) in got["keys"].items()) or "-"
        result.rows.append([name, got["process_s"], got["graphs"], got["compile_s"], keys, got["tokens"] == first,
                            got["recordings"], got["ms_per_token"]])
        result.results.update({f"{name}.process_s": got["process_s"], f"{name}.graphs": str(got["graphs"]),
                               f"{name}.compile_s": str(got["compile_s"]),
                               f"{name}.tokens_equal": str(got["tokens"] == first),
                               f"{name}.cudagraph_recordings": str(got["recordings"]),
                               f"{name}.ms_per_token": str(got["ms_per_token"])})
        for key, (how, seconds) in got["keys"].items():
            result.results[f"{name}.{key}.{how}_s"] = str(seconds)
    got = _phase(result, "aot_other_weights", device, shape, store, root / "ind2", precompile=True, other=True)
    if got is not None:
        other = got["other"]
        # Teeth: the other weights give other tokens than phase 1's, so equal tokens are not the artifact's own.
        result.results["aot_other_weights.loaded"] = str(bool(got["keys"]) and all(how == "load" for how, _ in got["keys"].values()))
        result.results["aot_other_weights.tokens_as_dynamic"] = str(other["compiled"] == other["dynamic"])
        result.results["aot_other_weights.tokens_differ_from_phase_1"] = str(other["dynamic"] != first)
        result.notes.append("a model of other weights through the loaded artifacts: tokens as the dynamic loop's "
                            f"{other['compiled'] == other['dynamic']}, unlike phase 1's {other['dynamic'] != first}")
    shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":  # one phase, in its own process (run() starts them)
    parser = argparse.ArgumentParser()
    for flag in ("--device", "--shape", "--store"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--phase", action="store_true")
    parser.add_argument("--precompile", action="store_true")
    parser.add_argument("--other", action="store_true")
    phase(parser.parse_args())
