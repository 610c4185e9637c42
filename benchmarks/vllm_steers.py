"""driftlab inside vLLM (`python benchmarks/run.py vllm_steers`; not vllm.py, which would shadow vLLM itself on
the benchmarks' path): batched self-chat tokens/s, vLLM plain against the transformers engine and
each steer against vLLM plain (needs the vllm extra: `pip install -e ".[vllm]"`).

Workload: `driftlab run`'s self-chat, PAIRS conversations decoded together (batch PAIRS), ROUNDS
rounds, every turn and probe exactly TOKENS long (EOS ignored, so every variant generates the same
tokens), greedy, SmolLM2-135M in float32, prefix caching on in both engines (each run starts from
an empty cache). vLLM runs in this process and sets torch to 1 thread for itself and the
transformers engine alike ("Reducing Torch threads ... for serving"), so both run on one core.

Variants: the transformers engine, plain; vLLM plain; vLLM with `trace` (pi telemetry), `vector`
and `cap` (directions: random unit vectors with made-up statistics for every persona, as the tests
use; what they cost does not depend on what they point at), `split-softmax`, `instaboost` and
`pasta` (on the system prompt; `pasta-all` with scope=all). Protocol: a warm-up run of each variant
(untimed), then `repeats` rounds in which every variant runs once, the order rotating each round; per
variant the best wall time is kept and tokens/s = generated tokens / that time; each steer's ratio is
its time over vLLM plain's, best against best, and per round (paired, back to back).

Memory: the process's peak resident set after each variant's first run (ru_maxrss only grows, so a
variant that needs more than all before it shows as a step) and vLLM's KV cache size.

Sizes (PAIRS x ROUNDS x TOKENS; VLLM_BENCH_SIZE=PxRxT overrides): --quick 4x1x8 (1 round: a smoke
test), default 16x2x32 (2 rounds), --full 16x4x64 (3 rounds).

Targets (issue): vector and cap at most 1.10x vLLM plain; trace (pi telemetry) at most 1.15x;
split-softmax, InstABoost and PASTA at most 1.3x.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time

import torch
from common import Result, Table, selfchat_config, size_of

from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.bench import load_personas
from driftlab.chat import BackendSpec, Sampling, make_backend
from driftlab.errors import DriftlabError
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat

SIZES = {"quick": (4, 1, 8, 1), "default": (16, 2, 32, 2), "full": (16, 4, 64, 3)}
STEERS = {  # variant -> (steer specs, target ratio to vLLM plain)
    "trace": (["trace"], 1.15),
    "vector": (["vector:alpha=1"], 1.10),
    "cap": (["cap:q=0.5"], 1.10),
    "split-softmax": (["split-softmax:k=0.6"], 1.3),
    "instaboost": (["instaboost:m=5"], 1.3),
    "pasta": (["pasta:heads=0-29,span=system"], 1.3),
    # scope=all: the reply's keys are lowered as the prompt's are, so a turn's KV is the same as prompt and as
    # generated and vLLM's prefix cache serves it; pastalib's scope=prompt (above) must prefill each turn whole.
    "pasta-all": (["pasta:heads=0-29,span=system,scope=all"], 1.3),
}


def _size(size: str) -> tuple[int, int, int, int]:
    pairs, rounds, tokens, repeats = SIZES[size]
    text = os.environ.get("VLLM_BENCH_SIZE")
    if text:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise DriftlabError(f"VLLM_BENCH_SIZE={text!r}: expected PAIRSxROUNDSxTOKENS, e.g. 16x2x32.")
        pairs, rounds, tokens = (int(x) for x in parts)
    return pairs, rounds, tokens, repeats


def _directions(out: str, n_layers: int, d_model: int) -> str:
    """Random unit directions for every built-in persona's system prompt (with made-up statistics)."""
    gen = torch.Generator().manual_seed(0)
    found = []
    for i, persona in enumerate(load_personas()):
        unit = torch.nn.functional.normalize(torch.randn(n_layers, d_model, generator=gen), dim=-1)
        found.append(PersonaDirection(
            id=f"p{i}", system_prompt=persona.system_prompt, unit=unit, norm=torch.full((n_layers,), 4.0),
            with_proj=2.0 + torch.randn(16, n_layers, generator=gen), without_proj=torch.randn(16, n_layers, generator=gen),
            auroc=torch.ones(3, n_layers), band=tuple(range(n_layers // 3, n_layers // 3 + 4))))
    Directions({"model": "smollm2-135m", "n_layers": n_layers, "d_model": d_model}, found).save(out)
    return out


def _once(backend, cfg) -> tuple[float, int]:
    """(wall seconds, generated tokens) of one self-chat into a fresh directory, from an empty prefix cache."""
    if hasattr(backend, "llm"):
        backend.llm.reset_prefix_cache()
    else:
        backend.prefix_cache.clear()
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        rundir = run_protocol(SelfChat(cfg, backend), out, progress=False)
        seconds = time.perf_counter() - t
        tokens = sum(r["n_tokens"] for r in rundir.records())
    return seconds, tokens


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    pairs, rounds, tokens, repeats = _size(size)
    with tempfile.TemporaryDirectory() as tmp:
        specs = {engine: BackendSpec(model=f"{engine}smollm2-135m", dtype="float32",
                                     directions=_directions(tmp, 30, 576) if not engine else tmp)
                 for engine in ("", "vllm:")}
        hf, vllm = make_backend(specs[""]), make_backend(specs["vllm:"])
        threads = torch.get_num_threads()
        sampling = Sampling(max_new_tokens=tokens, ignore_eos=True, greedy=True)
        base = dict(pairs=pairs, rounds=rounds, sampling=sampling, batch_size=pairs, seed=1)
        variants = {"transformers engine": (hf, []), "vLLM": (vllm, [])}
        variants.update({f"vLLM + {name}": (vllm, specs) for name, (specs, _) in STEERS.items()})
        configs = {name: selfchat_config(**base, steer=steer, backend=specs["" if backend is hf else "vllm:"])
                   for name, (backend, steer) in variants.items()}
        warm = {name: cfg.model_copy(update={"pairs": 2, "rounds": 1}) for name, cfg in configs.items()}
        peaks = {}
        for name, (backend, _) in variants.items():
            _once(backend, warm[name])
            peaks[name] = _peak_mb()
        times: dict[str, list[float]] = {name: [] for name in variants}
        work: dict[str, int] = {}
        names = list(variants)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                seconds, n = _once(variants[name][0], configs[name])
                times[name].append(seconds)
                work.setdefault(name, n)
        kv_gb = vllm.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes / 2**30
        vllm.close()
    assert len(set(work.values())) == 1, f"the variants generated different numbers of tokens: {work}"
    n_tokens = work["vLLM"]
    best = {name: min(ts) for name, ts in times.items()}
    plain = best["vLLM"]
    res = Result(
        title=f"self-chat on SmolLM2-135M float32, {threads} torch thread(s): {pairs} pairs (batch {pairs}) x {rounds} "
              f"rounds x {tokens} tokens per turn and probe; best of {repeats} interleaved round(s) ({size} size)",
        columns=["variant", "best s", "s per round", "tokens/s", "x vLLM plain", "paired x", "target", "met",
                 "peak RSS MB"])
    results = {"size": f"{pairs}x{rounds}x{tokens}", "tokens": str(n_tokens), "threads": str(threads),
               "kv_cache_gib": f"{kv_gb:.1f}", "peak_rss_mb": f"{max(peaks.values()):.0f}"}
    for name in variants:
        ratio = best[name] / plain
        paired = [a / b for a, b in zip(times[name], times["vLLM"], strict=True)]
        steer = name.removeprefix("vLLM + ")
        target = STEERS[steer][1] if steer in STEERS else None
        met = "" if target is None else ("yes" if ratio <= target else "no")
        res.rows.append([name, f"{best[name]:.1f}", " ".join(f"{t:.1f}" for t in times[name]),
                         f"{n_tokens / best[name]:.1f}", f"{ratio:.2f}", " ".join(f"{x:.2f}" for x in paired),
                         "" if target is None else f"<= {target:g}", met, f"{peaks[name]:.0f}"])
        key = {"transformers engine": "hf", "vLLM": "vllm"}.get(name, steer.replace("-", "_"))
        results[f"{key}_tokens_per_s"] = f"{n_tokens / best[name]:.1f}"
        if name != "vLLM":
            results[f"{key}_ratio"] = f"{ratio:.3f}"
        if target is not None:
            results[f"{key}_target_met"] = str(ratio <= target).lower()
    res.results = results
    res.notes = [
        f"every variant generated the same {n_tokens} tokens (EOS ignored); x vLLM plain = best time over vLLM plain's "
        "best; paired x = the same, round by round (back to back).",
        f"peak RSS = the process's peak resident set after the variant's warm-up (it only grows: a step means the "
        f"variant needed more than every variant before it); vLLM's KV cache: {kv_gb:.1f} GiB.",
    ]
    res.tables = [Table("transformers engine against vLLM plain", ["engine", "tokens/s"],
                        [["transformers engine", f"{n_tokens / best['transformers engine']:.1f}"],
                         ["vLLM", f"{n_tokens / plain:.1f}"]])]
    return res
