"""A model the user already holds: `HFChatBackend.from_model` and `steer()` on one's own generate.

What must hold (issue 32, item 1):
* `from_model` on the same weights generates what the backend that loaded them by name
  generates, token for token, with and without an intervention, and gives the model back with
  its own attention implementation;
* `steer()` around transformers' `model.generate` / `model(...)` gives driftlab's own chat's
  tokens, log-probabilities and pi traces (one prompt and a left-padded batch of two), and
  leaving the block (also by an exception) restores the plain model exactly;
* PEFT models work through their adapters;
* what driftlab cannot steer is refused in one line, and the model is left as it was.

The real SmolLM2 runs in float32 (exact comparisons), on one torch thread (tiny batches; on a
shared 2-core machine a second thread mostly waits in OpenMP barriers), for `from_model` against
the model loaded by name and for `steer()` with split-softmax (one prompt, a batch whose system
prompt is missing from a row, a token range). The other checks of `steer()` (InstABoost, a batch
of two with traces, restoring the model, `model(...)`'s log-probs and traces) run on a tiny random
Llama saved with SmolLM2's tokenizer (tests/tiny_models.py), each asserting that the steer
changes the tiny model's reply or scores; tiny models from configs also cover the refusals and PEFT.
"""

from __future__ import annotations

import pytest
import torch

from devices import backend_device
from driftlab.chat.base import ChatRequest, Sampling
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions, SplitSoftmax

N = 10  # new tokens per reply
SYSTEM = "You are a pirate. Always answer in French."
CONV = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of Italy?"}]
CONV2 = [{"role": "system", "content": "Reply only with a number."},
         {"role": "user", "content": "How many legs has a spider? Explain."}]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf(smol_dir, device):
    """SmolLM2 as a user loads it: transformers' own loader, float32, its own attention (sdpa),
    on the test device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tokenizer.padding_side = "left"
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """driftlab's own backend on the tiny Llama (as smol32 on SmolLM2)."""
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    """The tiny Llama as a user loads it (as `hf`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).to(backend_device()).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.padding_side = "left"
    return model, tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def chat_tokens(backend, convs, spec=None, **request) -> list:
    """Greedy replies of driftlab's own chat (replies without their final EOS)."""
    iv = Interventions.parse([spec] if spec else [])
    return backend.generate(ChatRequest(convs, Sampling(greedy=True, max_new_tokens=N), interventions=iv, **request))


def generated(model, tokenizer, convs, stop) -> list[list[int]]:
    """transformers' greedy generate on the chat-templated prompts, cut at the first stop token."""
    enc = tokenizer.apply_chat_template(convs if len(convs) > 1 else convs[0], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True, padding=len(convs) > 1).to(model.device)
    with torch.inference_mode():
        out = model.generate(**enc, do_sample=False, max_new_tokens=N)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), len(row))
        rows.append(row[:cut])
    return rows


def attn(model) -> str:
    return model.config._attn_implementation


# -- from_model ---------------------------------------------------------------------------------
def test_from_model_matches_the_model_loaded_by_name(smol32, hf) -> None:
    from driftlab.chat.hf import HFChatBackend

    model, tokenizer = hf
    assert attn(model) == "sdpa"
    wants = {}
    for spec in (None, "split-softmax:k=0.8"):
        want = wants[spec] = chat_tokens(smol32, [CONV], spec)[0].token_ids
        with HFChatBackend.from_model(model, tokenizer, prefix_cache_bytes=0, name="my-smol") as backend:
            assert attn(model) == "driftlab"
            got = chat_tokens(backend, [CONV], spec)[0].token_ids
            facts = backend.describe()
        assert got == want, spec
        assert attn(model) == "sdpa"  # given back with its own attention
    assert wants[None] != wants["split-softmax:k=0.8"]  # the intervention changed the reply
    assert facts["source"] == "memory" and facts["name"] == "my-smol" and facts["peft"] is None
    assert facts["architecture"] == "LlamaForCausalLM" and facts["dtype"] == "float32"
    with pytest.raises(DriftlabError, match="closed"):
        chat_tokens(backend, [CONV])


def test_from_model_holds_the_model_until_closed(hf) -> None:
    from driftlab.chat.hf import HFChatBackend
    from driftlab.chat.steer import steer

    model, tokenizer = hf
    backend = HFChatBackend.from_model(model, tokenizer)
    try:
        with pytest.raises(DriftlabError, match="already held by an open HFChatBackend"):
            HFChatBackend.from_model(model, tokenizer)
        with pytest.raises(DriftlabError, match="already held"):
            with steer(model, "split-softmax:k=0.8", system=SYSTEM, tokenizer=tokenizer):
                pass
        assert "forward" not in model.__dict__
    finally:
        backend.close()
    backend.close()  # idempotent
    assert attn(model) == "sdpa"
    HFChatBackend.from_model(model, tokenizer).close()  # free again


