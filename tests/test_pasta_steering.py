"""PASTA steering: emphasis markup, span mapping through chat templates, the engine against
an eager reference, no-op and batching identities, head files.

The engine adds log(alpha) to the logits of non-emphasised keys on the chosen heads inside
fused SDPA calls; `attention_reference.py` builds the same bias with plain loops over the
raw spans and multiplies materialised fp32 weights, so agreement is not agreement of one
piece of code with itself. Every comparison also checks that steering changed something.
The engine tests run on tiny random Qwen2 and Gemma3 models (every option); SmolLM2-135M
runs the one real-model check, the marked-emphasis steer against the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attention_reference import NAME as REFERENCE
from attention_reference import both_engines_on_one_thread
from devices import backend_device, exact, tol
from driftlab.attention import ATTENTION_NAME
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.chat.templates import Renderer
from driftlab.errors import DriftlabError
from driftlab.steering import InstABoost, Interventions, Pasta
from driftlab.steering.emphasis import parse_marked, strip_emphasis
from driftlab.steering.heads import Profile, load_heads, save_heads, select
from tiny_models import make_tiny_model

FIXTURES = Path(__file__).parent / "fixtures"
LOGPROB_TOL = 5e-4  # the CPU's; tol(LOGPROB_TOL) on other devices (tests/devices.py)

MARKED = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Mary is a nurse in Ohio; she likes hiking. *Answer in JSON with keys name "
                                    "and occupation.*"},
    ],
    [
        {"role": "user", "content": "*Replace every 'she' with 'they'.* She was a teacher and she wrote poems."},
    ],
]


# -- markup -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, marker, plain, spans",
    [
        ("say *hello* now", "*", "say hello now", [(4, 9)]),
        ("*a* and *bc*", "*", "a and bc", [(0, 1), (6, 8)]),
        (r"2 \* 3 = *six*", "*", "2 * 3 = six", [(8, 11)]),
        ("no marks", "*", "no marks", []),
        ("==key== point", "==", "key point", [(0, 3)]),
        (r"un*believ*able \\x", "*", r"unbelievable \\x", [(2, 8)]),
    ],
)
def test_parse_marked(text, marker, plain, spans) -> None:
    got, where = parse_marked(text, marker)
    assert (got, where) == (plain, spans)
    assert [got[s:e] for s, e in where] == [text.split(marker)[1 + 2 * i] for i in range(len(where))] or "\\" in text


@pytest.mark.parametrize("text, match", [("an *open span", "never closed"), ("empty ** here", "Empty emphasis")])
def test_parse_marked_errors(text, match) -> None:
    with pytest.raises(DriftlabError, match=match):
        parse_marked(text)


@pytest.mark.parametrize("marker", ["", " ", "\\x"])
def test_unusable_markers_are_refused(marker) -> None:
    with pytest.raises(DriftlabError, match="marker"):
        parse_marked("x", marker)


def test_assistant_markdown_is_not_emphasis() -> None:
    conv = [{"role": "user", "content": "*Be brief.* Hi"}, {"role": "assistant", "content": "**Hello** * there"}]
    clean, spans = strip_emphasis(conv)
    assert clean[1]["content"] == "**Hello** * there" and spans == [[(0, 9)], []]


def test_dialog_protocols_refuse_marked_pasta() -> None:
    from driftlab.protocol.selfchat import SelfChatConfig

    with pytest.raises(DriftlabError, match="span=system"):
        SelfChatConfig(steer=["pasta:heads=all"])
    assert SelfChatConfig(steer=["pasta:heads=1.2,span=system"]).steer.specs()[0].startswith("pasta:")
    with pytest.raises(DriftlabError, match="bias with span=marked"):  # any key bias on marked text
        SelfChatConfig(steer=["bias:value=1,span=marked"])


def test_explicit_spans_are_taken_literally_and_checked() -> None:
    conv = [{"role": "user", "content": "keep *these* stars", "emphasis": [[0, 4]]}]
    clean, spans = strip_emphasis(conv)
    assert clean == [{"role": "user", "content": "keep *these* stars"}] and spans == [[(0, 4)]]
    for bad in ([[3, 99]], [[5, 5]], "0-4", [[1]]):
        with pytest.raises(DriftlabError, match="emphasis"):
            strip_emphasis([{"role": "user", "content": "abc", "emphasis": bad}])


# -- span mapping through every preset's template -------------------------------------------------
def _tokenizers(smol_dir) -> dict[str, object]:
    """SmolLM2 (ChatML), Qwen2.5's template, and the plain template with a BOS-first tokenizer
    (how gemma3-270m, a base model, is rendered); real tokenizers of other pulled presets too."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from driftlab.assets import PRESETS, pulled_info, resolve_model

    out = {"smollm2 chatml": AutoTokenizer.from_pretrained(smol_dir)}
    qwen = AutoTokenizer.from_pretrained(smol_dir)
    qwen.chat_template = (FIXTURES / "qwen2.5_chat_template.jinja").read_text()
    out["qwen2.5 template"] = qwen
    base = AutoTokenizer.from_pretrained(smol_dir)
    base.chat_template = None
    base._tokenizer.post_processor = TemplateProcessing(
        single=f"{base.bos_token} $A", special_tokens=[(base.bos_token, base.bos_token_id)])
    out["plain template + BOS"] = base
    for name in PRESETS:
        if name != "smollm2-135m" and pulled_info(name) is not None:
            out[name] = AutoTokenizer.from_pretrained(resolve_model(name, auto_pull_default=False))
    return out


