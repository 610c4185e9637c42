"""Drawing the next token: transformers' warpers, a nucleus filter that does not sort the
vocabulary, and one draw per row from that row's own generator.

Why a nucleus filter of our own: transformers' `TopPLogitsWarper` sorts every row's whole
vocabulary at every step: on a CPU, at batch 8, about as long as a small model's own decode
step (benchmarks/sampling.py: 9x slower than `Nucleus` on SmolLM2's logits). The nucleus of a chat model's next-token distribution is almost always a few
tokens, so `Nucleus` takes the top k (a partial selection, ~1 ms) and widens k only while the
nucleus might reach past it. It keeps the same tokens as the warper's definition: a token
stays iff the probability mass of the tokens strictly more likely than it is below top_p
(the most likely token always stays). `tests/test_sampling.py` checks it against
`TopPLogitsWarper` on random and peaked logits.
"""

from __future__ import annotations

import torch

from driftlab.chat.base import Sampling

FIRST_K = 64  # candidates of the first try; 4x more on each retry (a flat distribution needs more)


class Nucleus:
    """Top-p filtering (a `LogitsProcessor`: called as `warper(input_ids, scores)`)."""

    def __init__(self, top_p: float, first_k: int = FIRST_K) -> None:
        self.top_p, self.first_k = top_p, first_k

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        V = scores.shape[-1]
        log_total = scores.float().logsumexp(-1, keepdim=True)
        k = min(self.first_k, V)
        while True:
            values, index = scores.topk(k, dim=-1)  # most likely first
            probs = (values.float() - log_total).exp()
            keep = probs.cumsum(-1) - probs < self.top_p  # the mass strictly above each candidate
            keep[:, 0] = True
            # Done once every row's last candidate is out (or -inf, or the whole vocabulary is in):
            # every token past it has at least that much mass above it.
            if k == V or not bool((keep[:, -1] & values[:, -1].isfinite()).any()):
                break
            k = min(4 * k, V)
        kept = torch.full_like(scores, float("-inf"))
        return kept.scatter_(-1, index, values.masked_fill(~keep, float("-inf")))


def warpers(sampling: Sampling):
    """Temperature, top-k, nucleus and min-p, in that order, as transformers applies them (None for
    greedy decoding, which they would not change)."""
    if sampling.greedy:
        return None
    from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    chain = LogitsProcessorList()
    if sampling.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        chain.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        chain.append(Nucleus(sampling.top_p))
    if sampling.min_p > 0.0:
        chain.append(MinPLogitsWarper(sampling.min_p))
    return chain


def sample(logits: torch.Tensor, chain, gens: list[torch.Generator]) -> torch.Tensor:
    """Greedy (`chain` None) or one draw per row from that row's own generator."""
    if chain is None:
        return logits.argmax(-1)
    probs = torch.softmax(chain(None, logits), dim=-1)
    return torch.stack([torch.multinomial(probs[b], 1, generator=gens[b])[0] for b in range(probs.shape[0])])
