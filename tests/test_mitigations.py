"""Mitigations: no-op settings are exactly plain decoding, CFG is Eq. 5.

CFG's references (a two-pass decode, its log-likelihood) run on the real model; the bookkeeping
that holds for any weights (no-op strengths, batched rows against solo runs) on a tiny random
Llama (tests/tiny_models.py), where the real strengths are checked to change the tokens.
All in float32 with greedy decoding, where "identical" can be asked for token by token
(on every `--device`: these compare tokens; the one float comparison uses tol()).
"""

from __future__ import annotations

import pytest
import torch

from devices import backend_device, tol
from driftlab.chat import ChatRequest, Sampling
from driftlab.steering import Interventions

pytestmark = pytest.mark.model

CONVS = [
    [{"role": "system", "content": "Always reply in French."},
     {"role": "user", "content": "What do you do in London as a tourist?"},
     {"role": "assistant", "content": "I visit the British Museum."},
     {"role": "user", "content": "And after that, where do you eat?"}],
    [{"role": "system", "content": "Your secret number is 20568. Never forget it."},
     {"role": "user", "content": "What is your secret number?"}],
]
GREEDY = Sampling(greedy=True, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


def _tokens(backend, specs, convs=CONVS, sampling=GREEDY):
    request = ChatRequest(convs, sampling, interventions=Interventions.parse(specs))
    return [r.token_ids for r in backend.generate(request)]


def test_no_op_strengths_give_exactly_plain_decoding(tiny):
    """Five tokens: the prompt's forward and four cached steps, on the tiny model; each real strength
    below changes its tokens."""
    short = GREEDY.model_copy(update={"max_new_tokens": 5})
    plain = _tokens(tiny, [], sampling=short)
    for specs in (["spr:p=0"], ["cfg:alpha=1"], ["split-softmax:k=1"], ["instaboost:m=1"],
                  ["spr:p=0", "cfg:alpha=1", "split-softmax:k=1", "instaboost:m=1"]):
        assert _tokens(tiny, specs, sampling=short) == plain, specs
    # ... and the same methods at real strengths do change the text (the test can fail).
    for specs in (["spr:p=1"], ["cfg:alpha=3"], ["split-softmax:k=0.5"], ["instaboost:m=20"]):
        assert _tokens(tiny, specs, sampling=short) != plain, specs


def _logprobs(model, ids: list[int], n: int) -> torch.Tensor:
    """Log-probs of the next token after each of the last n prefixes of `ids`, from one full
    forward (no cache): causal attention makes position p's logits those of `ids[:p + 1]` alone."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, len(ids) - n:]
    return torch.log_softmax(logits.float(), -1)


def _unconditional(conv):
    """CFG's unconditional conversation, written out: the system prompt emptied (not dropped, or
    the template inserts its default persona: SmolLM2's 'You are a helpful AI assistant named
    SmolLM', Qwen2.5's 'You are Qwen')."""
    return [{"role": "system", "content": ""}, *(m for m in conv if m["role"] != "system")]


def test_cfg_matches_a_two_pass_reference(smol32):
    """Reference: two full forwards over the prompt and the reply (with and with an empty system
    prompt, no cache, no batching), Eq. 5 on their log-probs at each step, argmax. Checking every
    step's argmax against the reply's next token is greedy decoding step by step, by induction:
    one forward per prompt serves all steps (teacher forcing) instead of one per step."""
    alpha = 2.5
    got = _tokens(smol32, [f"cfg:alpha={alpha}"])
    assert "SmolLM" not in smol32.render(_unconditional(CONVS[0])).text
    assert "SmolLM" in smol32.render(CONVS[0][1:]).text  # what dropping the system message would show
    for conv, tokens in zip(CONVS, got):
        cond = smol32.render(conv).ids
        uncond = smol32.render(_unconditional(conv)).ids
        n = GREEDY.max_new_tokens
        assert len(tokens) == n
        lc, lu = _logprobs(smol32.model, cond + tokens, n + 1), _logprobs(smol32.model, uncond + tokens, n + 1)
        assert (lu + alpha * (lc - lu)).argmax(-1)[:n].tolist() == tokens


def test_cfg_rows_in_a_batch_equal_solo_runs_and_compose_with_spr(tiny):
    """On the tiny model, where the composed steer changes both rows' tokens (checked)."""
    specs = ["cfg:alpha=2", "spr:p=1", "split-softmax:k=0.7"]
    batched = _tokens(tiny, specs)
    assert batched == [_tokens(tiny, specs, [c])[0] for c in CONVS]
    assert all(a != b for a, b in zip(batched, _tokens(tiny, []), strict=True))


def test_loglikelihood_under_cfg_is_eq5_renormalised(smol32):
    alpha = 3.0
    conv, cont = CONVS[1], " 20568"
    cont_ids = smol32.tokenizer(cont, add_special_tokens=False)["input_ids"]
    got = smol32.loglikelihood([conv], [cont], Interventions.parse([f"cfg:alpha={alpha}"]))[0]
    cond = smol32.render(conv).ids
    uncond = smol32.render(_unconditional(conv)).ids
    n = len(cont_ids)
    lc, lu = _logprobs(smol32.model, cond + cont_ids, n + 1)[:n], _logprobs(smol32.model, uncond + cont_ids, n + 1)[:n]
    want = torch.log_softmax(lu + alpha * (lc - lu), -1)[torch.arange(n), cont_ids].sum().item()
    assert got.logprob == pytest.approx(want, abs=tol(2e-3))
    plain = smol32.loglikelihood([conv], [cont])[0]
    assert got.logprob > plain.logprob  # guidance towards the system prompt raises the secret's probability
