"""The residual stream: vector and cap steers against independent references, projections
recorded during generation against teacher-forced ones, the compiled step's graph budget, and
one-line errors for directions that do not fit.

The directions here are synthetic (random unit vectors with made-up statistics): what is checked
is the arithmetic and the plumbing, which hold for any direction. Directions computed from a
model are tested in test_directions.py. SmolLM2 runs the references (transformers' generate with a
forward hook, teacher-forced projections); the plumbing (caps, monitoring, rows leaving a batch,
`dl.steer`, serve, pi-floor, errors) runs on a tiny random Llama (tests/tiny_models.py), whose
steered tokens are checked to differ from plain ones wherever an equality is asserted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from devices import backend_device
from driftlab.activation import hooks
from driftlab.activation.directions import Directions, PersonaDirection
from driftlab.activation.state import ResidualRow, ResidualState
from driftlab.chat import ChatRequest
from driftlab.chat.base import Rendered, Sampling
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions

FRENCH = "Always reply in French."
PIRATE = "You are a pirate. Always talk like a pirate."
GREEDY = Sampling(greedy=True, max_new_tokens=12)


def _ours(layer) -> list:
    """driftlab's hooks on a layer (transformers' own output-capturing hooks are there too)."""
    return [h for h in layer._forward_hooks.values() if isinstance(h, hooks._Hook)]


def synthetic(n_layers: int, d_model: int, systems: list[str], seed: int = 0, model: str = "test") -> Directions:
    """Random unit directions for `systems`, with with/without projection samples around 1 and 0
    (so the normalisation and the cap's quantiles mean something) and a band in the middle."""
    gen = torch.Generator().manual_seed(seed)
    found = []
    for i, system in enumerate(systems):
        unit = torch.nn.functional.normalize(torch.randn(n_layers, d_model, generator=gen), dim=-1)
        found.append(PersonaDirection(
            id=f"p{i}", system_prompt=system, unit=unit, norm=torch.full((n_layers,), 4.0),
            with_proj=2.0 + torch.randn(16, n_layers, generator=gen), without_proj=torch.randn(16, n_layers, generator=gen),
            auroc=torch.ones(3, n_layers), band=tuple(range(n_layers // 3, n_layers // 3 + 2))))
    return Directions({"model": model, "n_layers": n_layers, "d_model": d_model}, found)


@pytest.fixture
def smol_dirs(smol32):
    """smol32 with synthetic directions for FRENCH and PIRATE (taken off again after the test)."""
    directions = synthetic(smol32.shape.layers, smol32.d_model, [FRENCH, PIRATE])
    smol32.use_directions(directions)
    yield smol32, directions
    smol32.use_directions(None)


@pytest.fixture(scope="module")
def tiny_backend(tiny_llama):
    from driftlab.chat.hf import HFChatBackend

    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.fixture
def tiny_dirs(tiny_backend):
    """The tiny Llama (3 layers, d_model 64) with synthetic directions for FRENCH and PIRATE (taken off
    again after the test)."""
    directions = synthetic(tiny_backend.shape.layers, tiny_backend.d_model, [FRENCH, PIRATE])
    tiny_backend.use_directions(directions)
    yield tiny_backend, directions
    tiny_backend.use_directions(None)


def _conv(system: str, user: str = "What do you do in London as a tourist?") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- the arithmetic, against references written here ------------------------------------------------------
def test_vector_steering_equals_a_plain_forward_hook_on_the_real_model(smol_dirs) -> None:
    """`vector:alpha=A,layers=...` adds A * norm * v at every position of those layers: the same greedy
    tokens and logits as transformers' own generate with a forward hook that adds exactly that."""
    backend, directions = smol_dirs
    layers, alpha = (3, 11), 4.0
    spec = f"vector:alpha={alpha},layers={layers[0]}+{layers[1]}"
    (steered,) = backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, interventions=Interventions.parse([spec]),
                                              logprobs=1))
    (plain,) = backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, logprobs=1))
    # The steer acts (so the comparison below can fail).
    assert max(abs(a.logprob - b.logprob) for a, b in zip(steered.logprobs, plain.logprobs, strict=False)) > 0.05

    p = directions.personas["p0"]
    model, handles = backend.model, []
    for layer in layers:
        delta = (alpha * p.norm[layer] * p.unit[layer]).to(model.dtype)
        handles.append(model.model.layers[layer].register_forward_hook(lambda m, a, out, d=delta: out + d))
    try:
        ids = torch.tensor([backend.render(_conv(FRENCH)).ids])
        ref = model.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=backend.pad_id)
    finally:
        for h in handles:
            h.remove()
    tokens = ref.sequences[0, ids.shape[1]:].tolist()
    n = len(steered.token_ids)
    assert tokens[:n] == steered.token_ids
    ref_lp = [float(torch.log_softmax(ref.logits[i][0].float(), -1)[t]) for i, t in enumerate(tokens[:n])]
    np.testing.assert_allclose([t.logprob for t in steered.logprobs], ref_lp, atol=2e-4)