def test_emphasis_maps_to_the_right_tokens_on_every_template(smol_dir) -> None:
    conv = [
        {"role": "system", "content": "Be *brief*."},
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hello there."},  # same text: must map to the right message
        {"role": "user", "content": "Describe it un*believ*ably well. *Answer in JSON.* Thanks"},
    ]
    clean, char_spans = strip_emphasis(conv)
    wanted = ["brief", "believ", "Answer in JSON."]
    for name, tok in _tokenizers(smol_dir).items():
        renderer = Renderer(tok)
        rendered = renderer.render(clean, emphasis=char_spans)
        enc = tok(rendered.text, add_special_tokens=False, return_offsets_mapping=True)  # the text's own tokens
        offsets, shift = enc["offset_mapping"], len(rendered.ids) - len(enc["input_ids"])
        assert len(rendered.emphasis) == 3, name
        for (s, e), word in zip(rendered.emphasis, wanted):
            lo, hi = offsets[s - shift][0], offsets[e - 1 - shift][1]
            covered = rendered.text[lo:hi]
            assert word in covered, (name, covered)  # every emphasised character is covered...
            # ...by the fewest tokens: dropping the first or last token loses some of them.
            assert word not in rendered.text[offsets[s - shift + 1][0]:hi] if e - s > 1 else True
            assert word not in rendered.text[lo:offsets[e - 2 - shift][1]] if e - s > 1 else True
        # "believ" sits inside a word: its tokens may overrun it, never miss it.
        assert rendered.ids == renderer.render(clean).ids  # emphasis never changes the tokens


def test_marked_text_reaches_the_model_without_markers(smol_dir) -> None:
    from transformers import AutoTokenizer

    renderer = Renderer(AutoTokenizer.from_pretrained(smol_dir))
    clean, spans = strip_emphasis(MARKED[0])
    rendered = renderer.render(clean, emphasis=spans)
    assert "*" not in rendered.text and "Answer in JSON" in rendered.text
    assert rendered.spans()["emphasis"] == list(rendered.emphasis) and "system" in rendered.spans()


# -- the steer spec and head files -----------------------------------------------------------------
def test_pasta_spec_round_trips_and_reads_head_files(tmp_path) -> None:
    iv = Interventions.parse(["pasta:heads=1.2+0.1,alpha=0.05,span=system"])
    assert Interventions.parse(iv.specs()) == iv
    (term,) = iv.attention().biases
    assert term.value == pytest.approx(torch.log(torch.tensor(0.05)).item())
    assert term.invert and term.span == "system" and term.scope == "prompt"
    assert sorted(term.heads) == [(0, 1), (1, 2)]
    config = save_heads([(3, 1), (0, 2), (3, 0)], tmp_path / "heads.json")
    assert json.loads(config.read_text()) == {"0": [2], "3": [0, 1]}  # pastalib's layer -> heads format
    from_file = Interventions.parse([f"pasta:heads={config}"])
    assert from_file.get("pasta").heads == ((0, 2), (3, 0), (3, 1))
    assert "heads.json" not in from_file.specs()[0]  # the manifest records the heads themselves
    assert Interventions.parse(["pasta:heads=all"]).emphasis_marker() == "*"
    assert Interventions.parse(["pasta:heads=all,span=system"]).emphasis_marker() is None
    assert Interventions.parse(["bias:value=1,span=marked"]).emphasis_marker() == "*"  # bias reads markup too
    assert Interventions.parse(["bias:value=1,span=marked", "pasta:heads=all,marker=~~"]).emphasis_marker() == "~~"


