"""What the residual stream's monitoring and steers cost in decoding time, against plain decoding.

Same model, conversations and greedy decoding as the mitigations benchmark (a 4-turn dialog per
row, four personas, exactly `tokens` new tokens per row, prefix cache off), in one process:

* recording: the model has directions (synthetic: random unit vectors per persona, what is timed
  does not depend on their values), so each reply's projection is recorded (target <= 1.05);
* vector alpha=0.5 and cap q=0.5 on the directions' band (targets <= 1.10);
* pi-floor f=0.8, beside split-softmax k=0.9, which rescales the same way (target: within its cost);
* a forward-hook loop: what a user of a steering library runs, transformers' `generate` once per
  prompt with a hook adding that prompt's persona vector, against driftlab's one batched call
  under `vector:` on the same prompts (target: at least 3x the throughput at batch 8).

Every variant is warmed up; then `repeats` rounds run every variant once, the order rotating, and
the best time is kept. Sizes: --quick 8 tokens, batch 2, 1 round; default 24 tokens, batch 8,
2 rounds; --full 48 tokens, batch 8, 3 rounds.
"""

from __future__ import annotations

import time

import torch
from common import Result, pin_threads, size_of
from mitigations import _conversations

from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.steering import Interventions

VARIANTS = {  # name -> (directions loaded, steer)
    "plain": (False, []),
    "recording": (True, []),
    "vector alpha=0.5": (True, ["vector:alpha=0.5"]),
    "cap q=0.5": (True, ["cap:q=0.5"]),
    "split-softmax k=0.9": (False, ["split-softmax:k=0.9"]),
    "pi-floor f=0.8": (False, ["pi-floor:f=0.8"]),
}
KEYS = {"recording": "recording", "vector alpha=0.5": "vector", "cap q=0.5": "cap",
        "split-softmax k=0.9": "split_softmax", "pi-floor f=0.8": "pi_floor"}
SIZES = {"quick": (8, 1, 2), "default": (24, 2, 8), "full": (48, 3, 8)}  # tokens, rounds, batch


def synthetic_directions(backend: HFChatBackend, systems: list[str]) -> Directions:
    L, d = backend.shape.layers, backend.d_model
    gen = torch.Generator().manual_seed(0)
    found = [PersonaDirection(id=f"p{i}", system_prompt=s,
                              unit=torch.nn.functional.normalize(torch.randn(L, d, generator=gen), dim=-1),
                              norm=torch.full((L,), 2.0), with_proj=1 + torch.randn(8, L, generator=gen),
                              without_proj=torch.randn(8, L, generator=gen), auroc=torch.ones(3, L),
                              band=tuple(range(L // 2 - 2, L // 2 + 2)))
             for i, s in enumerate(systems)]
    return Directions({"model": backend.name, "n_layers": L, "d_model": d}, found)


def _hook_loop(backend: HFChatBackend, directions: Directions, convs, tokens: int) -> float:
    """transformers' generate per prompt, a forward hook adding that prompt's vector on the band."""
    model, start = backend.model, time.perf_counter()
    for conv in convs:
        p = directions.for_system(conv[0]["content"])
        handles = [model.model.layers[layer].register_forward_hook(
            lambda m, a, out, d=(0.5 * p.norm[layer] * p.unit[layer]).to(model.dtype): out + d) for layer in p.band]
        try:
            ids = torch.tensor([backend.render(conv).ids], device=backend.device)
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           pad_token_id=backend.pad_id)
        finally:
            for h in handles:
                h.remove()
    return time.perf_counter() - start


def run(quick: bool = False, full: bool = False) -> Result:
    size = size_of(quick, full)
    tokens, repeats, batch = SIZES[size]
    threads, _ = pin_threads()
    backend = HFChatBackend("smollm2-135m", dtype="auto", prefix_cache_bytes=0)
    convs = _conversations(batch)
    directions = synthetic_directions(backend, sorted({c[0]["content"] for c in convs}))
    sampling = Sampling(greedy=True, max_new_tokens=tokens, ignore_eos=True)

    def once(name: str) -> float:
        with_directions, specs = VARIANTS[name]
        backend.use_directions(directions if with_directions else None)
        t = time.perf_counter()
        replies = backend.generate(ChatRequest(convs, sampling, interventions=Interventions.parse(specs)))
        seconds = time.perf_counter() - t
        assert sum(r.n_tokens for r in replies) == batch * tokens, name
        assert (replies[0].activation is not None) == with_directions, name
        return seconds

    for name in VARIANTS:  # warm-up
        once(name)
    _hook_loop(backend, directions, convs[:1], 2)
    best: dict[str, float] = {}
    names = list(VARIANTS) + ["hook loop"]
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            seconds = _hook_loop(backend, directions, convs, tokens) if name == "hook loop" else once(name)
            best[name] = min(best.get(name, float("inf")), seconds)
    backend.use_directions(None)

    res = Result(
        title=f"activation: {backend.name} ({str(backend.model.dtype).removeprefix('torch.')}, {threads} torch "
        f"threads), batch {batch}, {tokens} new tokens/row incl. prefill; best of {repeats}, interleaved ({size} size)",
        columns=["variant", "best wall s", "tokens/s", "time vs plain"])
    for name in names:
        res.rows.append([name, f"{best[name]:.2f}", f"{batch * tokens / best[name]:.1f}",
                         f"{best[name] / best['plain']:.2f}x"])
    res.results = {"size": size, "torch_threads": str(threads), "batch": str(batch)}
    res.results.update({f"{KEYS[n]}_overhead": f"{best[n] / best['plain']:.3f}" for n in KEYS})
    res.results["pi_floor_vs_split_softmax"] = f"{best['pi-floor f=0.8'] / best['split-softmax k=0.9']:.3f}"
    res.results["vector_speedup_over_hook_loop"] = f"{best['hook loop'] / best['vector alpha=0.5']:.2f}"
    res.notes.append("Targets: recording <= 1.05; vector, cap <= 1.10; pi-floor within split-softmax's cost "
                     "(ratio <= 1); batched vector at least 3x a per-prompt hook loop at batch 8.")
    return res
