"""The first reply of a new process on the compiled decode loop: compiling vs precompiled steps.

Item 2 of the GPU path's third pass: a plain or steered reply must start within 10 s of the model
being loaded, and a steer's graph must compile once per machine, not once per process. driftlab
stores each compiled decode step with torch's `aot_compile` (driftlab.chat.precompiled), so a
later process loads it instead of dynamo tracing the model again, which a new process still paid
with inductor's caches full (40 s for two Llama-2-7B graphs on an H100: docs/performance.md).

`python benchmarks/run.py precompile`; PRECOMPILE_DEVICE=cuda for a GPU (where the store is
opt-in: DRIFTLAB_PRECOMPILED=1 is set for it here); PRECOMPILE_SHAPE=tiny (default), qwen2.5-7b or
llama2-7b (gpu.py's shapes, built on the device with the same seeded random weights in each
process); the tokenizer from GPUBENCH_TOKENIZER or the pulled SmolLM2. Four phases, each a new
process, one after another:
  1. compile_cold: DRIFTLAB_PRECOMPILED=0 (torch.compile only), empty caches;
  2. compile_warm: the same again, inductor's and AOTAutograd's caches on disk;
  3. store_cold: DRIFTLAB_PRECOMPILED=1, an empty store: each step aot-compiled and saved;
  4. store_warm: a new process over that store, which loads the steps.
Each times its first reply (a plain call of 4 tokens, right after the model is built), then chats
plain and with three steers at two prompt lengths (batch 2). RESULT lines per phase: the process's
wall, the first reply's seconds, the graphs traced, the seconds compiling or loading, the steps
saved and loaded, whether its greedy tokens equal phase 1's, CUDA graphs recorded and ms/token of a
plain call on the warmed step. Then a fifth process runs a model of other weights through the
stored steps, against the dynamic loop (the weights are the step's inputs, not constants).
On CUDA, store_warm recording CUDA graphs and decoding as fast as compile_warm says CUDA graphs
survive a load (pytorch/pytorch#155703): then the store can be on by default there.

What the CPU said before the store was driftlab's (docs/results/bench/precompile-cpu.txt,
precompile-cpu-2.txt: this probe patching driftlab's decoder, the tiny shape, one run each): a
process loading the steps took 7.4-8.1 s against 13.4-13.5 s, tracing no graph, with the same
tokens. What it took to get there is written in driftlab.chat.precompiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Result

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
        backend = build(shape, device, dtype, model=model, decode=decode)[0]
        tokens[decode] = chats(backend)
        if decode == "compiled":
            tokens["graphs"] = backend.ran()["decode"]["graphs"]
    return tokens


def phase(args) -> None:
    """One process: build the backend (the same seeded random weights in every phase), chat, and
    print one JSON line; with --other, a model of other weights instead (`other_weights`)."""
    from gpu import build

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.other:
        print("PHASE " + json.dumps({"other": other_weights(args.shape, device, dtype)}))
        return
    backend, _ = build(args.shape, device, dtype, decode="compiled")
    start = time.perf_counter()
    first_reply(backend)
    first = time.perf_counter() - start
    tokens = chats(backend)
    wall = time.perf_counter() - start
    decode = backend.ran()["decode"]
    stored = decode.get("precompiled", {})
    print("PHASE " + json.dumps({"wall_s": round(wall, 2), "first_reply_s": round(first, 2), "graphs": decode["graphs"],
                                 "compile_s": round(decode["compile_s"] + stored.get("load_s", 0.0), 2),
                                 "saved": stored.get("saved", 0), "loaded": stored.get("loaded", 0), "tokens": tokens,
                                 "recordings": decode.get("cudagraph_recordings", 0),
                                 "ms_per_token": round(ms_per_token(backend), 2)}))


def first_reply(backend) -> None:
    """The user's first reply: one row, plain, 4 greedy tokens."""
    from driftlab.chat import ChatRequest, Sampling

    backend.generate(ChatRequest([SHORT], Sampling(greedy=True, max_new_tokens=4, ignore_eos=True)))


def ms_per_token(backend, n: int = 32) -> float:
    """A plain call of `n` greedy tokens on the warmed step, per token: whether a loaded artifact
    decodes as fast as a compiled one (on CUDA, replaying its CUDA graphs or not)."""
    from driftlab.chat import ChatRequest, Sampling

    start = time.perf_counter()
    backend.generate(ChatRequest([SHORT, SHORT], Sampling(greedy=True, max_new_tokens=n, ignore_eos=True)))
    return (time.perf_counter() - start) * 1000 / n


PHASES = [("compile_cold", False, "ind1"), ("compile_warm", False, "ind1"),
          ("store_cold", True, "ind2"), ("store_warm", True, "ind2")]
# Then the stored steps again, in a fifth process, on a model of other weights.


def _phase(result: Result, name: str, device: str, shape: str, cache: Path, *, precompile: bool,
           other: bool = False) -> dict | None:
    """One phase in its own process (its inductor cache, and so its store, at `cache`): its PHASE
    facts, with its wall as `process_s`, or None (a note and a `<name>.failed` RESULT) if it failed."""
    argv = [sys.executable, __file__, "--phase", "--device", device, "--shape", shape, *(["--other"] if other else [])]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "DRIFTLAB_PRECOMPILED": "1" if precompile else "0"}
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
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
    result = Result(f"a new process's first reply on the compiled loop: compiling vs precompiled steps ({shape}, {device})",
                    ["phase", "process s", "first reply s", "graphs traced", "compile or load s", "steps saved",
                     "steps loaded", "tokens as phase 1", "CUDA graphs recorded", "ms/token"])
    first = None
    for name, precompile, cache in PHASES:
        got = _phase(result, name, device, shape, root / cache, precompile=precompile)
        if got is None:
            continue
        first = first or got["tokens"]
        result.rows.append([name, got["process_s"], got["first_reply_s"], got["graphs"], got["compile_s"], got["saved"],
                            got["loaded"], got["tokens"] == first, got["recordings"], got["ms_per_token"]])
        result.results.update({f"{name}.{k}": str(got[k]) for k in ("process_s", "first_reply_s", "graphs", "compile_s",
                                                                    "saved", "loaded", "ms_per_token")})
        result.results.update({f"{name}.tokens_equal": str(got["tokens"] == first),
                               f"{name}.cudagraph_recordings": str(got["recordings"])})
    got = _phase(result, "store_other_weights", device, shape, root / "ind2", precompile=True, other=True)
    if got is not None:
        other = got["other"]
        # Teeth: the other weights give other tokens than phase 1's, so equal tokens are not the store's own.
        result.results["store_other_weights.tokens_as_dynamic"] = str(other["compiled"] == other["dynamic"])
        result.results["store_other_weights.tokens_differ_from_phase_1"] = str(other["dynamic"] != first)
        result.results["store_other_weights.graphs"] = str(other["graphs"])
        result.notes.append("a model of other weights through the stored steps: tokens as the dynamic loop's "
                            f"{other['compiled'] == other['dynamic']}, unlike phase 1's {other['dynamic'] != first}; "
                            f"graphs traced {other['graphs']}")
    shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":  # one phase, in its own process (run() starts them)
    parser = argparse.ArgumentParser()
    for flag in ("--device", "--shape"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--phase", action="store_true")
    parser.add_argument("--other", action="store_true")
    phase(parser.parse_args())
