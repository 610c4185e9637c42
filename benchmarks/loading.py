"""A model's first load in a fresh process: with driftlab's pause of cyclic garbage collection
(`driftlab.chat.loading.collections_paused`) and without it.

Why it matters: every `driftlab` command, server, Ray worker and lm-eval run starts as a new
process whose first model load imports most of transformers and builds the model, some 250k
objects that live as long as the process. Without the pause, Python's full collections walk that
growing heap several times during the load and free nothing.

Each pair starts two fresh interpreters, one of each, in alternating order; each times its own
`import driftlab.chat.loading` plus `load_model("smollm2-135m", float32, cpu)` (interpreter
start-up excluded) and counts its full collections. The headline is the median paired ratio,
paused over unpaused, with Wilcoxon's exact signed-rank test over the pairs.

Sizes: --quick 2 pairs; default 10; --full 30. Each pair is two new processes of about 4 s, plus one warm-up load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from common import Result, size_of

CHILD = """
import contextlib, gc, json, sys, time
full = [0]
gc.callbacks.append(lambda phase, info: full.__setitem__(0, full[0] + (phase == "stop" and info["generation"] == 2)))
start = time.perf_counter()
from driftlab.chat import loading
if sys.argv[1] == "unpaused":
    loading.collections_paused = contextlib.nullcontext
loading.load_model("smollm2-135m", dtype="float32", device="cpu")
print(json.dumps({"seconds": time.perf_counter() - start, "full_collections": full[0]}))
"""


def _load(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=os.environ,
                          timeout=600, check=False)
    if done.returncode != 0:  # one line, through run.py: the child's last line says why
        from driftlab.errors import DriftlabError

        lines = done.stderr.strip().splitlines() or ["no output"]
        why = next((line for line in reversed(lines) if "Error" in line), lines[-1]).removeprefix(
            "driftlab.errors.DriftlabError: ")
        hint = next((line.removeprefix("Hint: ") for line in lines if line.startswith("Hint: ")),
                    "Check that `driftlab models pull smollm2-135m` succeeds here.")
        raise DriftlabError(f"The {mode} load of smollm2-135m failed: {why}", hint=hint)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False, full: bool = False) -> Result:
    from scipy.stats import wilcoxon

    pairs = {"quick": 2, "default": 10, "full": 30}[size_of(quick, full)]
    _load("paused")  # warm-up: the page cache holds the weights and the installed modules for both
    runs: dict[str, list[dict]] = {"paused": [], "unpaused": []}
    for i in range(pairs):
        for mode in (("paused", "unpaused") if i % 2 == 0 else ("unpaused", "paused")):
            runs[mode].append(_load(mode))
    seconds = {mode: [r["seconds"] for r in rs] for mode, rs in runs.items()}
    ratios = [a / b for a, b in zip(seconds["paused"], seconds["unpaused"], strict=True)]
    result = Result(title=f"first load of smollm2-135m (float32, CPU) in a fresh process, {pairs} pairs",
                    columns=["collection", "median s", "full collections (median)"])
    for mode, rs in runs.items():
        result.rows.append([mode, f"{statistics.median(seconds[mode]):.2f}",
                            f"{statistics.median(r['full_collections'] for r in rs):.0f}"])
    p = wilcoxon(seconds["paused"], seconds["unpaused"]).pvalue if pairs >= 6 else float("nan")
    result.results.update({
        "loading.paused_s": f"{statistics.median(seconds['paused']):.2f}",
        "loading.unpaused_s": f"{statistics.median(seconds['unpaused']):.2f}",
        "loading.ratio": f"{statistics.median(ratios):.3f}",
        "loading.pairs": str(pairs),
        "loading.wilcoxon_p": f"{p:.4f}",
    })
    return result
