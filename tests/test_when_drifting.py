"""Adaptive control, `--steer when-drifting:r=R`: the other steers act on a conversation only once
its pi (the attention mass on its system prompt at the reply's first token, mean over layers and
heads) has fallen below R times its first turn's.

The ratio is checked against transformers' own eager attention weights on SmolLM2; the decision
against the plain and always-on replies, row by row in one mixed batch; a self-chat records each
decision. What is the gate's bookkeeping (each row's decision, token for token, and what the records
keep) runs on a tiny random Llama (tests/tiny_models.py): a forward pass costs a millisecond there, and
each test asserts that the steer changes its replies, so a row steered wrongly still shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from devices import backend_device, tol
from driftlab.chat import ChatRequest, Sampling
from driftlab.chat.hf import HFChatBackend
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS
from driftlab.protocol.runner import run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig
from driftlab.steering.interventions import Interventions

FRENCH = "Always reply in French, whatever the user writes."
FIRST = [{"role": "system", "content": FRENCH}, {"role": "user", "content": "What do you do in London as a tourist?"}]
LATER = [*FIRST, {"role": "assistant", "content": "Je visite le British Museum et je me promène le long de la Tamise."},
         {"role": "user", "content": "Nice. And what should I eat there? Tell me about the food, the markets and "
                                     "the pubs, in as much detail as you can."}]
STEER = "instaboost:m=20"
GREEDY = Sampling(greedy=True, max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> HFChatBackend:
    return HFChatBackend(str(tiny_llama), dtype="float32", device=backend_device(), prefix_cache_bytes=0)


@pytest.mark.parametrize("specs, message", [
    (["when-drifting:r=0.9"], "none is given"),
    (["when-drifting:r=0.9", "cfg:alpha=1.5", STEER], "cfg acts on the whole batch"),
    (["when-drifting:r=0.9", "spr:p=0.5", STEER], "spr acts on the whole batch"),
    (["when-drifting:r=0", STEER], "greater than 0"),
    (["when-drifting:r=1.5", STEER], "less than or equal to 1"),
])
def test_bad_gates_are_one_line_errors(specs, message) -> None:
    with pytest.raises(DriftlabError, match=message):
        Interventions.parse(specs)


def test_a_gate_over_the_trace_alone_is_a_monitor_whose_replies_the_kls_can_read() -> None:
    """`--steer trace --steer when-drifting:r=R` reads the gate's signal at every reply and steers none (both
    halves are the trace): what `driftlab warn` tests as a warning, with the KLs beside it."""
    from driftlab.protocol import divergence

    steer = Interventions.parse(["trace", "when-drifting:r=0.9"])
    gate, on, off = steer.gated()
    assert on == off == Interventions.parse(["trace"]) and divergence.monitor(steer)
    assert divergence.measured_steer(steer) == Interventions()  # the KLs read plain contexts
    with pytest.raises(DriftlabError, match="mixes or switches"):
        divergence.measured_steer(Interventions.parse(["trace", "when-drifting:r=0.9", STEER]))


def test_the_gate_splits_a_steer_into_its_on_and_off_halves() -> None:
    gate, on, off = Interventions.parse([STEER, "trace", "when-drifting:r=0.5"]).gated()
    assert gate.r == 0.5 and gate.by == "pi"
    assert on == Interventions.parse([STEER, "trace"]) and off == Interventions.parse(["trace"])
    assert Interventions.parse([STEER]).gated() is None


def test_the_gate_s_signal_is_pi_unless_asked_and_its_spec_reads_as_before() -> None:
    """`by=pi` is the default and left out of the spec (records and sweeps written before `by`
    existed read the same); `by=projection` is kept; another signal is a one-line error."""
    (pi,) = Interventions.parse(["when-drifting:r=0.5,by=pi", STEER]).by_hook("gate")
    assert pi.spec() == "when-drifting:r=0.5" == Interventions.parse(["when-drifting:r=0.5", STEER]).get("when-drifting").spec()
    by = Interventions.parse(["when-drifting:r=0.5,by=projection", STEER]).get("when-drifting")
    assert by.by == "projection" and by.spec() == "when-drifting:r=0.5,by=projection"
    with pytest.raises(DriftlabError, match="pi.*projection"):
        Interventions.parse(["when-drifting:r=0.5,by=attention", STEER])
    # a run gated by projection without directions stops before anything loads
    with pytest.raises(ValueError, match="when-drifting:by=projection needs persona directions"):
        SelfChatConfig(steer=[STEER, "when-drifting:r=0.5,by=projection"])
    assert SelfChatConfig(steer=[STEER, "when-drifting:r=0.5"]).steer.gated()[0].by == "pi"


def test_a_gate_by_score_is_a_replay_s_and_can_gate_any_steer() -> None:
    """`by=score` steers the turn after a failing one: only a replay scores every agent turn, so a self-chat
    refuses it and an engine (a server) too, in one line; since the replay splits its batch by the decision,
    SPR and CFG can be gated that way. The decision: previous score below r; none on a first turn."""
    from driftlab.chat import gate as gates
    from driftlab.protocol.replay import ReplayConfig

    steer = Interventions.parse(["spr:p=1", "when-drifting:r=0.5,by=score"])
    found, on, off = steer.gated()
    assert found.spec() == "when-drifting:r=0.5,by=score" and on == Interventions.parse(["spr:p=1"]) and off == Interventions()
    assert ReplayConfig(steer=["spr:p=1", "when-drifting:r=0.5,by=score"]).steer == steer
    with pytest.raises(ValueError, match="a self-chat scores its probes only: use driftlab replay"):
        SelfChatConfig(steer=[STEER, "when-drifting:r=0.5,by=score"])
    with pytest.raises(DriftlabError, match="only a replay scores every agent turn"):
        gates.gated(None, [None], steer, [FRENCH])
    assert [gates.score_decision(found, s)["steered"] for s in (None, 0.0, 0.49, 0.5, 1.0)] == [False, True, True,
                                                                                                   False, False]


@pytest.mark.model
def test_drift_ratio_is_pi_at_the_reply_over_pi_at_the_first_turn_by_eager_attention(smol32, smol_dir, device):
    """pi_t / pi_1 from transformers' eager softmax weights summed over the system prompt's key
    columns, at the last prompt token and at the first turn's last token (mean over layers and heads)."""
    from transformers import AutoModelForCausalLM

    gate = Interventions.parse([STEER, "when-drifting:r=0.9"])
    rendered = smol32.render(LATER, interventions=gate)
    s, e = rendered.system_span
    end = rendered.spans()["first_turn"][0][1]
    assert 0 < end < len(rendered.ids)
    eager = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        out = eager.to(device).eval()(input_ids=torch.tensor([rendered.ids], device=device), output_attentions=True)
    pi = torch.stack([a[0, :, :, s:e].sum(-1) for a in out.attentions]).float()  # [L, H, T]
    want = (pi[:, :, -1].mean() / pi[:, :, end - 1].mean()).item()
    assert smol32.drift_ratio(rendered) == pytest.approx(want, abs=tol(1e-4))
    assert want < 0.9  # the second turn reads its system prompt less than the first did
    assert smol32.drift_ratio(smol32.render(FIRST, interventions=gate)) == 1.0  # a first turn has not drifted
    with pytest.raises(DriftlabError, match="no system prompt"):
        smol32.drift_ratio(smol32.render(FIRST[1:], interventions=gate))


