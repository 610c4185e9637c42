"""lm-evaluation-harness against `driftlab serve`: MMLU questions through the chat route, with
concurrent requests, under continuous and under static batching.

What a user does to price a served model: start `driftlab serve`, point lm-eval's
`local-chat-completions` at it with `num_concurrent` > 1. One model (smollm2-135m, float32, so
greedy rows decode the same tokens alone or joined), one process, two apps on 127.0.0.1 that
share the backend: `--batching continuous` (the default) and `--batching static`, run back to
back on the same task.

The task: `questions` MMLU test questions (drawn with seed 0 from driftlab's pulled copy,
`driftlab data pull mmlu`), asked as a chat turn ("... Answer with the letter only.") under a
system instruction, greedy, at most 4 new tokens, cut at a newline; the answer is the first
capital A-D of the reply (exact match). lm-eval 0.4.13 sends `num_concurrent` requests at a
time, so under continuous batching a request that arrives while others decode joins them.

RESULTs per mode: lm-eval's exact match, wall seconds and requests that joined a running batch;
then how many replies the two modes gave identically (greedy float32: all of them) and the wall
time of continuous over static. The numbers say that lm-eval evaluates the continuous server as
it does the static one, not how good SmolLM2-135M is at MMLU (near chance).

Sizes: --quick 24 questions, default 100, --full 400; num_concurrent 8.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

from common import Result, size_of

from driftlab.chat.hf import HFChatBackend
from driftlab.serve import ServeSettings, background, create_app

MODES = ("continuous", "static")
SIZES = {"quick": 24, "default": 100, "full": 400}
CONCURRENT = 8
SYSTEM = "You are taking a multiple-choice exam."
TASK = """task: driftlab_mmlu_chat
custom_dataset: !function data.load
output_type: generate_until
test_split: test
doc_to_text: "{{question}}\\nA. {{answer_a}}\\nB. {{answer_b}}\\nC. {{answer_c}}\\nD. {{answer_d}}\\nAnswer with the letter only."
doc_to_target: "{{correct_answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
  temperature: 0
filter_list:
  - name: letter
    filter:
      - function: regex
        regex_pattern: "([ABCD])"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
LOADER = '''from pathlib import Path


def load(**_metadata):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).resolve().parent / "questions.jsonl")})
'''


def _task_dir(where: Path, n: int) -> Path:
    """An lm-eval task folder holding `n` MMLU questions drawn with seed 0 (offline)."""
    from driftlab.assets.datasets import dataset_file

    rows = [json.loads(line) for line in dataset_file("mmlu").read_text(encoding="utf-8").split("\n") if line]
    random.Random(0).shuffle(rows)
    (where / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:n]), encoding="utf-8")
    (where / "driftlab_mmlu_chat.yaml").write_text(TASK, encoding="utf-8")
    (where / "data.py").write_text(LOADER, encoding="utf-8")
    return where


def _evaluate(url: str, model: str, tasks: Path) -> tuple[dict, float]:
    """lm-eval's output and wall seconds of one evaluation through `local-chat-completions`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": model, "base_url": f"{url}/v1/chat/completions", "num_concurrent": CONCURRENT,
                    "max_retries": 1},
        tasks=["driftlab_mmlu_chat"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
        apply_chat_template=True, system_instruction=SYSTEM)
    return out, time.perf_counter() - start


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    n = SIZES[size]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend = HFChatBackend("smollm2-135m", dtype="float32", prefix_cache_bytes=0)
    res = Result(f"lm-eval 0.4.13 against driftlab serve: {n} MMLU questions, local-chat-completions, "
                 f"num_concurrent {CONCURRENT}, smollm2-135m float32, greedy ({size} size)",
                 ["batching", "exact match", "wall s", "joined a running batch"])
    replies: dict[str, list[str]] = {}
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tasks = _task_dir(Path(tmp), n)
        apps = {mode: create_app(backend, ServeSettings(max_wait_ms=10, batching=mode)) for mode in MODES}
        urls = {mode: stack.enter_context(background(app)) for mode, app in apps.items()}
        for mode in MODES:
            batcher = apps[mode].state.batcher
            before = batcher.n_admitted
            out, walls[mode] = _evaluate(urls[mode], backend.name, tasks)
            samples = sorted(out["samples"]["driftlab_mmlu_chat"], key=lambda s: s["doc_id"])
            replies[mode] = [s["resps"][0][0] for s in samples]
            score = out["results"]["driftlab_mmlu_chat"]["exact_match,letter"]
            joined = batcher.n_admitted - before
            res.rows.append([mode, f"{score:.3f}", f"{walls[mode]:.1f}", joined])
            res.results.update({f"lmeval.{mode}.exact_match": f"{score:.3f}", f"lmeval.{mode}.wall_s":
                                f"{walls[mode]:.1f}", f"lmeval.{mode}.joined": str(joined)})
    same = sum(a == b for a, b in zip(replies["continuous"], replies["static"], strict=True))
    res.results["lmeval.identical_replies"] = f"{same}/{n}"
    res.results["lmeval.wall_continuous_vs_static"] = f"{walls['continuous'] / walls['static']:.2f}"
    res.notes.append("identical_replies: lm-eval's logged replies that are the same text under both batchings")
    return res