def test_capping_lifts_the_projection_to_tau_and_leaves_the_orthogonal_part_unchanged() -> None:
    L, d, B, q = 4, 32, 3, 5
    gen = torch.Generator().manual_seed(1)
    unit = torch.nn.functional.normalize(torch.randn(L, d, generator=gen), dim=-1)
    tau = torch.tensor([float("-inf"), 0.5, 3.0, float("-inf")])
    row = ResidualRow(unit=unit, add=torch.zeros(L), tau=tau, low=torch.zeros(L), high=torch.ones(L))
    state = ResidualState([row, None, row], L, d, torch.device("cpu"), torch.float32)
    state.forward_kwargs()
    for layer in range(L):
        h = 2 * torch.randn(B, q, d, generator=gen)
        out = state.apply(layer, h)
        v = unit[layer]
        before, after = h @ v, out @ v
        torch.testing.assert_close(out - after[..., None] * v, h - before[..., None] * v, atol=1e-5, rtol=0)
        assert torch.equal(out[1], h[1])  # a row without a direction is untouched
        for b in (0, 2):
            if torch.isfinite(tau[layer]):
                assert (after[b] >= tau[layer] - 1e-5).all()
                above = before[b] >= tau[layer]
                assert torch.equal(out[b][above], h[b][above])  # nothing changes where it was already above
                assert not above.all()  # (the check can fail: some positions were lifted)
            else:
                assert torch.equal(out[b], h[b])


def test_a_cap_from_the_quantiles_of_the_with_prompt_projections(tiny_dirs) -> None:
    """cap:q=Q clamps at the Q-quantile of the direction's with-prompt projections, on the band by
    default; the recorded projection of a capped layer is then at least that (and without the cap it
    is below, on the tiny model: the cap acts)."""
    backend, directions = tiny_dirs
    p = directions.personas["p0"]
    (reply,) = backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, interventions=Interventions.parse(["cap:q=0.9"])))
    (plain,) = backend.generate(ChatRequest([_conv(FRENCH)], GREEDY))
    tau = p.quantile(0.9)
    normalised = (tau - p.low) / (p.high - p.low)
    assert all(plain.activation["reply"][layer] < float(normalised[layer]) for layer in p.band)
    for layer in p.band:
        assert reply.activation["reply"][layer] >= float(normalised[layer]) - 1e-4
        assert reply.activation["prompt"][layer] >= float(normalised[layer]) - 1e-4
    assert reply.activation["band"] == list(p.band) and reply.activation["direction"] == "p0"


# -- what is recorded ----------------------------------------------------------------------------------------
def test_monitoring_changes_no_token_and_records_only_rows_with_a_direction(tiny_dirs) -> None:
    backend, _ = tiny_dirs
    convs = [_conv(FRENCH), _conv("Answer briefly."), _conv(PIRATE, "Hi there.")]
    watched = backend.generate(ChatRequest(convs, GREEDY))
    backend.use_directions(None)
    plain = backend.generate(ChatRequest(convs, GREEDY))
    assert [r.token_ids for r in watched] == [r.token_ids for r in plain]
    assert [r.activation is None for r in watched] == [False, True, False]
    assert all(r.activation is None for r in plain)


