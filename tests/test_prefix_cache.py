"""The prefix cache's budget and eviction (no model): a share of free memory by default, and a cache
that must drop entries says so once, since a batch with a dropped row computes its prompts again."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from driftlab.chat.prefix_cache import FREE_SHARE, PrefixCache, auto_budget


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
