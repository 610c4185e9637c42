"""What each mitigation costs in decoding time, relative to plain decoding, in one process.

Same model, same conversations (a 4-turn dialog per row, batch of 4), greedy, exactly
`tokens` new tokens per row (EOS ignored), prefix cache off so every call pays its prefill.
Every variant is warmed up first; then `repeats` rounds run every variant once, the order
rotating, and the best time is kept. Each variant must generate the same number of tokens
as plain decoding (asserted), so a ratio compares equal work.

* split-softmax and InstABoost change attention inside the fused kernel path (targets <= 1.15);
* CFG decodes every row twice, with and without the system prompt (target <= 2.2);
* SPR lengthens the prompt (a system-prompt copy before every later user turn); reported.

Torch threads are pinned (1 on a CPU, see common.pin_threads). Sizes: --quick 8 tokens, batch 2,
1 round; default 24 tokens, batch 4, 2 rounds, a warm-up of 4 tokens per variant (the same
prompts, so the same prefill and kernels); --full 48 tokens, batch 4, 3 rounds, full-length
warm-ups (the size of the figures in docs/design-notes.md). Measured with `time python
benchmarks/run.py mitigations` on this project's 2-core CPU, shared with other jobs (load average
~2.7, this run included), float32: the default size took 1 min 42 s (split-softmax 1.15x plain,
InstABoost 1.05x, CFG 1.70x, SPR 1.37x), --quick 37 s.
"""

from __future__ import annotations

import time

from common import Result, pin_threads, size_of

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


SIZES = {  # new tokens, timed rounds, batch, warm-up tokens
    "quick": (8, 1, 2, 8),
    "default": (24, 2, 4, 4),
    "full": (48, 3, 4, 48),
}


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    tokens, repeats, batch, warm_tokens = SIZES[size]
    threads, _ = pin_threads()
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    sampling = Sampling(greedy=True, max_new_tokens=tokens, ignore_eos=True)
    convs = _conversations(batch)
    requests = {name: ChatRequest(convs, sampling, interventions=Interventions.parse(specs))
                for name, specs in VARIANTS.items()}

    def once(name: str, n_tokens: int = tokens) -> tuple[float, int]:
        request = requests[name]
        if n_tokens != tokens:
            request = ChatRequest(convs, sampling.model_copy(update={"max_new_tokens": n_tokens}),
                                  interventions=request.interventions)
        t = time.perf_counter()
        replies = backend.generate(request)
        return time.perf_counter() - t, sum(r.n_tokens for r in replies)

    for name in VARIANTS:  # warm-up
        once(name, warm_tokens)
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
        title=f"mitigations: {backend.name} ({str(backend.model.dtype).removeprefix('torch.')}, {threads} torch "
        f"threads), batch {batch}, "
        f"{tokens} new tokens/row incl. prefill; best of {repeats}, interleaved, after warm-up ({size} size)",
        columns=["variant", "best wall s", "tokens/s", "longest prompt", "time vs plain"],
    )
    for name in VARIANTS:
        res.rows.append([name, f"{best[name]:.2f}", f"{batch * tokens / best[name]:.1f}", prompt_len[name],
                         f"{best[name] / best['plain']:.2f}x"])
    res.results = {"size": size, "torch_threads": str(threads)}
    res.results.update({f"{KEYS[name]}_overhead": f"{best[name] / best['plain']:.3f}" for name in KEYS})
    res.notes.append("Targets (issue): split-softmax, InstABoost <= 1.15; CFG <= 2.2; SPR reported.")
    return res