def test_recorded_projections_equal_the_teacher_forced_ones(smol_dirs) -> None:
    """The projection a reply records while it is generated (its positions: the last prompt token,
    then each reply token but the last) equals a teacher-forced pass over the prompt and the reply."""
    backend, _ = smol_dirs
    convs = [_conv(FRENCH), _conv(PIRATE, "What is 2+2?")]
    replies = backend.generate(ChatRequest(convs, Sampling(greedy=True, max_new_tokens=16)))  # the pirate stops at 9
    assert {r.finish_reason for r in replies} == {"stop", "length"}  # both ends are covered
    for conv, reply in zip(convs, replies, strict=True):
        prompt = backend.render(conv)
        ended = reply.finish_reason == "stop"
        ids = prompt.ids + reply.token_ids + ([min(backend.stop_ids)] if ended else [])
        (first, proj), = backend.project_prompts([Rendered(ids, "", prompt.system_span)], [conv[0]["content"]])
        assert first == 0
        at = len(prompt.ids) - 1
        positions = proj[at : at + reply.n_tokens + int(ended)]
        np.testing.assert_allclose(reply.activation["reply"], positions.mean(0), atol=1e-4)
        np.testing.assert_allclose(reply.activation["prompt"], proj[at], atol=1e-4)
        np.testing.assert_allclose(reply.activation["last"], positions[-1], atol=1e-4)


def test_rows_leaving_the_batch_keep_what_they_recorded(tiny_dirs, monkeypatch) -> None:
    """A dynamic batch drops finished rows (here at their own token limits, on the tiny model); each
    row's projection is the one it gets alone."""
    from transformers.cache_utils import DynamicCache

    backend, _ = tiny_dirs
    sizes: list[int] = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, indices: sizes.append(len(indices)) or select(self, indices))
    convs = [_conv(FRENCH, "Say yes."), _conv(PIRATE, "Tell me a long story about your ship."), _conv(FRENCH)]
    sampling = Sampling(greedy=True, max_new_tokens=12, ignore_eos=True)
    limits = [3, 12, 7]
    together = backend.generate(ChatRequest(convs, sampling, row_max_tokens=limits))
    assert sizes == [2, 1]  # rows left early
    projections = set()
    for conv, reply, n in zip(convs, together, limits, strict=True):
        (alone,) = backend.generate(ChatRequest([conv], sampling.model_copy(update={"max_new_tokens": n})))
        assert alone.token_ids == reply.token_ids
        np.testing.assert_allclose(reply.activation["reply"], alone.activation["reply"], atol=1e-4)
        projections.add(round(reply.activation["reply"][1], 3))
    assert len(projections) == len(convs)  # each row records its own


