"""Sampling settings: validated once, in one model, with messages that say what to use."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import _sample, _warpers
from driftlab.errors import DriftlabError


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"top_p": 0.0}, "greater than 0"),
        ({"top_p": 1.5}, "less than or equal to 1"),
        ({"temperature": 1e-45}, "too small to sample with"),
        ({"temperature": -1}, "greater than or equal to 0"),
        ({"temperature": float("nan")}, "finite number"),
        ({"max_new_tokens": 1_000_000_000}, "less than or equal to 32768"),
        ({"max_new_tokens": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_sampling_values_are_rejected(fields, message):
    with pytest.raises(ValidationError, match=message):
        Sampling(**fields)


def test_temperature_zero_means_greedy():
    assert Sampling(temperature=0).greedy and _warpers(Sampling(temperature=0)) is None


def test_request_checks_seeds_and_lengths():
    conv = [{"role": "user", "content": "hi"}]
    with pytest.raises(DriftlabError, match="outside"):
        ChatRequest([conv], seeds=[2**63])
    with pytest.raises(DriftlabError, match="2 seeds given for 1 conversations"):
        ChatRequest([conv], seeds=[1, 2])
    with pytest.raises(DriftlabError, match="has role 'robot'"):
        ChatRequest([[{"role": "robot", "content": "x"}]])
    assert ChatRequest([conv, conv]).row_seeds() == [0, 1]


def test_nucleus_sampling_matches_a_slow_reference_distribution():
    """Draw many samples; every token outside the nucleus never appears, the rest in proportion."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    sampling = Sampling(temperature=0.7, top_p=0.8)
    # Reference: sort, keep the smallest prefix whose mass reaches top_p, renormalise.
    probs = torch.softmax(logits[0] / 0.7, -1)
    order = probs.argsort(descending=True)
    keep, mass = [], 0.0
    for i in order.tolist():
        keep.append(i)
        mass += probs[i].item()
        if mass >= 0.8:
            break
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    gen = [torch.Generator().manual_seed(0)]
    warpers = _warpers(sampling)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[_sample(logits, warpers, gen)[0]] += 1
    freq = counts / counts.sum()
    assert bool((counts[expected == 0] == 0).all())
    assert (freq - expected).abs().max() < 0.03