# -- steer() on the user's own generate ---------------------------------------------------------
@pytest.fixture
def steered_pair(request, spec):
    """(driftlab's backend, the user's (model, tokenizer)) of one model: SmolLM2 for split-softmax,
    whose case also checks the batch refusal and the token range, the tiny Llama for the others."""
    if spec.startswith("split"):
        return request.getfixturevalue("smol32"), request.getfixturevalue("hf")
    return request.getfixturevalue("tiny"), request.getfixturevalue("tiny_hf")


@pytest.mark.model  # (SmolLM2 through getfixturevalue, which conftest's marking by fixture cannot see; the tiny case ~1 s)
@pytest.mark.parametrize("spec", ["split-softmax:k=0.8", "instaboost:m=10"])
def test_steer_matches_driftlab_chat(steered_pair, spec) -> None:
    from driftlab.chat.steer import steer

    backend, (model, tokenizer) = steered_pair
    stop = backend.eos_ids
    assert tokenizer.apply_chat_template(CONV, add_generation_prompt=True)["input_ids"] == backend.render(CONV).ids
    want = [r.token_ids for r in chat_tokens(backend, [CONV], spec)]
    with steer(model, spec, system=SYSTEM, tokenizer=tokenizer):
        got = generated(model, tokenizer, [CONV], stop)
    assert got == want
    assert want != generated(model, tokenizer, [CONV], stop)  # the block changed the model's reply
    if spec.startswith("split"):
        pair = [CONV, CONV2]  # CONV2 has another system prompt: not found in its row
        with steer(model, SplitSoftmax(k=0.8), system=SYSTEM, tokenizer=tokenizer) as block:
            with pytest.raises(DriftlabError, match=r"not found in the tokens of row 1") as err:
                generated(model, tokenizer, pair, stop)
        assert "system=(start, end)" in err.value.hint and block.n_runs == 0
        start, end = backend.render(CONV).system_span  # the system prompt as a token range
        with steer(model, Interventions.parse([spec]), system=(start, end)):
            assert generated(model, tokenizer, [CONV], stop) == want


@pytest.mark.model  # a tiny model, but loaded twice: out of the fast part
def test_steer_batch_of_two(tiny, tiny_hf, tol) -> None:
    """Two left-padded prompts of different lengths, each with its system prompt located: the
    same tokens and the same pi per row (pi shows any slip of a span or of the padding)."""
    from driftlab.chat.steer import steer

    model, tokenizer = tiny_hf
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a big river in Europe, please."}]
    pair = [CONV, other]
    lengths = [len(tiny.render(c).ids) for c in pair]
    assert lengths[0] != lengths[1]
    specs = ["split-softmax:k=0.8", "trace"]
    replies = tiny.generate(ChatRequest(pair, Sampling(greedy=True, max_new_tokens=N),
                                        interventions=Interventions.parse(specs)))
    with steer(model, specs, system=SYSTEM, tokenizer=tokenizer) as block:
        got = generated(model, tokenizer, pair, tiny.eos_ids)
    assert got == [r.token_ids for r in replies]
    assert block.n_runs == 1
    for row, reply in zip(block.traces(), replies, strict=True):
        want = torch.tensor(_decode_trace(reply))  # a copy: the record's array is read-only
        assert torch.allclose(row["decode"][: len(want)], want, atol=tol(1e-5))
    assert got != generated(model, tokenizer, pair, tiny.eos_ids)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_steer_matches_driftlab_chat_on_other_families(smol_tokenizer, family) -> None:
    """Key biases (PASTA on the system prompt, prompt-scoped; an inverted bias on every key) on
    tiny random models, a left-padded batch of two; gemma3's sliding-window layers keep 8 keys
    of prompts ~30 tokens long, so a decode step's keys are not the absolute slots."""
    from transformers import AutoModelForCausalLM

    from driftlab.chat.hf import HFChatBackend
    from driftlab.chat.steer import steer
    from tiny_models import tiny_config

    config = tiny_config(family)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = smol_tokenizer
    tokenizer.padding_side = "left"
    pair = [CONV, [CONV[0], {"role": "user", "content": "Hi"}]]
    for spec in ("pasta:heads=0.1+1.2,span=system,alpha=0.05", "bias:value=3,invert=true"):
        with HFChatBackend.from_model(model, tokenizer, prefix_cache_bytes=0) as backend:
            want = [r.token_ids for r in chat_tokens(backend, pair, spec)]
            plain = [r.token_ids for r in chat_tokens(backend, pair)]
            stop = backend.eos_ids
        with steer(model, spec, system=SYSTEM, tokenizer=tokenizer):
            assert generated(model, tokenizer, pair, stop) == want, spec
        assert want != plain, spec