# -- the compiled step ----------------------------------------------------------------------------------------
@pytest.mark.compile  # on the CPU out of the fast part (tests/conftest.py)
def test_residual_steers_run_on_one_compiled_graph_per_bucket(tiny_llama, monkeypatch) -> None:
    """Vector and cap knobs are tensors: after `warm`, new strengths, layers, caps and their
    composition with attention steers compile nothing, and give the dynamic loop's tokens."""
    import driftlab.chat.static_decode as sd
    from driftlab.chat.hf import HFChatBackend

    monkeypatch.setitem(sd.COMPILE_OPTIONS, "cpu", {**sd.COMPILE_OPTIONS["cpu"], "backend": "aot_eager"})
    path = tiny_llama
    compiled = HFChatBackend(str(path), dtype="float32", prefix_cache_bytes=0, decode="compiled")
    dynamic = HFChatBackend(str(path), dtype="float32", prefix_cache_bytes=0, decode="dynamic")
    directions = synthetic(compiled.shape.layers, compiled.d_model, [FRENCH, PIRATE])
    for backend in (compiled, dynamic):
        backend.use_directions(directions)
    convs = [_conv(FRENCH), _conv(PIRATE, "Hi!")]
    greedy = Sampling(greedy=True, max_new_tokens=5, ignore_eos=True)

    def run(backend, specs):
        return backend.generate(ChatRequest(convs, greedy, interventions=Interventions.parse(specs)))

    compiled.warm(batches=(2,))  # with directions: the graphs that carry the residual state
    # A call asking for hidden states (pastalib's generate, an eager trace) makes transformers hook the
    # layers; those hooks were put on with driftlab's, so the graphs' guards still hold.
    with torch.inference_mode():
        compiled.model(torch.tensor([[1, 2, 3]]), output_hidden_states=True, output_attentions=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        for specs in (["vector:alpha=-2,layers=0+2"], ["cap:q=0.3"], ["cap:q=0.8,layers=1", "vector:alpha=0.5"],
                      [], ["cap:q=0.5", "instaboost:m=3"], ["vector:alpha=2", "split-softmax:k=0.3", "trace"]):
            got, ref = run(compiled, specs), run(dynamic, specs)
            assert [r.token_ids for r in got] == [r.token_ids for r in ref], specs
            for a, b in zip(got, ref, strict=True):
                np.testing.assert_allclose(a.activation["reply"], b.activation["reply"], atol=1e-4)
    keys = compiled.ran()["decode"]["graph_keys"]
    assert {(k["steered"], k["residual"]) for k in keys} == {(False, True), (True, True)}
    assert all(k["graphs"] == 1 for k in keys), keys


# -- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.model  # a tiny model, but a self-chat's imports: seconds
def test_directions_held_in_memory_pass_a_runs_checks_and_are_refused_by_name(tiny_dirs) -> None:
    """Directions given to a live backend (`use_directions` of computed ones) are the run's: a vector
    steer passes the config check, the manifest says `memory:`, and loading that spec by name is a
    one-line error rather than a missing-file crash."""
    import driftlab as dl
    from driftlab.api import spec_of
    from driftlab.chat.factory import make_backend
    from driftlab.chat.spec import BackendSpec

    backend, _ = tiny_dirs
    spec = spec_of(backend)
    assert spec.directions is not None and spec.directions.startswith("memory:")
    french = next(p for p in dl.personas() if p.id == "reply-in-french").model_copy(update={"id": "french-short", "system_prompt": FRENCH})
    run = dl.selfchat(backend, personas=[french], pairs=1, rounds=1, max_new_tokens=4, probe_tokens=4,
                      steer="vector:alpha=1", progress=False)
    assert run.manifest["config"]["backend"]["directions"] == spec.directions
    with pytest.raises(DriftlabError, match="held in memory"):
        make_backend(BackendSpec(model="smollm2-135m", directions=spec.directions))


def test_directions_that_do_not_fit_are_one_line_errors_before_any_work(tiny_dirs, tmp_path) -> None:
    backend, directions = tiny_dirs
    with pytest.raises(DriftlabError, match="hold none for it"):
        backend.generate(ChatRequest([_conv("Be terse.")], GREEDY, interventions=Interventions.parse(["vector:alpha=1"])))
    with pytest.raises(DriftlabError, match="Layer 99 is outside"):
        backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, interventions=Interventions.parse(["cap:q=0.5,layers=99"])))
    other = synthetic(backend.shape.layers + 1, backend.d_model, [FRENCH], model="another")
    with pytest.raises(DriftlabError, match="are for another"):
        backend.use_directions(other)
    backend.use_directions(None)
    with pytest.raises(DriftlabError, match="was given none"):
        backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, interventions=Interventions.parse(["vector:alpha=1"])))
    with pytest.raises(DriftlabError, match="No directions at"):
        Directions.load(tmp_path)


def test_steer_specs_and_paths_are_checked_before_a_model_loads(tmp_path) -> None:
    from typer.testing import CliRunner

    from driftlab.chat.factory import make_backend
    from driftlab.chat.spec import BackendSpec
    from driftlab.cli import app

    for spec, message in (("vector:alpha=nan", "alpha"), ("cap:q=2", "q=2"), ("vector:alpha=1,layers=3.1", "layers"),
                          ("pi-floor:f=0", "f=0"), ("cap:q=0.5,layers=all", "layers")):
        with pytest.raises(DriftlabError, match=message):
            Interventions.parse([spec])
    result = CliRunner().invoke(app, ["chat", "--directions", str(tmp_path / "nope"), "Hi"])
    assert result.exit_code != 0 and "no directions at" in str(result.exception).splitlines()[0]
    for command in (["sweep", "--point", "vector:alpha=1"], ["run", "--steer", "cap:q=0.5"],
                    ["mmlu", "--steer", "vector:alpha=1"]):  # no model is loaded: the config refuses
        result = CliRunner().invoke(app, [*command, "--out", str(tmp_path / "x")])
        assert result.exit_code != 0 and "none were given" in str(result.exception), command
    assert not (tmp_path / "x").exists()
    synthetic(3, 8, [FRENCH]).save(tmp_path / "d")
    with pytest.raises(DriftlabError, match="remote openai: model"):
        make_backend(BackendSpec(model="openai:x", directions=str(tmp_path / "d")))


