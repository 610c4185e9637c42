"""The local chat backend: batching, seeds, caching, errors.

On the real default model where what is checked needs one (its replies, its template, its
log-likelihoods against a reference, composed steers leaving a batch); on a tiny random Llama
(tests/tiny_models.py) where it is bookkeeping that holds for any weights (seeds, the prefix
cache, per-row limits, the other steers leaving a batch), each with a check that the tiny
model's replies differ where they must, so that an equality cannot pass vacuously."""

from __future__ import annotations

import pytest

from conftest import linked_copy
from devices import backend_device, tol
from driftlab.chat import Sampling, chat
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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (tests/tiny_models.py) whose greedy replies to CONVS differ row from row
    (seed 0's loop on one token in two rows)."""
    from tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("backend") / "llama", seed=1)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The tiny Llama without a prefix cache (as smol32)."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def tiny_cached_backend(tiny_dir):
    """The tiny Llama with its prefix cache (as cached_backend)."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_dir), dtype="float32", device=backend_device())


@pytest.fixture
def tiny_cached(tiny_cached_backend):
    """`tiny_cached_backend` with an empty prefix cache, as a backend just loaded has."""
    tiny_cached_backend.prefix_cache.clear()
    return tiny_cached_backend


@pytest.fixture(scope="module")
def greedy_batch(smol32):
    """The four conversations decoded greedily in one batch (two tests read the same replies)."""
    return chat(smol32, CONVS, GREEDY)


@pytest.fixture(scope="module")
def cached_backend(smol_dir):
    """SmolLM2 with its prefix cache (the session's smol32 has none), loaded once for the module."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(smol_dir), dtype="float32", device=backend_device())


@pytest.fixture
def cached(cached_backend):
    """`cached_backend` with an empty prefix cache, as a backend just loaded has."""
    cached_backend.prefix_cache.clear()
    return cached_backend


def test_batched_greedy_equals_one_at_a_time(smol32, greedy_batch):
    batch = greedy_batch
    single = [chat(smol32, [c], GREEDY)[0] for c in CONVS]
    assert [r.text for r in batch] == [r.text for r in single]
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    assert len({len(smol32.render(c).ids) for c in CONVS}) > 1  # really padded


def test_eos_and_length_limits(greedy_batch):
    replies = greedy_batch
    assert replies[1].finish_reason == "stop" and "4" in replies[1].text  # short answer ends by itself
    for r in replies:
        assert r.n_tokens <= GREEDY.max_new_tokens
        assert r.finish_reason in ("stop", "length")
        assert (r.finish_reason == "length") == (r.n_tokens == GREEDY.max_new_tokens)
        assert "<|im_end|>" not in r.text


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    """Bookkeeping of seeds, on the tiny model: its near-flat distributions make every seed's
    sample another (checked), so a row reading another row's seed shows."""
    s = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9)
    a = chat(tiny, CONVS, s, seeds=[11, 12, 13, 14])
    b = chat(tiny, CONVS, s, seeds=[11, 12, 13, 14])
    assert [r.text for r in a] == [r.text for r in b]
    # A row's sample depends on its own seed, not on its neighbours in the batch.
    alone = chat(tiny, [CONVS[3]], s, seeds=[14])[0]
    assert alone.text == a[3].text
    other = chat(tiny, CONVS, s, seeds=[21, 22, 23, 24])
    assert all(x.text != y.text for x, y in zip(other, a, strict=True))


def test_prefix_cache_gives_the_same_text_and_is_used(tiny_cached):
    """On the tiny model (the cache's bookkeeping holds for any weights; test_done_rows... keeps it on
    SmolLM2 for CFG): a reply read from a wrong cache differs at once."""
    cached = tiny_cached
    greedy = Sampling(greedy=True, max_new_tokens=8)
    first = chat(cached, CONVS, greedy)
    follow = [c + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Tell me more."}]
              for c, r in zip(CONVS, first)]
    hits_before = cached.prefix_cache.hits_tokens
    warm = chat(cached, follow, greedy)
    reused = cached.prefix_cache.hits_tokens - hits_before
    assert reused >= sum(len(cached.render(c).ids) for c in CONVS)  # at least every first prompt
    cached.prefix_cache.clear()
    cold = chat(cached, follow, greedy)
    assert [r.text for r in warm] == [r.text for r in cold]


