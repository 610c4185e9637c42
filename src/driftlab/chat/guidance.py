"""Classifier-free guidance's mix of two next-token distributions (persona-drift paper, Eq. 5).

One function, used wherever a conditional and an unconditional pass meet: the decode loop,
conversation scoring and raw-text scoring (`driftlab.chat.text`).
"""

from __future__ import annotations

import torch


def guide(logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """lu + alpha (lc - lu) over a batch whose second half is the first half's unconditional rows
    (log-probabilities, not normalised: log-softmax them again where a distribution is needed)."""
    n = logits.shape[0] // 2
    cond, uncond = torch.log_softmax(logits[:n], dim=-1), torch.log_softmax(logits[n:], dim=-1)
    return uncond + alpha * (cond - uncond)