def test_directions_round_trip_through_their_files(tmp_path) -> None:
    directions = synthetic(5, 16, [FRENCH, PIRATE])
    directions.save(tmp_path)
    back = Directions.load(tmp_path / "directions.safetensors")
    assert back.digest and json.loads((tmp_path / "directions.json").read_text())["n_layers"] == 5
    for pid, p in directions.personas.items():
        q = back.personas[pid]
        assert q.system_prompt == p.system_prompt and q.band == p.band
        for name in ("unit", "norm", "with_proj", "without_proj", "auroc"):
            assert torch.equal(getattr(q, name), getattr(p, name)), name
    assert back.for_system(PIRATE).id == "p1" and back.for_system("other") is None


def test_hooks_install_once_and_come_off(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from tiny_models import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen2", tmp_path / "q"))
    hooks.install(model)
    hooks.install(model)
    assert all(len(_ours(layer)) == 1 for layer in model.model.layers)
    assert model.model._output_capturing_hooks_installed  # transformers' too, now: the hook count never changes
    hooks.remove(model)
    assert all(not _ours(layer) for layer in model.model.layers)


@pytest.mark.model  # a tiny model, loaded a second time
def test_steer_applies_vector_and_cap_to_your_own_generate_as_the_backend_does(tiny_dirs, tiny_llama) -> None:
    """`dl.steer(model, "vector:...", system=TEXT, directions=D)` around transformers' generate gives
    driftlab's own tokens (on the tiny model, where both steers change them); after the block the
    model is plain again; pi-floor is refused by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import driftlab as dl

    backend, directions = tiny_dirs
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).to(backend.device)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = torch.tensor([backend.render(_conv(FRENCH)).ids], device=backend.device)

    def generate() -> list[int]:
        out = model.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, pad_token_id=backend.pad_id)
        return out[0, ids.shape[1]:].tolist()

    plain = generate()
    for spec in ("vector:alpha=4,layers=0+2", "cap:q=0.95"):
        (want,) = backend.generate(ChatRequest([_conv(FRENCH)], GREEDY, interventions=Interventions.parse([spec])))
        with dl.steer(model, spec, system=FRENCH, tokenizer=tokenizer, directions=directions):
            got = generate()
        assert got[: len(want.token_ids)] == want.token_ids, spec
        assert want.token_ids != plain[: len(want.token_ids)], spec  # the steer acts
    assert generate() == plain and all(not _ours(layer) for layer in model.model.layers)
    with pytest.raises(DriftlabError, match="cannot apply pi-floor"):
        dl.steer(model, "pi-floor:f=0.8", system=FRENCH, tokenizer=tokenizer)
    with pytest.raises(DriftlabError, match="given no directions"):
        dl.steer(model, "vector:alpha=1", system=FRENCH, tokenizer=tokenizer)


@pytest.mark.model  # a tiny model, but a server
def test_serve_takes_residual_steers_and_refuses_each_bad_request_alone(tiny_dirs) -> None:
    """`driftlab serve` with directions: a vector steer per request as the local backend gives it (on
    the tiny model, where it changes the reply); a request whose system prompt has no direction, or a
    text completion asking a pi floor, gets a 422 of its own."""
    import httpx

    from driftlab.serve import ServeSettings, create_app
    from driftlab.serve.background import background as serving

    backend, _ = tiny_dirs
    conv = _conv(FRENCH)
    req = {"model": backend.name, "messages": conv, "max_tokens": 12, "temperature": 0}
    (local,) = backend.generate(ChatRequest([conv], GREEDY, interventions=Interventions.parse(["vector:alpha=4"])))
    assert local.text != backend.generate(ChatRequest([conv], GREEDY))[0].text  # the steer acts
    with serving(create_app(backend, ServeSettings(max_wait_ms=20))) as url:
        post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=300)  # noqa: E731
        steered = post("/v1/chat/completions", {**req, "driftlab": {"steer": "vector:alpha=4"}})
        assert steered.status_code == 200, steered.text
        assert steered.json()["choices"][0]["message"]["content"] == local.text
        floored = post("/v1/chat/completions", {**req, "driftlab": {"steer": "pi-floor:f=0.9"}})
        assert floored.status_code == 200, floored.text
        stranger = post("/v1/chat/completions", {**req, "messages": _conv("Be terse."),
                                                 "driftlab": {"steer": "cap:q=0.5"}})
        assert stranger.status_code == 422 and "hold none for it" in stranger.text
        text = post("/v1/completions", {"model": backend.name, "prompt": "Hello", "max_tokens": 4,
                                        "driftlab": {"steer": "pi-floor:f=0.9"}})
        assert text.status_code == 422 and "first turn" in text.text


def test_pi_floor_takes_pi_1_from_the_first_turn_and_a_floor_below_pi_changes_nothing(tiny_backend) -> None:
    """The floor's reference is pi at the first turn's last prompt token (what `trace` of that turn
    says); a floor that never binds (f tiny) gives plain decoding's tokens, and f = 1 changes them.
    On the tiny model (test_pi_floor.py compares floors on SmolLM2 with the reference)."""
    from driftlab.attention.config import AttentionConfig
    from driftlab.chat import teacher_forced

    backend = tiny_backend
    conv = [{"role": "system", "content": FRENCH}, {"role": "user", "content": "Tell me about London."},
            {"role": "assistant", "content": "London is big."},
            {"role": "user", "content": "What else? Tell me about its museums, parks and food."}]
    rendered = backend.render(conv, interventions=Interventions.parse(["pi-floor:f=0.5"]))
    first = backend.trace(conv[:2])  # the first turn, read with its generation prompt
    assert rendered.first_turn == first.prefill.shape[0] - 1
    values, starts = teacher_forced.floors(backend, [AttentionConfig(pi_floor=0.5)], [rendered.spans()], [rendered.ids])
    np.testing.assert_allclose(values[0].numpy(), 0.5 * first.prefill[-1], atol=1e-5)
    assert starts == [rendered.first_turn + 1]
    greedy = Sampling(greedy=True, max_new_tokens=8)  # f = 1 changes the second token already
    plain, low, full = (backend.generate(ChatRequest([conv], greedy, interventions=Interventions.parse(s)))[0]
                       for s in ([], ["pi-floor:f=0.0001"], ["pi-floor:f=1"]))
    assert low.token_ids == plain.token_ids and full.token_ids != plain.token_ids


def test_auroc_and_spearman_intervals_against_scikit_learn_and_scipy() -> None:
    """The AUROC of `stats.auroc_interval` is scikit-learn's (its resamples' form is test_stats.py's);
    Spearman's rho is scipy's; clusters resample whole conversations."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from driftlab.stats import auroc_interval, spearman_interval

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=60), rng.random(60) < 0.5
    clusters = np.repeat(np.arange(12), 5)
    got = auroc_interval(x + 2 * y, y, clusters)
    assert got.estimate == pytest.approx(roc_auc_score(y, x + 2 * y)) and got.low <= got.estimate <= got.high
    assert got.method == "cluster-bootstrap" and 0.5 < got.low
    assert np.isnan(auroc_interval(x, np.ones(60, bool)).estimate)  # one class: no AUROC
    noisy = x + rng.normal(size=60)
    rho = spearman_interval(x, noisy, clusters)
    assert rho.estimate == pytest.approx(spearmanr(x, noisy).statistic) and rho.low < rho.estimate < rho.high
    assert np.isnan(spearman_interval(x, np.ones(60)).estimate)  # a constant: no rank correlation