def test_bf16_default_model_follows_the_secret(smol_bf16):
    reply = chat(smol_bf16, [CONVS[2]], GREEDY)[0]
    assert "20568" in reply.text


def test_plain_template_for_models_without_chat_template(smol_dir, tmp_path):
    """A base model (no chat template) renders dialogs as plain text and stops at the next speaker."""
    from driftlab.chat.hf import HFChatBackend

    copy = linked_copy(smol_dir, tmp_path / "base", leave_out="chat_template.jinja")
    base = HFChatBackend(str(copy), dtype="float32", device=backend_device())
    assert base.renderer.plain
    rendered = base.render(CONVS[0])
    assert rendered.text == "Always reply in French.\n\nUser: What do you do in London as a tourist?\nAssistant:"
    assert rendered.system_span[0] == 0 and rendered.system_span[1] > 3
    reply = chat(base, [CONVS[0]], Sampling(greedy=True, max_new_tokens=40))[0]
    assert "User:" not in reply.text and "Assistant:" not in reply.text


def test_system_span_modes(smol_dir, smol32):
    from driftlab.chat.hf import HFChatBackend

    prefix = HFChatBackend(str(smol_dir), dtype="float32", device=backend_device(), span_mode="prefix")
    content = smol32  # span_mode="content", the default
    assert content.renderer.span_mode == "content"
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
        chat(smol32, [conv], GREEDY)


def test_context_overflow_is_explained(smol32):
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(DriftlabError, match="exceeds the model's context window"):
        chat(smol32, [long], GREEDY)


def test_bad_dtype_and_device():
    from driftlab.chat.loading import pick_device, pick_dtype

    with pytest.raises(DriftlabError, match="Unknown dtype 'float8'"):
        pick_dtype("float8")
    with pytest.raises(DriftlabError, match="no CUDA GPU|Unknown device"):
        pick_device("cuda" if not __import__("torch").cuda.is_available() else "tpu")


# -- log-likelihood scoring (MMLU, PASTA evaluation) -------------------------------------------
def _reference_logprob(backend, conv, continuation: str) -> float:
    """Slow and independent: one unpadded row, eager attention, the full logit matrix."""
    import torch

    ctx = backend.render(conv).ids
    cont = backend.tokenizer(continuation, add_special_tokens=False)["input_ids"]
    backend.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            logits = backend.model(input_ids=torch.tensor([ctx + cont], device=backend.device)).logits[0].float()
    finally:
        from driftlab.attention import ATTENTION_NAME

        backend.model.set_attn_implementation(ATTENTION_NAME)
    logp = torch.log_softmax(logits, -1)
    return sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_loglikelihood_matches_an_unbatched_eager_reference(smol32):
    pairs = [(CONVS[0], " Je"), (CONVS[1], "4"), (CONVS[2], "My secret number is 20568."), (CONVS[3], " B")]
    got = smol32.loglikelihood([c for c, _ in pairs], [x for _, x in pairs])
    for (conv, cont), ll in zip(pairs, got):
        assert ll.logprob == pytest.approx(_reference_logprob(smol32, conv, cont), abs=tol(2e-3))
        assert ll.n_tokens == len(smol32.tokenizer(cont, add_special_tokens=False)["input_ids"])
    assert got[2].logprob > got[0].logprob - 100 and got[2].n_tokens > 3
    # Order of rows and batch size do not matter.
    solo = smol32.loglikelihood([pairs[3][0]], [pairs[3][1]])[0]
    assert solo.logprob == pytest.approx(got[3].logprob, abs=tol(1e-4))