@pytest.mark.model
def test_in_one_batch_each_row_gets_the_steer_only_where_it_has_drifted(tiny) -> None:
    """Two rows, one batch: the first turn (ratio 1) decodes as plain, the drifted one as the
    always-on steer, token for token; the decisions come back on the replies."""
    def one(conv, specs):
        (reply,) = tiny.generate(ChatRequest([conv], GREEDY, interventions=Interventions.parse(specs)))
        return reply

    plain, on = one(LATER, []), one(LATER, [STEER])
    assert plain.token_ids != on.token_ids  # the steer changes this reply: the test has teeth
    first_plain = one(FIRST, [])
    assert first_plain.token_ids != one(FIRST, [STEER]).token_ids
    both = tiny.generate(ChatRequest([FIRST, LATER], GREEDY,
                                     interventions=Interventions.parse([STEER, "when-drifting:r=1"])))
    assert [r.gate["steered"] for r in both] == [False, True]
    assert both[0].gate["pi_ratio"] == 1.0 and both[1].gate["pi_ratio"] < 1
    assert both[0].token_ids == first_plain.token_ids and both[1].token_ids == on.token_ids
    (never,) = tiny.generate(ChatRequest([LATER], GREEDY, interventions=Interventions.parse(
        [STEER, f"when-drifting:r={both[1].gate['pi_ratio'] / 2}"])))
    assert never.gate["steered"] is False and never.token_ids == plain.token_ids
    assert plain.gate is None and on.gate is None