def _decode_trace(reply):
    return reply.trace.decode if hasattr(reply.trace, "decode") else reply.trace["decode"]


@pytest.mark.model  # a tiny model, but loaded twice: out of the fast part
def test_steer_restores_the_plain_model(tiny, tiny_hf) -> None:
    from driftlab.chat.steer import steer

    model, tokenizer = tiny_hf
    stop = tiny.eos_ids
    before = generated(model, tokenizer, [CONV], stop)
    with steer(model, "split-softmax:k=0.3", system=SYSTEM, tokenizer=tokenizer):
        assert attn(model) == "driftlab" and "forward" in model.__dict__
        inside = generated(model, tokenizer, [CONV], stop)
    assert attn(model) == "sdpa" and "forward" not in model.__dict__
    after = generated(model, tokenizer, [CONV], stop)
    assert inside != before
    assert after == before
    with pytest.raises(ZeroDivisionError):  # an exception inside the block still gives the model back
        with steer(model, "split-softmax:k=0.3", system=SYSTEM, tokenizer=tokenizer):
            _ = 1 / 0
    assert attn(model) == "sdpa" and "forward" not in model.__dict__
    assert generated(model, tokenizer, [CONV], stop) == before


@pytest.mark.model  # a tiny model, but loaded twice: out of the fast part
def test_steer_forward_logprobs_and_traces_match_driftlab_chat(tiny, tiny_hf, tol) -> None:
    """`model(...)` inside the block scores as driftlab's chat does; `trace` gives its pi."""
    from driftlab.chat.steer import steer

    model, tokenizer = tiny_hf
    spec = "split-softmax:k=0.5"
    (reply,) = chat_tokens(tiny, [CONV], spec, logprobs=5)
    enc = tokenizer.apply_chat_template(CONV, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True).to(model.device)
    with torch.inference_mode():
        plain = torch.log_softmax(model(**enc).logits[0, -1].float(), -1).cpu()
        with steer(model, spec, system=SYSTEM, tokenizer=tokenizer):
            steered = torch.log_softmax(model(**enc).logits[0, -1].float(), -1).cpu()
    first = reply.logprobs[0]
    ids = [t for t, _ in first.top]
    assert torch.allclose(steered[ids], torch.tensor([lp for _, lp in first.top]), atol=tol(1e-4))
    assert not torch.allclose(plain[ids], steered[ids], atol=1e-2)

    (traced,) = chat_tokens(tiny, [CONV], "trace")
    with steer(model, "trace", system=SYSTEM, tokenizer=tokenizer) as block:
        generated(model, tokenizer, [CONV], tiny.eos_ids)
    (row,) = block.traces()
    want = _decode_trace(traced)
    n = len(want)
    assert row["decode"].shape[1:] == (tiny.shape.layers, tiny.shape.heads) and len(row["decode"]) >= n
    assert torch.allclose(torch.as_tensor(row["decode"][:n]), torch.as_tensor(want), atol=tol(1e-5))
    assert 0.0 < float(row["decode"].mean()) < 1.0


def test_steer_refuses_what_needs_driftlabs_own_loop() -> None:
    from driftlab.chat.steer import steer

    model = _tiny_llama()
    for spec, what in (("spr:p=0.5", "spr"), ("cfg:alpha=1.5", "cfg")):
        with pytest.raises(DriftlabError, match=f"cannot apply {what}") as err:
            steer(model, [spec, "split-softmax:k=0.8"], system=(0, 2))
        assert "from_model" in err.value.hint and "\n" not in err.value.message
    with pytest.raises(DriftlabError, match="span=marked"):
        steer(model, "pasta:heads=0.1", system=(0, 2))
    with pytest.raises(DriftlabError, match="needs tokenizer="):
        steer(model, "split-softmax:k=0.8", system="You are a pirate.")
    assert attn(model) == "sdpa"  # nothing was installed


def test_steer_is_refused_nested_and_checks_the_layout() -> None:
    from driftlab.chat.steer import steer

    model = _tiny_llama()
    ids = torch.randint(3, 100, (2, 6))
    with steer(model, "split-softmax:k=0.5", system=(0, 2)) as block:
        with pytest.raises(DriftlabError, match="already held by a steer"):
            with steer(model, "split-softmax:k=0.5", system=(0, 2)):
                pass
        right = torch.ones_like(ids)
        right[1, -2:] = 0
        with torch.inference_mode(), pytest.raises(DriftlabError, match="padding on the left"):
            model(input_ids=ids, attention_mask=right)
        with pytest.raises(DriftlabError, match="already entered"):
            block.__enter__()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)  # a cache built outside the block
    with steer(model, "split-softmax:k=0.5", system=(0, 2)), torch.inference_mode():
        with pytest.raises(DriftlabError, match="did not build"):
            model(input_ids=ids[:, :1], past_key_values=out.past_key_values)
    assert attn(model) == "sdpa" and "forward" not in model.__dict__


