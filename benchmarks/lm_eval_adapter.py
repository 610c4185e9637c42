"""lm-evaluation-harness scoring: driftlab's `DriftlabLM` against lm-eval's own `HFLM`, same requests.

The requests of a multiple-choice task: N questions x 4 options after a 3-shot prompt (what
lm-eval's `multiple_choice` tasks send), half of the questions with one-word options (one
token each: HFLM's one-token-continuation cache and DriftlabLM's shared pass both score the
four in one forward pass) and half with phrase options (several tokens: one pass per option
in both). Both models are SmolLM2-135M in float32 on the same device, batch size 8, in one
process; each is timed once after a warm-up on the first 8 requests. The log-likelihoods
are checked to agree (max |difference| in the table).

Sizes: --quick 8 questions (32 requests), default 40 (160), --full 120 (480).
"""

from __future__ import annotations

import time

from common import Result, size_of, sync

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"]),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "yellow"]),
    ("Which animal says moo?", ["dog", "cat", "duck", "cow"]),
    ("Which planet do we live on?", ["Earth", "Mars", "Venus", "Jupiter"]),
    ("What do bees make?", ["milk", "silk", "honey", "wool"]),
]
PHRASES = [
    ("Why do people carry umbrellas?", ["to stay dry in the rain", "to look taller than others",
                                        "to catch falling fish", "to measure the wind speed"]),
    ("What does a thermometer measure?", ["how hot or cold something is", "the weight of a stone",
                                          "the length of a river", "the speed of a car"]),
    ("Where do penguins mostly live?", ["in the southern hemisphere", "in hot deserts",
                                        "on tall mountain tops", "inside large caves"]),
]
SHOTS = "".join(f"Question: {q}\nAnswer: {c[0]}\n\n" for q, c in QUESTIONS[:3])


def requests(n: int):
    from lm_eval.api.instance import Instance

    out = []
    for i in range(n):
        q, choices = (QUESTIONS if i % 2 == 0 else PHRASES)[i // 2 % (3 if i % 2 else 6)]
        context = f"{SHOTS}Question ({i}): {q}\nAnswer:"
        out += [Instance("loglikelihood", {}, (context, " " + c), i) for c in choices]
    return out


def run(quick: bool = False, full: bool = False) -> Result:
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from driftlab.assets import resolve_model
    from driftlab.chat.hf import HFChatBackend
    from driftlab.integrations.lm_eval import DriftlabLM

    size = size_of(quick, full)
    n = {"quick": 8, "default": 40, "full": 120}[size]
    path = str(resolve_model("smollm2-135m"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    hflm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(path), batch_size=8, device=device)
    backend = HFChatBackend(path, dtype="float32", device=device, prefix_cache_bytes=0)
    ours = DriftlabLM(model=backend, batch_size=8)
    reqs = requests(n)
    times, scores = {}, {}
    for name, lm in (("HFLM", hflm), ("DriftlabLM", ours)):
        lm.loglikelihood(reqs[:8], disable_tqdm=True)  # warm-up
        sync()
        t = time.perf_counter()
        scores[name] = lm.loglikelihood(reqs, disable_tqdm=True)
        sync()
        times[name] = time.perf_counter() - t
    diff = max(abs(a[0] - b[0]) for a, b in zip(scores["HFLM"], scores["DriftlabLM"], strict=True))
    greedy = sum(a[1] == b[1] for a, b in zip(scores["HFLM"], scores["DriftlabLM"], strict=True))
    ratio = times["DriftlabLM"] / times["HFLM"]
    res = Result(title=f"lm-eval loglikelihood, {n} questions x 4 options, SmolLM2-135M float32, batch 8, "
                       f"{device} ({size} size)",
                 columns=["model", "seconds", "requests/s", "vs HFLM"])
    for name in ("HFLM", "DriftlabLM"):
        res.rows.append([name, f"{times[name]:.2f}", f"{len(reqs) / times[name]:.1f}",
                         f"{times[name] / times['HFLM']:.2f}x"])
    res.notes.append(f"max |log-likelihood difference| {diff:.2e}; is_greedy equal on {greedy}/{len(reqs)}")
    res.results = {"size": size, "lm_eval_hflm_s": f"{times['HFLM']:.3f}", "lm_eval_driftlab_s": f"{times['DriftlabLM']:.3f}",
                   "lm_eval_driftlab_vs_hflm": f"{ratio:.3f}", "lm_eval_max_abs_diff": f"{diff:.2e}"}
    return res