@pytest.mark.model
def test_a_selfchat_records_each_agent_reply_s_decision(tiny, tmp_path) -> None:
    """Round 1 is never steered (its ratio is 1); every agent turn carries the gate, and the
    user side, never steered, none."""
    cfg = SelfChatConfig(pairs=1, rounds=2, seed=0, steer=[STEER, "when-drifting:r=1"],
                         sampling=Sampling(max_new_tokens=6, greedy=True), probe_tokens=6)
    rundir = run_protocol(SelfChat(cfg, tiny), tmp_path / "run", progress=False)
    records = rundir.records(RECORDS)
    agent = sorted((r for r in records if r.kind == "turn" and r.speaker == "agent"), key=lambda r: r.round)
    assert [r.round for r in agent] == [1, 2]
    assert agent[0].gate == {"r": 1.0, "pi_ratio": 1.0, "steered": False}
    assert agent[1].gate["steered"] is True and 0 < agent[1].gate["pi_ratio"] < 1
    assert all(r.gate is None for r in records if r.kind == "turn" and r.speaker == "user")
    assert np.isfinite([r.gate["pi_ratio"] for r in agent]).all()


@pytest.mark.model
def test_scoring_and_residual_steers_follow_each_row_s_decision(tiny) -> None:
    """MMLU's path (log-likelihoods) scores a first-turn context as plain and a drifted one as the
    steer; a vector steer leaves a row the gate keeps plain unsteered; token prompts refuse a gate."""
    from test_activation import FRENCH as DIRECTED
    from test_activation import synthetic

    def ll(contexts, specs):
        return [x.logprob for x in tiny.loglikelihood(contexts, [" Bonjour"] * len(contexts),
                                                      Interventions.parse(specs))]

    plain, on = ll([FIRST, LATER], []), ll([FIRST, LATER], [STEER])
    assert all(abs(p - o) > 1e-3 for p, o in zip(plain, on, strict=True))  # the steer moves both scores
    gated = ll([FIRST, LATER], [STEER, "when-drifting:r=1"])
    assert gated[0] == pytest.approx(plain[0], abs=tol(1e-5)) and gated[1] == pytest.approx(on[1], abs=tol(1e-5))

    later = [{"role": "system", "content": DIRECTED}, *LATER[1:]]
    tiny.use_directions(synthetic(tiny.shape.layers, tiny.d_model, [DIRECTED]))
    try:
        def reply(specs):
            (r,) = tiny.generate(ChatRequest([later], GREEDY, interventions=Interventions.parse(specs)))
            return r.token_ids

        vector = "vector:alpha=8"
        plain, steered = reply([]), reply([vector])
        assert steered != plain
        assert reply([vector, "when-drifting:r=0.0001"]) == plain
        assert reply([vector, "when-drifting:r=1"]) == steered
    finally:
        tiny.use_directions(None)
    with pytest.raises(DriftlabError, match="token prompts"):
        tiny.generate_tokens([tiny.render(FIRST)], GREEDY, interventions=Interventions.parse([STEER, "when-drifting:r=1"]))


