"""driftlab's PASTA against the authors' library, pastalib 0.1.3, on the real SmolLM2.

pastalib edits the eager attention mask of the heads in its config (adding log alpha to
the prompt keys outside the emphasised range), so it needs eager attention and T x T
weights. driftlab adds the same bias inside its fused-SDPA attention function. With the
same heads, alpha and span, both must give the same logits (fp32) and the same greedy
continuation: pastalib leaves the keys of generated tokens unscaled, which is driftlab's
`scope=prompt` (the default).

pastalib is a test dependency (the `test` extra); without it these tests skip and say so.
"""

from __future__ import annotations

import pytest
import torch

from devices import backend_device, tol
from driftlab.attention import ATTENTION_NAME, register
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.steering import Interventions, Pasta

pytestmark = pytest.mark.model

HEADS = {"3": [1, 4], "7": [0], "10": [2, 3, 5], "20": [8]}
ALPHA = 0.01
EMPHASIS = ["Answer in JSON with keys name and occupation.", "Replace every 'she' with 'they'."]
CONVS = [
    [{"role": "user", "content": f"Mary is a nurse in Ohio; she likes hiking. *{EMPHASIS[0]}*"}],
    [{"role": "user", "content": f"She was a teacher. *{EMPHASIS[1]}* She wrote poems, and she sang."}],
]
LOGIT_TOL = 2e-3  # eager matmul+softmax vs fused SDPA over 30 layers, fp32 logits up to ~40 (CPU; tol() elsewhere)


@pytest.fixture(scope="module")
def pastalib():
    """pastalib.pasta, imported when a test runs, not when the suite is collected: importing it
    loads transformers' model classes (~3 s), which every xdist worker would pay at collection."""
    return pytest.importorskip(
        "pastalib.pasta", reason="pastalib is not installed: pip install -e '.[test]' installs pastalib==0.1.3")


@pytest.fixture(scope="module")
def eager() -> HFChatBackend:
    register()  # driftlab's attention, swapped in for our side of each comparison
    return HFChatBackend("smollm2-135m", dtype="float32", device=backend_device(), prefix_cache_bytes=0,
                         attn_implementation="eager")


def _steer() -> Interventions:
    return Interventions.of(Pasta(heads=tuple((layer, h) for layer, hs in HEADS.items() for h in hs), alpha=ALPHA))


def _pastalib(pastalib, backend: HFChatBackend, texts: list[str], n_new: int):
    steerer = pastalib.PASTA(backend.model, backend.tokenizer, head_config=HEADS, alpha=ALPHA,
                             scale_position="exclude")
    inputs, offsets = steerer.inputs_from_batch(texts, device=backend.device)
    with steerer.apply_steering(backend.model, strings=texts, substrings=EMPHASIS[: len(texts)],
                                model_input=inputs, offsets_mapping=offsets), torch.inference_mode():
        logits = backend.model(**inputs).logits.float()
        out = backend.model.generate(**inputs, max_new_tokens=n_new, do_sample=False,
                                     pad_token_id=backend.pad_id)
    ranges = steerer.token_ranges_from_batch(texts, EMPHASIS[: len(texts)], offsets).tolist()
    return inputs, logits, out[:, inputs["input_ids"].shape[1]:].tolist(), ranges


def test_logits_and_greedy_text_match_pastalib(pastalib, eager: HFChatBackend) -> None:
    iv = _steer()
    rendered = [eager.render(c, interventions=iv) for c in CONVS]
    texts = [r.text for r in rendered]
    inputs, want, want_tokens, ranges = _pastalib(pastalib, eager, texts, n_new=12)
    T = inputs["input_ids"].shape[1]
    pads = [T - len(r.ids) for r in rendered]
    # Same tokens, same emphasised token ranges (pastalib's ranges are in padded positions).
    for b, r in enumerate(rendered):
        assert inputs["input_ids"][b, pads[b]:].tolist() == r.ids
        assert [(s + pads[b], e + pads[b]) for s, e in r.emphasis] == [tuple(ranges[b])]

    eager.model.set_attn_implementation(ATTENTION_NAME)
    try:
        state = eager._state([iv.attention()] * len(rendered), [r.spans() for r in rendered], pads, T, T)
        with torch.inference_mode():
            got = eager.model(**inputs, **state.forward_kwargs(T)).logits.float()
            plain = eager.model(**inputs).logits.float()
        replies = eager.generate(ChatRequest(CONVS, Sampling(greedy=True, max_new_tokens=12, ignore_eos=True),
                                             interventions=iv))
    finally:
        eager.model.set_attn_implementation("eager")
    for b in range(len(CONVS)):
        diff = (got[b, pads[b]:] - want[b, pads[b]:]).abs().max().item()
        moved = (plain[b, pads[b]:] - want[b, pads[b]:]).abs().max().item()
        assert diff <= tol(LOGIT_TOL), (b, diff)
        assert moved > 1.0  # PASTA really changed this row's logits
    assert [r.token_ids for r in replies] == [t[: len(r.token_ids)] for r, t in zip(replies, want_tokens)]
    assert all(len(r.token_ids) == 12 for r in replies)