def test_loglikelihood_under_an_intervention_agrees_with_its_greedy_decode(tiny):
    """On the tiny model (the reference comparison above is SmolLM2's)."""
    from driftlab.chat import ChatRequest
    from driftlab.steering import Interventions

    steer = Interventions.parse(["split-softmax:k=0.5"])
    sampling = Sampling(greedy=True, max_new_tokens=6, ignore_eos=True)
    steered = tiny.generate(ChatRequest([CONVS[0]], sampling, interventions=steer))[0]
    plain = tiny.generate(ChatRequest([CONVS[0]], sampling))[0]
    assert steered.token_ids != plain.token_ids  # the intervention matters here
    text = tiny.tokenizer.decode(steered.token_ids)
    under, without = (tiny.loglikelihood([CONVS[0]], [text], iv)[0] for iv in (steer, Interventions()))
    assert under.is_greedy and not without.is_greedy
    assert under.logprob != pytest.approx(without.logprob, abs=1e-3)
    with pytest.raises(DriftlabError, match="encodes to no tokens"):
        tiny.loglikelihood([CONVS[0]], [""])


def _tokenizer(smol_dir, *, bos: bool, chat: bool):
    """SmolLM2's tokenizer, optionally made to start text with BOS (as Gemma's and Llama's do)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    if not chat:
        tok.chat_template = None
    if bos:
        tok._tokenizer.post_processor = TemplateProcessing(
            single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
        assert tok("a")["input_ids"][0] == tok.bos_token_id
    return tok


@pytest.mark.parametrize("chat_template", [False, True])
@pytest.mark.parametrize("mode", ["prefix", "content"])
def test_bos_is_prepended_where_the_tokenizer_expects_it(smol_dir, chat_template, mode):
    from driftlab.chat.templates import Renderer
    from driftlab.protocol.decay import turn_spans

    conv = [*CONVS[0], {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Et alors ?"}]
    with_bos = Renderer(_tokenizer(smol_dir, bos=True, chat=chat_template), mode)
    without = Renderer(_tokenizer(smol_dir, bos=False, chat=chat_template), mode)
    a, b = with_bos.render(conv), without.render(conv)
    bos = with_bos.tokenizer.bos_token_id
    eos = {with_bos.tokenizer.eos_token_id}

    def turns(renderer):  # where the agent's turns are (attention decay), through this rendering
        return turn_spans(lambda c, gen: renderer.render(c, gen).ids, conv, eos)

    if chat_template:  # SmolLM2's ChatML template already starts with its BOS id (<|im_start|>): no second one
        assert b.ids[0] == bos and a == b and turns(with_bos) == turns(without)
        return
    assert a.ids == [bos] + b.ids and b.ids[0] != bos  # exactly one BOS, first
    start = 0 if mode == "prefix" else b.system_span[0] + 1
    assert a.system_span == (start, b.system_span[1] + 1)  # the same tokens, shifted past BOS
    shifted = [(s + 1, e + 1) if sp else None for sp in turns(without) for s, e in [sp or (0, 0)]]
    assert turns(with_bos) == shifted


def test_every_pulled_preset_starts_its_prompts_as_its_tokenizer_does():
    from transformers import AutoTokenizer

    from driftlab.assets import PRESETS, pulled_info, resolve_model
    from driftlab.chat.templates import Renderer

    checked = []
    for name in PRESETS:
        if pulled_info(name) is None:
            continue
        tok = AutoTokenizer.from_pretrained(resolve_model(name, auto_pull_default=False))
        expects_bos = tok.bos_token_id is not None and tok("a")["input_ids"][:1] == [tok.bos_token_id]
        renderer = Renderer(tok)
        rendered = renderer.render(CONVS[0])
        assert rendered.ids[:2] != [tok.bos_token_id] * 2, name  # never two
        if expects_bos:
            assert rendered.ids[0] == tok.bos_token_id, name
        else:
            assert rendered.ids == renderer.encode(rendered.text), name  # nothing added
        checked.append(name)
    assert "smollm2-135m" in checked  # the default model is always pulled where tests run


def test_rows_stop_at_their_own_limit_when_cancelled_and_hand_over_early(tiny):
    """What a server needs from the decode loop: per-row token limits, a row cancelled mid-way
    (the others unchanged), and a row's reply handed over as soon as that row is done. On the
    tiny model: bookkeeping, whose rows' replies differ (checked)."""
    from driftlab.chat import ChatRequest

    convs = [[{"role": "user", "content": f"Count from {i} to one hundred."}] for i in (1, 5, 9)]
    sampling = Sampling(max_new_tokens=12, temperature=0, ignore_eos=True)
    alone = [tiny.generate(ChatRequest([c], sampling.model_copy(update={"max_new_tokens": n})))[0]
             for c, n in zip(convs, [4, 12, 6], strict=True)]  # each as many tokens as it is compared on
    finished_at: list[tuple[int, int]] = []  # (row, tokens the longest row had by then)
    streamed = [0, 0, 0]

    def on_token(row: int, token: int) -> None:
        streamed[row] += 1

    replies = tiny.generate(ChatRequest(
        convs, sampling, row_max_tokens=[4, 12, 12], on_token=on_token,
        cancelled=lambda row: row == 2 and streamed[2] >= 6,
        on_finish=lambda row, reply: finished_at.append((row, streamed[1]))))
    assert [r.n_tokens for r in replies] == [4, 12, 6]
    assert [r.finish_reason for r in replies] == ["length", "length", "cancelled"]
    assert replies[0].token_ids == alone[0].token_ids[:4] and replies[1].token_ids == alone[1].token_ids
    assert replies[2].token_ids == alone[2].token_ids[:6]
    assert len({tuple(a.token_ids[:4]) for a in alone}) == 3  # the rows differ: none could stand in for another
    assert finished_at[:2] == [(0, 4), (2, 6)]  # handed over while row 1 was still decoding
    with pytest.raises(DriftlabError, match="outside"):
        ChatRequest(convs, sampling, row_max_tokens=[4, 13, 1])