def _profile(task: str, ranked: list[tuple[int, int]], model: str = "m") -> Profile:
    return Profile(model=model, task=task, metric="acc", alpha=0.01, n=4,
                   scores=[(layer, head, 1.0 - i / 10) for i, (layer, head) in enumerate(ranked)])


def test_head_selection_intersection_union_task_specific(tmp_path) -> None:
    a = _profile("json", [(0, 0), (1, 1), (2, 2), (3, 3)])
    b = _profile("pronouns", [(1, 1), (3, 3), (0, 1), (0, 0)])
    assert select([a, b], "intersection", 3) == [(1, 1)]
    assert select([a, b], "union", 2) == [(0, 0), (1, 1), (3, 3)]
    assert select([a], "task-specific", 2) == [(0, 0), (1, 1)]
    with pytest.raises(DriftlabError, match="task-specific selection takes one profile"):
        select([a, b], "task-specific", 2)
    with pytest.raises(DriftlabError, match="different models"):
        select([a, _profile("x", [(0, 0)], model="other")], "union", 1)
    path = tmp_path / "profile.json"
    path.write_text(a.model_dump_json())
    assert Interventions.parse([f"pasta:heads={path},topk=2"]).get("pasta").heads == ((0, 0), (1, 1))
    with pytest.raises(DriftlabError, match="topk=K"):
        Interventions.parse([f"pasta:heads={path}"])


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"x": [1]}', "not a layer number"),
        ('{"3": 2}', "list of non-negative head numbers"),
        ('{"3": [-1]}', "list of non-negative head numbers"),
        ('"heads"', "not a head config"),
        ("{}", "selects no heads"),
        ('{"driftlab_profile": 1, "model": "m"}', "Head profile"),
    ],
)
def test_malformed_head_files_give_one_line_errors(tmp_path, content, match) -> None:
    path = tmp_path / "h.json"
    path.write_text(content)
    with pytest.raises(DriftlabError, match=match) as err:
        load_heads(path)
    assert "\n" not in err.value.message


@pytest.mark.parametrize(
    "spec, match",
    [
        ("pasta:alpha=0.01", "'heads' is required"),
        ("pasta:heads=all,alpha=0", "alpha"),
        ("pasta:heads=all,alpha=2", "alpha"),
        ("pasta:heads=all,span=everything", "span"),
        ("pasta:heads=all,topk=3", "topk picks heads from a profile"),
        ("pasta:heads=missing.json", "does not exist"),
        ("pasta:heads=all,marker= ", "Cannot read"),
        ("pasta:heads=all,marker=a=b", "marker cannot contain"),
    ],
)
def test_bad_pasta_specs(spec, match) -> None:
    with pytest.raises(DriftlabError, match=match):
        Interventions.parse([spec])


def test_pasta_composes_with_other_key_biases() -> None:
    iv = Interventions.parse(["pasta:heads=1.0,alpha=0.5", "instaboost:m=2", "bias:value=-1,span=marked,heads=0"])
    terms = {(t.span, t.invert): t for t in iv.attention().biases}
    assert terms[("emphasis", True)].value == pytest.approx(math.log(0.5))  # pasta
    assert terms[("system", False)].value == pytest.approx(math.log(2))  # instaboost
    assert terms[("emphasis", False)].value == -1.0 and terms[("emphasis", False)].heads == ((0, None),)  # bias


# -- the engine on tiny models, and once on the real one -------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with both_engines_on_one_thread():
        yield


_BACKENDS: dict[str, HFChatBackend] = {}