def test_a_replays_projection_is_checked_against_its_scored_turns() -> None:
    """A replay asks no probe but scores every agent turn: the projection's tracking and prediction
    tests read the turns there (and the probes wherever a run scored any)."""
    import pandas as pd
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from driftlab.report.activation import COLUMNS, checks, checks_table

    gen = np.random.default_rng(0)
    rows = [{"pair": p, "round": r, "what": "turn", "score": float(s), "projection": s + gen.normal(0, 0.5),
             "prompt_projection": s + gen.normal(0, 1.0)}
            for p in range(8) for r in range(1, 6) for s in [gen.random() < 0.5]]
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    got = checks(frame)
    assert got.unit == "agent turn" and got.track.n == got.predict.n == 40
    assert got.track.estimate == pytest.approx(spearmanr(frame.projection, frame.score).statistic)
    assert got.predict.estimate == pytest.approx(roc_auc_score(frame.score >= 0.5, frame.prompt_projection))
    assert "passing agent turn" in " ".join(" ".join(r) for r in checks_table(got).rows)
    probe = {"pair": 0, "round": 1, "what": "probe", "score": 1.0, "projection": 0.5, "prompt_projection": 0.5}
    assert checks(pd.concat([frame, pd.DataFrame([probe])], ignore_index=True)).unit == "probe"