CFG = ["cfg:alpha=1.5"]


@pytest.fixture
def leaving(request, steer):
    """(a backend with a prefix cache, one without) for the test below: SmolLM2 for CFG, the
    composed case (twin rows leave with their rows), the tiny Llama for the others."""
    if steer == CFG:
        return request.getfixturevalue("cached"), request.getfixturevalue("smol32")
    return request.getfixturevalue("tiny_cached"), request.getfixturevalue("tiny")


@pytest.mark.parametrize("steer", [[], ["instaboost:m=5"], CFG])
def test_done_rows_leave_the_batch_with_the_same_tokens_and_their_prefixes_kept(leaving, monkeypatch, steer):
    """Rows that finish early leave the batch (their KV dropped from the cache, their attention
    state and guidance twins with them) while the others decode on: every reply equals the
    same conversation decoded alone, the batch really shrank, and a dropped row's prompt and
    reply were stored in the prefix cache before it left (a follow-up turn reuses them)."""
    from transformers.cache_utils import DynamicCache

    from driftlab.chat import ChatRequest
    from driftlab.steering import Interventions

    cached, alone_backend = leaving

    sizes: list[int] = []
    select = DynamicCache.batch_select_indices

    def counted(self, indices):
        sizes.append(len(indices))
        return select(self, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", counted)
    iv = Interventions.parse(steer) if steer else Interventions()
    sampling = Sampling(max_new_tokens=8, temperature=0, ignore_eos=True)
    limits = [2, 8, 4, 6]  # rows end at steps 2, 4 and 6: three times a quarter of the batch is done
    batch = cached.generate(ChatRequest(CONVS, sampling, interventions=iv, row_max_tokens=limits))
    alone = [alone_backend.generate(ChatRequest([c], sampling.model_copy(update={"max_new_tokens": n}),
                                                interventions=iv))[0]
             for c, n in zip(CONVS, limits, strict=True)]  # each as many tokens as it is compared on
    assert [r.n_tokens for r in batch] == limits
    assert [r.token_ids for r in batch] == [a.token_ids[:n] for a, n in zip(alone, limits, strict=True)]
    assert len({tuple(a.token_ids[:2]) for a in alone}) == len(CONVS)  # no row could stand in for another
    twins = 2 if steer == CFG else 1
    assert sizes == [3 * twins, 2 * twins, 1 * twins]
    # The rows that left early were stored with their replies: the next turn of row 0 (dropped
    # at step 2) reuses its prompt and its fed reply token.
    follow = [CONVS[0] + [{"role": "assistant", "content": batch[0].text}, {"role": "user", "content": "More."}]]
    before = cached.prefix_cache.hits_tokens
    cached.generate(ChatRequest(follow, Sampling(max_new_tokens=1, temperature=0), interventions=iv))
    assert cached.prefix_cache.hits_tokens - before >= len(cached.render(CONVS[0]).ids)
