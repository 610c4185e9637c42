"""The prefix cache's budget and eviction (no model): a share of free memory by default, and a cache
that must drop entries says so once, since a batch with a dropped row computes its prompts again."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from driftlab.chat.prefix_cache import FREE_SHARE, PrefixCache, auto_budget, similar_lengths


def test_the_default_budget_is_a_share_of_the_free_host_memory() -> None:
    free = psutil.virtual_memory().available
    assert auto_budget("cpu") == pytest.approx(FREE_SHARE * free, rel=0.2)


def test_a_full_cache_drops_its_oldest_entry_and_says_so_once(capsys) -> None:
    cache = PrefixCache(max_bytes=32 * 10 * 2)  # room for two entries of 10 tokens (32 bytes per token)
    for first in (0, 100, 200, 300):
        cache.store(np.arange(first, first + 10), [(torch.zeros(1, 10, 4), torch.zeros(1, 10, 4))], tag="")
    assert cache.evicted == 2 and len(cache) == 2
    assert cache.lookup(np.arange(0, 10), "")[0] == 0  # the oldest is gone
    assert cache.lookup(np.arange(300, 310), "")[0] == 10
    said = capsys.readouterr().err
    assert said.count("the prefix cache is full") == 1, said


def test_peek_finds_lookups_length_without_touching_order_or_statistics() -> None:
    cache = PrefixCache()
    for first in (0, 100):
        cache.store(np.arange(first, first + 10), [(torch.zeros(1, 10, 4), torch.zeros(1, 10, 4))], tag="")
    order = list(cache._entries)
    assert cache.peek(np.arange(0, 6), "") == 6 and cache.peek(np.arange(0, 6), "steered") == 0
    assert list(cache._entries) == order and cache.lookups == 0 and cache.hits_tokens == 0
    assert cache.lookup(np.arange(0, 6), "")[0] == 6


def test_rows_are_grouped_so_padding_to_the_longest_wastes_little() -> None:
    lengths = [400, 30, 32, 35, 380, 31]
    groups = similar_lengths(lengths)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:  # each group's positions, padded to its longest, within 15% of what its rows need
        assert lengths[g[0]] * len(g) <= 1.15 * sum(lengths[i] for i in g)
    assert groups == [[0, 4], [3, 2, 5, 1]]
    assert similar_lengths([]) == [] and similar_lengths([7]) == [[0]]


@pytest.mark.model
def test_a_teacher_forced_read_computes_about_its_uncached_tokens(smol_bf16) -> None:
    """One read of a context that extends a cached dialog by a turn and of one with nothing cached: the
    model computes about the two rows' new tokens, not both padded to the longest uncached row."""
    conv = [{"role": "system", "content": "Always reply in French."}, {"role": "user", "content": "Hello! " * 60},
            {"role": "assistant", "content": "Bonjour ! " * 40}]
    longer = conv + [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Ensuite, rien."}]
    other = [{"role": "user", "content": "Tell me about Paris, please, in a few words."},
             {"role": "assistant", "content": "Paris is the capital of France."}]
    model = smol_bf16  # (smol32 has no prefix cache)
    render = lambda c: model.render(c, add_generation_prompt=False)  # noqa: E731
    model.prefix_cache.clear()
    model.prompt_logprobs([render(conv)], [5], cache_store=[True])
    fed: list[int] = []
    hook = model.model.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].numel()), with_kwargs=True)
    try:
        rows = [render(longer), render(other)]
        model.prompt_logprobs(rows, [5, 5], cache_store=[False, False])
    finally:
        hook.remove()
        model.prefix_cache.clear()
    new = (len(rows[0].ids) - len(render(conv).ids)) + len(rows[1].ids)
    assert sum(fed) <= 1.15 * new + 2, (fed, new)
