"""Reuse the key/value cache of token prefixes that were already computed.

In a self-chat every new turn, and every probe, re-reads the whole dialog so far. Keeping
the KV of each finished sequence lets the next prompt that starts with it compute only its
new tokens (automatic prefix caching, as in vLLM). Entries are per conversation row,
unpadded, and tagged with a fingerprint of anything that changes the hidden states
(e.g. an attention intervention), so a cache computed under split-softmax is never reused
for a plain run.

Its budget is a share of the memory the cache lives in (`auto_budget`), not a fixed size: a batch
decodes from the shortest cached prefix of its rows (`decoding.Decoding._layout`), so one row whose
entry was evicted makes the whole batch compute its prompts again. A self-chat of 20 dialogs of 40
rounds keeps about 4 GB of qwen2.5-1.5B's KV; under the former fixed 2 GiB, every step past round
~25 recomputed every dialog: 10 minutes a step of 20 replies on a 2-core CPU, against 2 minutes on
one core (beside another run) with the dialogs kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

#: The share of the memory free when the cache is made (host RAM, or the GPU's) that it may fill.
FREE_SHARE = 0.5


@dataclass
class Entry:
    tokens: np.ndarray  # int64 [L]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [Hkv, L, d]
    tag: str

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def auto_budget(device: torch.device | str = "cpu") -> int:
    """Bytes a prefix cache on `device` may fill: `FREE_SHARE` of the memory free there now (after the
    model's weights were loaded), leaving the rest to the decode batch's own KV and activations."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(free * FREE_SHARE)


class PrefixCache:
    """LRU store of per-sequence KV caches, bounded in bytes."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = max_bytes
        self.evicted = 0  # entries dropped for the budget (statistics; a run that evicts says so once)
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next_id = 0
        self.hits_tokens = 0  # statistics: tokens served from cache
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def lookup(self, tokens: np.ndarray, tag: str) -> tuple[int, Entry | None]:
        """Longest common prefix between `tokens` and any entry with the same tag."""
        self.lookups += 1
        best_len, best_id = 0, None
        for eid, entry in self._entries.items():
            if entry.tag != tag:
                continue
            n = common_prefix_len(entry.tokens, tokens)
            if n > best_len:
                best_len, best_id = n, eid
        if best_id is None:
            return 0, None
        self._entries.move_to_end(best_id)
        self.hits_tokens += best_len
        return best_len, self._entries[best_id]

    def peek(self, tokens: np.ndarray, tag: str) -> int:
        """`lookup`'s length without its effects (LRU order, statistics): what a caller plans batches by."""
        return max((common_prefix_len(e.tokens, tokens) for e in self._entries.values() if e.tag == tag), default=0)

    def plan(self, prompts: list[np.ndarray], tags: list[str], compute_from: list[int]) -> list[list[int]]:
        """The rows of one teacher-forced read in batches of similar uncached length (`similar_lengths`):
        a KL's contexts extend cached ones by a turn, or a whole dialog where nothing is cached. A row's
        tokens from `compute_from` on are computed whatever the cache holds."""
        uncached = [len(p) - min(self.peek(p, tag), start, len(p) - 1)
                    for p, tag, start in zip(prompts, tags, compute_from, strict=True)]
        return similar_lengths(uncached)

    def store(self, tokens: np.ndarray, kv: list[tuple[torch.Tensor, torch.Tensor]], tag: str) -> None:
        """Add an entry; entries that are a prefix of it become redundant and are dropped."""
        if len(tokens) == 0 or self.max_bytes <= 0:
            return
        for eid in [
            eid
            for eid, e in self._entries.items()
            if e.tag == tag and len(e.tokens) <= len(tokens) and common_prefix_len(e.tokens, tokens) == len(e.tokens)
        ]:
            del self._entries[eid]
        self._entries[self._next_id] = Entry(tokens, kv, tag)
        self._next_id += 1
        total = self.nbytes
        while total > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            total -= old.nbytes
            self.evicted += 1
            if self.evicted == 1:
                from driftlab.console import err_console

                err_console().print(f"note: the prefix cache is full ({self.max_bytes / 2**30:.1f} GiB): it drops its "
                                    "oldest entries, and a batch with a dropped row computes its prompts again (said "
                                    "once).", highlight=False, markup=False)


def similar_lengths(lengths: list[int], waste: float = 0.15) -> list[list[int]]:
    """Indices of `lengths` in groups (longest first) whose padding to their longest wastes at most
    `waste` of the positions they compute: a left-padded batch computes, for every row, the longest
    uncached suffix of any row, so rows that extend a long cached prefix by a few tokens (a KL's next
    turn) and rows with no prefix cached (a first turn) are better read apart."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and lengths[group[0]] * (len(group) + 1) <= (1 + waste) * (
                sum(lengths[j] for j in group) + lengths[i]):
            group.append(i)
        else:
            groups.append([i])
    return groups