TINY = ["qwen2", "gemma3"]
# Bookkeeping (batch rows, no-ops, the unpadded path, per-row steers): the tiny models' forward costs
# a millisecond, SmolLM2's ~30 ms, and the code under test is the same.
on_tiny_models = pytest.mark.parametrize("backend", TINY, indirect=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: make_tiny_model(name, tmp_path_factory.mktemp(name), sliding_window=8) for name in TINY}


@pytest.fixture(scope="module", params=["smollm2", *TINY])
def backend(request, tiny_dirs) -> HFChatBackend:
    """SmolLM2 is the session's `smol32` (fp32, no prefix cache: these settings), loaded once per worker."""
    name = request.param
    return request.getfixturevalue("smol32") if name == "smollm2" else tiny_backend(tiny_dirs, name)


def tiny_backend(tiny_dirs: dict[str, Path], name: str) -> HFChatBackend:
    """The tiny `name` model, fp32 without a prefix cache, loaded once per module."""
    if name not in _BACKENDS:
        _BACKENDS[name] = HFChatBackend(str(tiny_dirs[name]), dtype="float32", device=backend_device(),
                                        prefix_cache_bytes=0)
    return _BACKENDS[name]


def chat(backend, convs, iv=Interventions(), n=10, impl=ATTENTION_NAME):
    sampling = Sampling(greedy=True, max_new_tokens=n, ignore_eos=True)
    backend.model.set_attn_implementation(impl)
    try:
        return backend.generate(ChatRequest(convs, sampling, interventions=iv, logprobs=3))
    finally:
        backend.model.set_attn_implementation(ATTENTION_NAME)


_PLAIN: dict[int, list] = {}
_MARKED: dict[tuple[int, int], list] = {}


def marked_steered(backend, rows: int) -> list:
    """The engine's replies to MARKED[:rows] under STEERS["marked"], once per backend: the reference
    test, the one-row fast path and the batch test compare the same runs."""
    if (id(backend), rows) not in _MARKED:
        _MARKED[id(backend), rows] = chat(backend, MARKED[:rows], Interventions.parse([STEERS["marked"]]))
    return _MARKED[id(backend), rows]


def plain_marked(backend) -> list:
    """The unsteered replies to MARKED with its markers stripped (what PASTA shows the model), once per backend."""
    if id(backend) not in _PLAIN:
        _PLAIN[id(backend)] = chat(backend, [strip_emphasis(c)[0] for c in MARKED])
    return _PLAIN[id(backend)]


def _logprob_diff(a, b) -> float:
    return max(abs(x.logprob - y.logprob) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs))


STEERS = {
    "marked": "pasta:heads=0+1.1+2.3,alpha=0.01",
    "marked_all_scope": "pasta:heads=0+1.1+2.3,alpha=0.01,scope=all",
    "system": "pasta:heads=0-1+2.0,alpha=0.01,span=system",
}


@pytest.mark.model
@pytest.mark.parametrize("backend,steer", [("smollm2", "marked"), *((m, s) for m in TINY for s in STEERS)],
                         indirect=["backend"])
def test_steering_matches_the_eager_reference(backend, steer) -> None:
    iv = Interventions.parse([STEERS[steer]])
    got = marked_steered(backend, len(MARKED)) if steer == "marked" else chat(backend, MARKED, iv)
    want = chat(backend, MARKED, iv, impl=REFERENCE)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert _logprob_diff(got, want) <= tol(LOGPROB_TOL)
    assert _logprob_diff(got, plain_marked(backend)) > 100 * LOGPROB_TOL  # steering changed the distribution


@pytest.mark.model
@on_tiny_models
def test_unpadded_prefill_fast_path_matches_the_reference(backend) -> None:
    """One row (no padding): the bias goes to the fused kernel with the causal flag, unchunked."""
    iv = Interventions.parse([STEERS["marked"]])
    got = marked_steered(backend, 1)
    want = chat(backend, MARKED[:1], iv, impl=REFERENCE)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert _logprob_diff(got, want) <= tol(LOGPROB_TOL)
    assert _logprob_diff(got, plain_marked(backend)[:1]) > 100 * LOGPROB_TOL  # the steer acted on this row


