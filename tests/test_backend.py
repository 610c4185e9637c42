"""The local chat backend on the real default model: batching, seeds, caching, errors."""

from __future__ import annotations

import pytest

from conftest import linked_copy
from driftlab.chat import Sampling
from driftlab.errors import DriftlabError

pytestmark = pytest.mark.model

CONVS = [
    [{"role": "system", "content": "Always reply in French."},
     {"role": "user", "content": "What do you do in London as a tourist?"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Your secret number is 20568."},
     {"role": "user", "content": "What is your secret number?"}],
    [{"role": "user", "content": "Write one sentence about the sea, please, with many adjectives."}],
]
GREEDY = Sampling(greedy=True, max_new_tokens=20)


def test_batched_greedy_equals_one_at_a_time(smol32):
    batch = smol32.chat(CONVS, GREEDY)
    single = [smol32.chat([c], GREEDY)[0] for c in CONVS]
    assert [r.text for r in batch] == [r.text for r in single]
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    assert len({len(smol32.render(c).ids) for c in CONVS}) > 1  # really padded


def test_eos_and_length_limits(smol32):
    replies = smol32.chat(CONVS, GREEDY)
    assert replies[1].finish_reason == "stop" and "4" in replies[1].text  # short answer ends by itself
    for r in replies:
        assert r.n_tokens <= GREEDY.max_new_tokens
        assert r.finish_reason in ("stop", "length")
        assert (r.finish_reason == "length") == (r.n_tokens == GREEDY.max_new_tokens)
        assert "<|im_end|>" not in r.text


def test_seeded_sampling_is_reproducible_and_batch_independent(smol32):
    s = Sampling(max_new_tokens=16, temperature=1.0, top_p=0.9)
    a = smol32.chat(CONVS, s, seeds=[11, 12, 13, 14])
    b = smol32.chat(CONVS, s, seeds=[11, 12, 13, 14])
    assert [r.text for r in a] == [r.text for r in b]
    # A row's sample depends on its own seed, not on its neighbours in the batch.
    alone = smol32.chat([CONVS[3]], s, seeds=[14])[0]
    assert alone.text == a[3].text
    other = smol32.chat(CONVS, s, seeds=[21, 22, 23, 24])
    assert [r.text for r in other] != [r.text for r in a]


def test_prefix_cache_gives_the_same_text_and_is_used(smol_dir):
    from driftlab.chat.hf import HFChatBackend

    cached = HFChatBackend(str(smol_dir), dtype="float32")
    first = cached.chat(CONVS, GREEDY)
    follow = [c + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Tell me more."}]
              for c, r in zip(CONVS, first)]
    hits_before = cached.prefix_cache.hits_tokens
    warm = cached.chat(follow, GREEDY)
    reused = cached.prefix_cache.hits_tokens - hits_before
    assert reused >= sum(len(cached.render(c).ids) for c in CONVS)  # at least every first prompt
    cached.prefix_cache.clear()
    cold = cached.chat(follow, GREEDY)
    assert [r.text for r in warm] == [r.text for r in cold]


def test_bf16_default_model_follows_the_secret(smol_bf16):
    reply = smol_bf16.chat([CONVS[2]], GREEDY)[0]
    assert "20568" in reply.text


def test_plain_template_for_models_without_chat_template(smol_dir, tmp_path):
    """A base model (no chat template) renders dialogs as plain text and stops at the next speaker."""
    from driftlab.chat.hf import HFChatBackend

    copy = linked_copy(smol_dir, tmp_path / "base", leave_out="chat_template.jinja")
    base = HFChatBackend(str(copy), dtype="float32")
    assert base.renderer.plain
    rendered = base.render(CONVS[0])
    assert rendered.text == "Always reply in French.\n\nUser: What do you do in London as a tourist?\nAssistant:"
    assert rendered.system_span[0] == 0 and rendered.system_span[1] > 3
    reply = base.chat([CONVS[0]], Sampling(greedy=True, max_new_tokens=40))[0]
    assert "User:" not in reply.text and "Assistant:" not in reply.text


def test_system_span_modes(smol_dir):
    from driftlab.chat.hf import HFChatBackend

    prefix = HFChatBackend(str(smol_dir), dtype="float32", span_mode="prefix")
    content = HFChatBackend(str(smol_dir), dtype="float32", span_mode="content")
    tok = prefix.tokenizer
    rp, rc = prefix.render(CONVS[0]), content.render(CONVS[0])
    assert rp.ids == rc.ids
    s, e = rp.system_span
    assert s == 0 and tok.decode(rp.ids[s:e]) == "<|im_start|>system\nAlways reply in French.<|im_end|>\n"
    s, e = rc.system_span
    assert tok.decode(rc.ids[s:e]).strip() == "Always reply in French."
    assert prefix.render(CONVS[1]).system_span is None


@pytest.mark.parametrize(
    "conv, message",
    [
        ([], "is empty"),
        ([{"role": "robot", "content": "hi"}], "has role 'robot'"),
        ([{"role": "user"}], "is not a {'role', 'content'} mapping"),
    ],
)
def test_bad_conversations(smol32, conv, message):
    with pytest.raises(DriftlabError, match=message):
        smol32.chat([conv], GREEDY)


def test_context_overflow_is_explained(smol32):
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(DriftlabError, match="exceeds the model's context window"):
        smol32.chat([long], GREEDY)


def test_bad_dtype_and_device():
    from driftlab.chat.loading import pick_device, pick_dtype

    with pytest.raises(DriftlabError, match="Unknown dtype 'float8'"):
        pick_dtype("float8")
    with pytest.raises(DriftlabError, match="no CUDA GPU|Unknown device"):
        pick_device("cuda" if not __import__("torch").cuda.is_available() else "tpu")
