"""Sampling settings: validated once, in one model, with messages that say what to use."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.sampling import Nucleus, _splitmix64, inverse_cdf, sample, uniform, warpers
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
    n = 4000  # one batch: row r is seed r at step 3
    drawn = sample(logits.expand(n, -1), warpers(sampling), list(range(n)), [3] * n)
    counts = torch.bincount(drawn, minlength=6).float()
    freq = counts / counts.sum()
    assert bool((counts[expected == 0] == 0).all())
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize("first_k", [8, None])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 20.0])
def test_nucleus_keeps_the_tokens_transformers_top_p_keeps(top_p, scale, first_k):
    """Flat (scale 0.1: the nucleus is most of the vocabulary, so the top-k widens) to peaked logits,
    with a -inf row part as top-k leaves it: the same kept set and values as TopPLogitsWarper,
    widening from 8 candidates (a CPU's way) or selecting the whole vocabulary at once (a GPU's)."""
    from transformers import TopPLogitsWarper

    gen = torch.Generator().manual_seed(int(top_p * 100 + scale))
    logits = torch.randn((6, 3000), generator=gen) * scale
    logits[5, 100:] = float("-inf")  # as after a top-k warper
    want = TopPLogitsWarper(top_p)(None, logits.clone())
    got = Nucleus(top_p, first_k=first_k)(None, logits.clone())
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])


def test_nucleus_off_the_cpu_reads_nothing_back_from_the_device():
    """Off the CPU (here the meta device: shapes only, so a value read there would raise) the
    nucleus is one selection of the whole vocabulary and reads no value on the host; on a CPU a
    flat row widens, reading a flag back each time. Counted through a dispatch mode, as
    tests/test_static_decode.py counts a decode step's host reads."""
    from host_reads import HostReads

    reads = ("_local_scalar_dense", "is_nonzero")
    flat = torch.randn((4, 49152), generator=torch.Generator().manual_seed(0)) * 0.1
    with HostReads(reads) as on_meta:
        Nucleus(0.9)(None, flat.to("meta"))
    with HostReads(reads) as on_cpu:
        Nucleus(0.9)(None, flat)
    assert on_meta.seen == [] and len(on_cpu.seen) >= 4


def test_nucleus_on_a_tiny_vocabulary_and_a_tie():
    """A vocabulary smaller than the first k, and equal logits at the cut: two of the three tied
    tokens have mass above them below top_p (which two is the sort's choice, as in transformers)."""
    logits = torch.tensor([[1.0, 1.0, 1.0, -5.0]])
    got = Nucleus(0.5)(None, logits).isfinite()[0].tolist()
    assert sum(got[:3]) == 2 and not got[3]


def test_splitmix64_gives_the_published_sequence():
    """The reference generator's first outputs for seed 1234567 (its state steps by the golden
    gamma, which `_splitmix64` adds before mixing)."""
    state, got = 1234567, []
    for _ in range(3):
        got.append(_splitmix64(state))
        state = (state + 0x9E3779B97F4A7C15) % 2**64
    assert got == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_uniform_is_uniform_over_seeds_and_steps():
    """Kolmogorov-Smirnov against U(0, 1] over 20,000 (seed, step) pairs, and no repeats."""
    from scipy.stats import kstest

    u = [uniform(seed, step) for seed in range(200) for step in range(100)]
    assert all(0.0 < x <= 1.0 for x in u)
    assert len(set(u)) == len(u)
    assert kstest(u, "uniform").pvalue > 1e-3


def test_inverse_cdf_matches_a_python_loop_and_never_draws_a_zero_probability_token():
    """An independent reference: walk each row's probabilities in exact rational arithmetic until
    the running sum reaches u x total. The extreme draws u = 2^-53 and u = 1 land on the first and
    last tokens with mass, not on the zero-probability tokens around them."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn((64, 50), generator=gen) * 3, -1).double()
    probs[:, :3] = 0.0
    probs[:, -4:] = 0.0
    probs[5, 10:20] = 0.0
    u = torch.rand(64, generator=gen, dtype=torch.float64).clamp_min(2.0 ** -53)
    u[0], u[1] = 2.0 ** -53, 1.0

    def reference(row: list[float], x: float) -> int:
        exact = [Fraction(p) for p in row]
        target, run = Fraction(x) * sum(exact), Fraction(0)
        for i, p in enumerate(exact):
            run += p
            if p > 0 and run >= target:
                return i
        raise AssertionError("no token reached the target")

    got = inverse_cdf(probs, u).tolist()
    want = [reference(probs[b].tolist(), u[b].item()) for b in range(64)]
    # float64 cumsum vs exact sums may split a boundary differently only where u sits within
    # rounding of one: none of these 64 does
    assert got == want
    assert got[0] == 3 and got[1] == 45
    assert all(probs[b, got[b]] > 0 for b in range(64))


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    """Batch invariance by construction: a row's draw depends on its logits, seed and step only."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn((12, 300), generator=gen) * 2
    seeds, steps = [int(x) for x in torch.randint(0, 2**62, (12,), generator=gen)], list(range(12))
    chain = warpers(Sampling(temperature=0.9, top_p=0.95))
    together = sample(logits, chain, seeds, steps).tolist()
    alone = [sample(logits[b:b + 1], chain, seeds[b:b + 1], steps[b:b + 1]).item() for b in range(12)]
    shuffled = sample(logits.flip(0), chain, seeds[::-1], steps[::-1]).flip(0).tolist()
    assert together == alone == shuffled
    # the step moves the draw: one row over 50 steps does not repeat one token (its nucleus is wide)
    assert len(set(sample(logits[:1].expand(50, -1), chain, seeds[:1] * 50, list(range(50))).tolist())) > 5


def test_a_row_with_nothing_to_draw_is_refused():
    """All zeros (or NaN, as a softmax of all -inf gives) is an error, as in torch.multinomial."""
    probs = torch.tensor([[0.2, 0.8], [0.0, 0.0]])
    with pytest.raises(RuntimeError, match="no token can be drawn"):
        inverse_cdf(probs, torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no token can be drawn"):
        inverse_cdf(torch.tensor([[float("nan"), 0.5]]), torch.tensor([0.5], dtype=torch.float64))