@pytest.mark.model
@on_tiny_models
def test_alpha_one_and_rows_without_emphasis_are_bit_identical_to_plain(backend) -> None:
    plain = plain_marked(backend)
    one = chat(backend, MARKED, Interventions.parse(["pasta:heads=all,alpha=1"]))
    assert [r.token_ids for r in one] == [r.token_ids for r in plain]
    _assert_same_logprobs(one, plain)
    # Markers stripped but no span anywhere: the rows are left alone (only the text lost its markers).
    unmarked = [[{"role": "user", "content": "Tell me about the sea."}]]
    steered = chat(backend, unmarked, Interventions.parse(["pasta:heads=all,alpha=0.01"]))
    _assert_same_logprobs(steered, chat(backend, unmarked))


def _assert_same_logprobs(a, b) -> None:
    """Bit-identical log-probs on the CPU; within tol(LOGPROB_TOL) on devices without that guarantee."""
    if exact():
        assert [[t.logprob for t in r.logprobs] for r in a] == [[t.logprob for t in r.logprobs] for r in b]
    else:
        assert _logprob_diff(a, b) <= tol(LOGPROB_TOL)


@pytest.mark.model
@on_tiny_models
def test_batched_rows_with_different_spans_equal_one_at_a_time(backend) -> None:
    iv = Interventions.parse([STEERS["marked"]])
    batched = marked_steered(backend, len(MARKED))
    for i, (conv, row) in enumerate(zip(MARKED, batched)):
        (solo,) = marked_steered(backend, 1) if i == 0 else chat(backend, [conv], iv)
        assert solo.token_ids == row.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(solo.logprobs, row.logprobs)) <= tol(LOGPROB_TOL)


@pytest.mark.model
@on_tiny_models
def test_per_row_interventions_equal_each_row_alone(backend) -> None:
    """Head profiling steers a different head in each row of one batch (TokenBackend.generate_tokens
    with one Interventions per row); the last row composes PASTA with InstABoost."""
    rendered = [backend.render(MARKED[0], interventions=Interventions.parse(["pasta:heads=all"]))] * 4
    per_row = [Interventions.of(Pasta(heads=h, alpha=0.01)) for h in (((0, 0),), ((1, 1),), ((2, 3),))]
    per_row.append(Interventions.of(Pasta(heads=((1, 1),), alpha=0.01), InstABoost(m=3)))
    sampling = Sampling(greedy=True, max_new_tokens=8, ignore_eos=True)
    rows = backend.generate_tokens(rendered, sampling, interventions=per_row, logprobs=0)
    for one, row in zip(per_row, rows):
        (solo,) = chat(backend, [MARKED[0]], one, n=8)
        assert solo.token_ids == row.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(solo.logprobs, row.logprobs)) <= tol(LOGPROB_TOL)
    # The rows really were steered differently (one head rarely changes the greedy text).
    assert max(abs(a.logprob - b.logprob) for a, b in zip(rows[0].logprobs, rows[1].logprobs)) > 1e-3


@pytest.mark.model
def test_prefix_cache_reuse_under_prompt_scope_is_exact(tmp_path) -> None:
    """Turn 2 re-reads turn 1's reply as prompt: a cached KV of the reply computed while it was
    generated (unscaled keys) would be wrong, so only prompt KV is reused. On a tiny Llama (full
    attention only, so its prefixes are reusable; the cache's bookkeeping is model-independent)
    whose reply re-tokenises to its own tokens: otherwise no cached reply KV could be hit, right or wrong."""
    path = str(make_tiny_model("llama", tmp_path / "llama"))
    cached = HFChatBackend(path, dtype="float32", device=backend_device())
    fresh = HFChatBackend(path, dtype="float32", device=backend_device(), prefix_cache_bytes=0)
    iv = Interventions.parse(["pasta:heads=0-2,alpha=0.01,span=system"])  # every layer
    conv = [{"role": "system", "content": "Always answer in French."}, {"role": "user", "content": "Hi!"}]
    first = chat(cached, [conv], iv, n=6)[0]
    conv2 = [*conv, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the sea?"}]
    start = len(cached.render(conv).ids)
    assert cached.render(conv2).ids[start : start + len(first.token_ids)] == first.token_ids
    reused = chat(cached, [conv2], iv, n=6)[0]
    assert cached.prefix_cache.hits_tokens > 0
    direct = chat(fresh, [conv2], iv, n=6)[0]
    assert reused.token_ids == direct.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(reused.logprobs, direct.logprobs)) <= tol(LOGPROB_TOL)
