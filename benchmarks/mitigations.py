"""What each mitigation costs in decoding time, relative to plain decoding, in one process.

Same model, same conversations (a 4-turn dialog per row, batch of 4), greedy, exactly
`tokens` new tokens per row (EOS ignored), prefix cache off so every call pays its prefill.
Every variant is warmed up first; then `repeats` rounds run every variant once, the order
rotating, and the best time is kept. Each variant must generate the same number of tokens
as plain decoding (asserted), so a ratio compares equal work.

* split-softmax and InstABoost change attention inside the fused kernel path (targets <= 1.15);
* CFG decodes every row twice, with and without the system prompt (target <= 2.2);
* SPR lengthens the prompt (a system-prompt copy before every later user turn); reported.
"""

from __future__ import annotations

import time

import torch
from common import Result

from driftlab.bench import STARTERS, get_persona
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.steering import Interventions

VARIANTS = {
    "plain": [],
    "split-softmax k=0.9": ["split-softmax:k=0.9"],
    "InstABoost m=5": ["instaboost:m=5"],
    "CFG alpha=1.5": ["cfg:alpha=1.5"],
    "SPR p=1": ["spr:p=1"],
}
KEYS = {"split-softmax k=0.9": "split_softmax", "InstABoost m=5": "instaboost", "CFG alpha=1.5": "cfg",
        "SPR p=1": "spr"}


def _conversations(n: int) -> list[list[dict]]:
    personas = ["reply-in-french", "secret-number-share", "very-happy", "name-alexander"]
    convs = []
    for i in range(n):
        p = get_persona(personas[i % len(personas)])
        conv = [{"role": "system", "content": p.system_prompt}]
        for j in range(3):
            conv += [{"role": "user", "content": STARTERS[(i + j) % len(STARTERS)]},
                     {"role": "assistant", "content": "That is a good question, let me think about it carefully."}]
        conv.append({"role": "user", "content": p.probe})
        convs.append(conv)
    return convs


def run(quick: bool = False) -> Result:
    tokens, repeats, batch = (8, 1, 2) if quick else (48, 3, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    sampling = Sampling(greedy=True, max_new_tokens=tokens, ignore_eos=True)
    convs = _conversations(batch)
    requests = {name: ChatRequest(convs, sampling, interventions=Interventions.parse(specs))
                for name, specs in VARIANTS.items()}

    def once(name: str) -> tuple[float, int]:
        t = time.perf_counter()
        replies = backend.generate(requests[name])
        return time.perf_counter() - t, sum(r.n_tokens for r in replies)

    for name in VARIANTS:  # warm-up
        once(name)
    best: dict[str, float] = {}
    names = list(VARIANTS)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            seconds, n = once(name)
            assert n == batch * tokens, (name, n)
            best[name] = min(best.get(name, float("inf")), seconds)

    prompt_len = {name: max(len(backend.render(c).ids) for c in
                            (Interventions.parse(specs).model_view(c) for c in convs))
                  for name, specs in VARIANTS.items()}
    res = Result(
        title=f"mitigations: {backend.name} ({backend.model.dtype}, {threads} threads), batch {batch}, "
        f"{tokens} new tokens/row incl. prefill; best of {repeats}, interleaved, after warm-up",
        columns=["variant", "best wall s", "tokens/s", "longest prompt", "time vs plain"],
    )
    for name in VARIANTS:
        res.rows.append([name, f"{best[name]:.2f}", f"{batch * tokens / best[name]:.1f}", prompt_len[name],
                         f"{best[name] / best['plain']:.2f}x"])
    res.results = {f"{KEYS[name]}_overhead": f"{best[name] / best['plain']:.3f}" for name in KEYS}
    res.notes.append("Targets (issue): split-softmax, InstABoost <= 1.15; CFG <= 2.2; SPR reported.")
    return res
