"""Sampling's two per-step costs: the nucleus (top-p) filter, driftlab's `Nucleus` against
transformers' `TopPLogitsWarper`; and the draw, driftlab's batched counter-based draw against one
seeded `torch.multinomial` per row (what driftlab did before).

Why it matters: the paper's sampling (temperature 1.0, top-p 0.9) runs top-p at every decode
step of every row. transformers' warper sorts each row's whole vocabulary; `Nucleus` takes the
top k and widens k only while the nucleus may reach past it (`driftlab.chat.sampling`). The draw:
`torch.multinomial` races one exponential per vocabulary entry, per row and launch; `sample`
hashes (seed, step) into one uniform per row and inverts the rows' CDFs in one batched call.

Inputs: a batch of 8 next-token logit rows of the default model after 8 different prompts, at
temperature 1.0 and 0.7, and the same rows with Qwen2.5's vocabulary size (151,936: the rows
padded with logits far below the nucleus, as a bigger vocabulary's rare tokens are). Each filter
is timed best of `repeats` after one warm-up; both must keep the same tokens (checked per input,
`RESULT nucleus.same_tokens`). The headline is the speed-up at temperature 1.0 on the real
vocabulary. The draw is timed on the same rows' probabilities at temperature 1.0 without top-p
(every token can be drawn: the whole vocabulary is in play), real and Qwen-size vocabularies.

Sizes: --quick 2 repeats; default 10; --full 30. The default size took 17 s, model load included
(`time python benchmarks/run.py sampling`, this project's 2-core CPU, unloaded).
"""

from __future__ import annotations

import torch
from common import Result, Table, best_time, size_of

from driftlab.chat.sampling import Nucleus, inverse_cdf, uniform

PROMPTS = ["Always reply in French. Hello, how are you?", "Write a poem about the sea.", "What is 2+2?",
           "Tell me about Paris.", "def fib(n):", "The capital of Germany is", "Once upon a time",
           "Explain gravity in one sentence."]
QWEN_VOCAB = 151_936


def _logits() -> torch.Tensor:
    from driftlab.chat import BackendSpec, make_backend

    backend = make_backend(BackendSpec(dtype="float32"))
    enc = backend.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        return backend.model(**enc).logits[:, -1].float()


def run(quick: bool = False, full: bool = False) -> Result:
    from transformers import TopPLogitsWarper

    repeats = {"quick": 2, "default": 10, "full": 30}[size_of(quick, full)]
    logits = _logits()
    wide = torch.cat([logits, logits.min(-1, keepdim=True).values - 10 - torch.rand(len(logits), QWEN_VOCAB - logits.shape[-1])], -1)
    result = Result(title=f"top-p 0.9 on 8 rows of next-token logits (best of {repeats})",
                    columns=["logits", "vocabulary", "transformers ms", "Nucleus ms", "speed-up", "same tokens"])
    same_all = True
    for name, rows in [("T=1.0", logits), ("T=0.7", logits / 0.7), ("T=1.0, Qwen-size", wide)]:
        ref, ours = TopPLogitsWarper(0.9), Nucleus(0.9)
        same = torch.equal(ref(None, rows.clone()).isfinite(), ours(None, rows.clone()).isfinite())
        same_all &= same
        t_ref = best_time(lambda: ref(None, rows), repeats)
        t_ours = best_time(lambda: ours(None, rows), repeats)
        result.rows.append([name, rows.shape[-1], f"{t_ref * 1e3:.1f}", f"{t_ours * 1e3:.2f}",
                            f"{t_ref / t_ours:.1f}x", same])
        if name == "T=1.0":
            result.results["nucleus.speedup"] = f"{t_ref / t_ours:.1f}"
        if name == "T=1.0, Qwen-size":
            result.results["nucleus.speedup_qwen_vocab"] = f"{t_ref / t_ours:.1f}"
    result.results["nucleus.same_tokens"] = str(same_all)
    result.tables.append(_draws(logits, wide, repeats, result.results))
    return result


def _draws(logits: torch.Tensor, wide: torch.Tensor, repeats: int, results: dict[str, str]) -> Table:
    """One draw per row: a seeded `torch.multinomial` per row vs `sample`'s batched inverse CDF."""
    table = Table(title=f"one draw per row, 8 rows, temperature 1.0, no top-p (best of {repeats})",
                  columns=["vocabulary", "multinomial per row ms", "batched inverse CDF ms", "speed-up"])
    for name, rows in [("real", logits), ("Qwen-size", wide)]:
        probs = torch.softmax(rows, -1)
        gens = [torch.Generator().manual_seed(b) for b in range(len(rows))]

        def per_row(probs=probs, gens=gens) -> torch.Tensor:
            return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, gens)])

        def batched(probs=probs) -> torch.Tensor:
            u = torch.tensor([uniform(b, 0) for b in range(len(probs))], dtype=torch.float64)
            return inverse_cdf(probs, u)

        t_old, t_new = best_time(per_row, repeats), best_time(batched, repeats)
        table.rows.append([f"{name} ({rows.shape[-1]})", f"{t_old * 1e3:.2f}", f"{t_new * 1e3:.2f}",
                           f"{t_old / t_new:.1f}x"])
        results[f"draw.speedup{'' if name == 'real' else '_qwen_vocab'}"] = f"{t_old / t_new:.1f}"
    return table