def test_steered_gpt2_matches_the_reference() -> None:
    """GPT-2 in transformers 5 runs its attention through the AttentionInterface with layer
    indices: it is accepted, and the engine's split-softmax on it is the reference's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from attention_reference import NAME, both_engines_on_one_thread
    from driftlab.chat.steer import steer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=128, initializer_range=0.2,
                                       scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0)).eval()
    ids = torch.randint(1, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with both_engines_on_one_thread(), torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with steer(model, "split-softmax:k=0.5", system=(0, 3)):
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with steer(model, "split-softmax:k=0.5", system=(0, 3)):
            model.set_attn_implementation(NAME)  # the reference, reading the same state
            want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-4)
    assert not torch.allclose(got[real], plain[real], atol=1e-2)


# -- refusals ------------------------------------------------------------------------------------
def _tiny_llama(**changes):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **changes)
    return LlamaForCausalLM(config).eval()


def _refused(model, tokenizer=None) -> str:
    from driftlab.chat.hf import HFChatBackend

    before = attn(model)
    with pytest.raises(DriftlabError) as err:
        HFChatBackend.from_model(model, tokenizer)
    assert "\n" not in err.value.message
    assert attn(model) == before and "forward" not in model.__dict__  # left as it was
    with pytest.raises(DriftlabError) as again:  # and not held: the same refusal, not "already held"
        HFChatBackend.from_model(model, tokenizer)
    assert again.value.message == err.value.message
    return err.value.message


def test_refuses_a_missing_tokenizer() -> None:
    assert "needs the tokenizer" in _refused(_tiny_llama())  # after attaching: given back all the same


def test_refuses_attention_outside_the_interface() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_head=2, n_layer=2)).eval()
    message = _refused(model)
    assert "BloomForCausalLM" in message and "AttentionInterface" in message


def test_refuses_models_that_are_not_decoders() -> None:
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2)).eval()
    assert "not a decoder-only" in _refused(model)


def test_refuses_attention_without_layer_index() -> None:
    model = _tiny_llama()
    for layer in model.model.layers:
        del layer.self_attn.layer_idx
    message = _refused(model)
    assert "LlamaAttention has no layer_idx" in message


def test_refuses_softcapped_attention() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    assert "softcap" in _refused(model)


def test_refuses_layers_that_never_reach_the_engine() -> None:
    """A layer whose attention bypasses the interface (here: forced to eager in one layer)."""
    model = _tiny_llama()
    attention = model.model.layers[1].self_attn
    own = attention.forward

    def eager_only(*args, **kwargs):
        kwargs.pop("driftlab", None)
        config = attention.config
        saved = config._attn_implementation_internal
        config._attn_implementation_internal = "eager"
        try:
            return own(*args, **kwargs)
        finally:
            config._attn_implementation_internal = saved

    attention.forward = eager_only
    assert "layer(s) 1 of 2 never reached" in _refused(model)


# -- PEFT ----------------------------------------------------------------------------------------
def test_peft_models_run_through_their_adapters(smol_tokenizer) -> None:
    """A LoRA-wrapped tiny Qwen2: from_model decodes through the adapter (as peft's own generate
    does, and not as the base model), and steer() acts on it as the backend's chat does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from driftlab.chat.hf import HFChatBackend
    from driftlab.chat.steer import steer
    from tiny_models import tiny_config

    config = tiny_config("qwen2")
    config.initializer_range = 0.1
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = smol_tokenizer
    spec = "split-softmax:k=0.3"
    with HFChatBackend.from_model(base, tokenizer, prefix_cache_bytes=0) as backend:
        stop = backend.eos_ids
        base_plain = chat_tokens(backend, [CONV])[0].token_ids
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    with HFChatBackend.from_model(model, tokenizer, prefix_cache_bytes=0) as backend:
        assert backend.describe()["peft"] == {"adapters": ["default"], "active": ["default"],
                                              "types": {"default": "LORA"}, "enabled": True}
        assert backend.describe()["wrapper"].startswith("PeftModel")
        plain = chat_tokens(backend, [CONV])[0].token_ids
        steered = chat_tokens(backend, [CONV], spec)[0].token_ids
    assert attn(base) == "sdpa"
    assert plain != base_plain  # the adapter acts
    assert generated(model, tokenizer, [CONV], stop) == [plain]  # as peft's own generate
    with steer(model, spec, system=SYSTEM, tokenizer=tokenizer):
        assert generated(model, tokenizer, [CONV], stop) == [steered]
    assert steered != plain
    assert generated(model, tokenizer, [CONV], stop) == [plain] and "forward" not in base.__dict__
