"""Drawing the next token: transformers' warpers, a nucleus filter that does not sort the
vocabulary, and one batched draw whose number for each row is fixed by (seed, step) alone.

Why counter-based draws: a row's token must not depend on which other rows share its batch
(a resumed run reproduces an uninterrupted one; a served request gets the same tokens alone
and in any mix). Per-row `torch.Generator`s give that, but `torch.multinomial` draws one
exponential per vocabulary entry per row (its Gumbel race), one launch per row per step: on a
CPU at batch 8 over SmolLM2's vocabulary, about as long as the model's decode step
(benchmarks/sampling.py). `sample` instead hashes (seed, step) into one uniform per row on the
host (SplitMix64, a well-known 64-bit mixer) and inverts every row's CDF in one batched
`cumsum` + `searchsorted`: the same distribution, a few kernels for the whole batch.

Why a nucleus filter of our own: transformers' `TopPLogitsWarper` sorts every row's whole
vocabulary at every step: on a CPU, at batch 8, about as long as a small model's own decode
step (benchmarks/sampling.py: 9x slower than `Nucleus` on SmolLM2's logits). The nucleus of a chat model's next-token distribution is almost always a few
tokens, so `Nucleus` takes the top k (a partial selection, ~1 ms) and widens k only while the
nucleus might reach past it. It keeps the same tokens as the warper's definition: a token
stays iff the probability mass of the tokens strictly more likely than it is below top_p
(the most likely token always stays). `tests/test_sampling.py` checks it against
`TopPLogitsWarper` on random and peaked logits.

Off the CPU it selects the whole vocabulary at once. There a sort is cheap, and each widening
check reads a flag back, waiting for the device. A flat distribution (a model of random weights,
as benchmarks/gpu.py builds) took six selections a step over SmolLM2's vocabulary (64 candidates,
4x more each time), five of them followed by a wait.
"""

from __future__ import annotations

import torch

from driftlab.chat.base import Sampling

FIRST_K = 64  # candidates of the first try; 4x more on each retry (a flat distribution needs more)


class Nucleus:
    """Top-p filtering (a `LogitsProcessor`: called as `warper(input_ids, scores)`). `first_k`: the
    candidates of the first try on a CPU; None, or scores off the CPU, take the whole vocabulary
    in one selection, which reads nothing back from the device (see the module docstring)."""

    def __init__(self, top_p: float, first_k: int | None = FIRST_K) -> None:
        self.top_p, self.first_k = top_p, first_k

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        V = scores.shape[-1]
        log_total = scores.float().logsumexp(-1, keepdim=True)
        k = V if self.first_k is None or scores.device.type != "cpu" else min(self.first_k, V)
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


MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood, 2014): a bijection of 64-bit words
    whose outputs pass BigCrush."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """The number in (0, 1] that a row seeded `seed` draws its `step`-th token with (53 bits:
    every float64 of that grid; 0 is excluded so that no zero-probability token can be drawn)."""
    h = _splitmix64(_splitmix64(seed & MASK64) ^ (step & MASK64))
    return ((h >> 11) + 1) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability reaches u x the row's total: token i
    is drawn with probability p_i / total, and a zero-probability token never (its CDF step is
    empty). float64 so that the tail of a 150k vocabulary keeps its mass."""
    cdf = probs.to(torch.float64).cumsum(-1)
    # as torch.multinomial refuses such a row, without a host sync on a GPU (NaN > 0 is False)
    torch._assert_async((cdf[:, -1] > 0).all(), "no token can be drawn: a row's probabilities are all 0 or NaN")
    return torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:]).squeeze(-1)


def sample(logits: torch.Tensor, chain, seeds: list[int], steps: list[int]) -> torch.Tensor:
    """Greedy (`chain` None) or, per row, the draw that its seed and step fix (see the module
    docstring): independent of the other rows of the batch."""
    if chain is None:
        return logits.argmax(-1)
    probs = torch.softmax(chain(None, logits), dim=-1)
    u = torch.tensor([uniform(s, n) for s, n in zip(seeds, steps, strict=True)], dtype=torch.float64)
    return inverse_cdf(probs, u.to(probs.device))
