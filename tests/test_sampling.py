"""Sampling settings: validated once, in one model, with messages that say what to use."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.sampling import Nucleus, sample, warpers
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
    assert Sampling(temperature=0).greedy and warpers(Sampling(temperature=0)) is None


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
    chain = warpers(sampling)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sample(logits, chain, gen)[0]] += 1
    freq = counts / counts.sum()
    assert bool((counts[expected == 0] == 0).all())
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 20.0])
def test_nucleus_keeps_the_tokens_transformers_top_p_keeps(top_p, scale):
    """Flat (scale 0.1: the nucleus is most of the vocabulary, so the top-k widens) to peaked logits,
    with a -inf row part as top-k leaves it: the same kept set and values as TopPLogitsWarper."""
    from transformers import TopPLogitsWarper

    gen = torch.Generator().manual_seed(int(top_p * 100 + scale))
    logits = torch.randn((6, 3000), generator=gen) * scale
    logits[5, 100:] = float("-inf")  # as after a top-k warper
    want = TopPLogitsWarper(top_p)(None, logits.clone())
    got = Nucleus(top_p, first_k=8)(None, logits.clone())
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])


def test_nucleus_on_a_tiny_vocabulary_and_a_tie():
    """A vocabulary smaller than the first k, and equal logits at the cut: two of the three tied
    tokens have mass above them below top_p (which two is the sort's choice, as in transformers)."""
    logits = torch.tensor([[1.0, 1.0, 1.0, -5.0]])
    got = Nucleus(0.5)(None, logits).isfinite()[0].tolist()
    assert sum(got[:3]) == 2 and not got[3]