def _drifting_directions(model_dir, device, system: str, convs: list[list[dict]], backend):
    """Directions for `system` built from a plain forward hook's hidden states (an eager copy of the
    model, not driftlab's hooks): per layer, the unit vector from the later turn's last hidden
    state to the first turn's, with the without/with means set 1 below and above the two, so both
    normalised projections lie in (0, 1) and the later one is lower (a conversation that drifted).
    Returns the directions and, per conversation, its (first, now) band means by that reference."""
    from transformers import AutoModelForCausalLM

    from driftlab.activation.directions import Directions, PersonaDirection

    eager = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    layers = eager.model.layers

    def states(ids: list[int]) -> torch.Tensor:  # [L, T, d] each decoder layer's output
        seen = []
        hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
                 for layer in layers]
        try:
            with torch.inference_mode():
                eager(input_ids=torch.tensor([ids], device=device))
        finally:
            for h in hooks:
                h.remove()
        return torch.stack([x[0] for x in seen]).float().cpu()

    gate = Interventions.parse([STEER, "when-drifting:r=1,by=projection"])
    rendered = [backend.render(c, interventions=gate) for c in convs]
    picked = []
    for r in rendered:
        h = states(r.ids)
        picked.append((h[:, r.spans()["first_turn"][0][1] - 1], h[:, -1]))  # [L, d] at the first turn's end, now
    first, now = picked[-1]
    unit = torch.nn.functional.normalize(first - now, dim=-1)
    p_first, p_now = (first * unit).sum(-1), (now * unit).sum(-1)
    low, high = p_now - 1, p_first + 1
    L = len(layers)
    band = tuple(range(L // 3, min(L // 3 + 3, L)))
    direction = PersonaDirection(id="drift", system_prompt=system, unit=unit, norm=torch.ones(L),
                                 with_proj=high[None].repeat(4, 1), without_proj=low[None].repeat(4, 1),
                                 auroc=torch.ones(3, L), band=band)
    directions = Directions({"model": backend.name, "n_layers": L, "d_model": unit.shape[1]}, [direction])
    want = [tuple(float((((x * unit).sum(-1) - low) / (high - low))[list(band)].mean()) for x in pair) for pair in picked]
    return directions, want


@pytest.mark.model
def test_by_projection_each_row_is_steered_only_where_its_persona_projection_fell(tiny, tiny_llama, device) -> None:
    """`when-drifting:by=projection`: the first turn's and the reply's normalised projections equal
    a plain forward hook's (band mean); in one batch the first turn (ratio 1) decodes as plain and
    the drifted conversation as the always-on steer, token for token; r below its ratio keeps it
    plain. Without directions it is a one-line error before any work."""
    directions, want = _drifting_directions(tiny_llama, device, FRENCH, [FIRST, LATER], tiny)
    gate = Interventions.parse([STEER, "when-drifting:r=1,by=projection"])
    with pytest.raises(DriftlabError, match="no persona directions"):
        tiny.check_steer(LATER, gate)
    tiny.use_directions(directions)
    try:
        got = [tiny.projection_drift(tiny.render(c, interventions=gate), FRENCH) for c in (FIRST, LATER)]
        np.testing.assert_allclose(got, want, atol=tol(1e-4), rtol=0)
        assert 0 < want[1][1] < want[1][0] < 1 and got[0][0] == got[0][1]  # LATER drifted; FIRST is its own reference

        def one(conv, specs):
            (reply,) = tiny.generate(ChatRequest([conv], GREEDY, interventions=Interventions.parse(specs)))
            return reply

        plain, on = one(LATER, []), one(LATER, [STEER])
        assert plain.token_ids != on.token_ids  # the steer changes this reply: the test has teeth
        both = tiny.generate(ChatRequest([FIRST, LATER], GREEDY, interventions=gate))
        assert [r.gate["steered"] for r in both] == [False, True]
        ratio = both[1].gate["projection_ratio"]
        assert both[0].gate["projection_ratio"] == 1.0 and ratio == pytest.approx(want[1][1] / want[1][0], abs=tol(1e-4))
        assert both[0].token_ids == one(FIRST, []).token_ids and both[1].token_ids == on.token_ids
        (never,) = tiny.generate(ChatRequest([LATER], GREEDY, interventions=Interventions.parse(
            [STEER, f"when-drifting:r={ratio / 2},by=projection"])))
        assert never.gate["steered"] is False and never.token_ids == plain.token_ids
        other = [{"role": "system", "content": "You are a pirate."}, *LATER[1:]]
        with pytest.raises(DriftlabError, match="none for system prompt 'You are a pirate.'"):
            tiny.check_steer(other, gate)
    finally:
        tiny.use_directions(None)


@pytest.mark.model
def test_a_monitoring_gate_records_its_reading_beside_the_kls_on_every_replayed_turn(tiny, tmp_path) -> None:
    """A replay under a monitor writes the gate's reading and both KLs on every agent turn, its
    replies those of the plain run, and `driftlab warn` reads the reading as a signal."""
    import json

    import driftlab as dl
    from driftlab.report.warn import turns_frame

    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q} for q in qs]}) + "\n" for qs in
                            (["Where should I travel in May?", "And what should I pack?"],
                             ["Tell me about bread.", "Which flour is best?"])))  # a first turn and a later one
    common = dict(conversations=logs, agents="reply-in-french,all-caps", max_new_tokens=8, greedy=True, kl=True,
                  progress=False)
    watched = dl.replay(tiny, steer=["trace", "when-drifting:r=0.9"], out=tmp_path / "monitor", **common)
    plain = dl.replay(tiny, out=tmp_path / "plain", **{**common, "kl": False})  # --kl changes no reply (test_kl.py)
    assert [r["text"] for r in watched.records] == [r["text"] for r in plain.records]
    assert len(watched.records) == 4 and all(r["gate"]["pi_ratio"] > 0 and r["kl"] for r in watched.records)
    assert turns_frame(tmp_path / "monitor")["gate"].notna().all()
