"""driftlab inside vLLM (`--model vllm:NAME`): every steer and every measure against the transformers engine.

vLLM's engine and driftlab's transformers engine run SmolLM2-135M in float32 side by side; for
each steer kind, greedy replies must be token for token the same, each token's log-probability
within 1e-3, pi within 1e-4 and the persona projections within 1e-4 (relative to the projection's
own scale: the two engines' float32 kernels round differently, and a late layer's stream is
O(10)). These need vLLM (the vllm extra): where it is not installed they are skipped, and CI runs
them in its second environment (.ci/run). The engines start once per module (vLLM eager: ~10 s).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from driftlab.chat import BackendSpec, ChatRequest, Sampling, make_backend
from driftlab.chat.base import Rendered
from driftlab.errors import DriftlabError
from driftlab.records.rundir import RunDir
from driftlab.steering import Interventions
from test_activation import FRENCH, PIRATE, synthetic
from vllm_replies import as_json

pytestmark = pytest.mark.vllm

GREEDY = Sampling(greedy=True, max_new_tokens=16)
LOGPROB_TOL, PI_TOL, PROJ_TOL = 1e-3, 1e-4, 1e-4
# Every kind the vLLM backend applies, alone and composed (heads and layers spelt out, as requests do).
STEERS = {
    "plain": [],
    "trace": ["trace"],
    "split-softmax": ["split-softmax:k=0.6", "trace"],
    "split-softmax-heads": ["split-softmax:k=0.3,heads=0-5+9.1"],
    "instaboost": ["instaboost:m=5", "trace"],
    "bias": ["bias:value=2.0,heads=3+5.1", "trace"],
    "pasta": ["pasta:heads=3.1+5.2+11,span=system", "trace"],
    "pasta-all": ["pasta:heads=3.1+5.2,span=system,scope=all,alpha=0.05"],
    # Untraced, PASTA's decode steps reweight vLLM's output (step.AttentionGroup.reweight); traced, they attend again.
    "pasta-untraced": ["pasta:heads=3.1+5.2+11,span=system"],
    "pi-floor": ["pi-floor:f=0.9", "trace"],
    "vector": ["vector:alpha=2"],
    "cap": ["cap:q=0.9", "trace"],
    "cap-file": ["cap:q=file"],  # the thresholds stored with the directions (an imported capping config)
    "composed": ["vector:alpha=-2,layers=2-20", "split-softmax:k=0.7", "instaboost:m=2", "trace"],
    "spr": ["spr:p=1.0", "trace"],
    # The gate: the first two conversations are first turns (pi_t / pi_1 = 1, not steered), DIALOG has drifted.
    "when-drifting": ["when-drifting:r=0.99", "split-softmax:k=0.6", "trace"],
    "when-drifting-projection": ["when-drifting:r=0.99,by=projection", "vector:alpha=2"],
}


def _conv(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


DIALOG = [*_conv(FRENCH, "What do you do in London as a tourist?"),
          {"role": "assistant", "content": "Bonjour ! Je visite les musées."}, {"role": "user", "content": "And then?"}]
CONVS = [_conv(FRENCH, "What do you do in London as a tourist?"), _conv(PIRATE, "Hello there, how are you?"), DIALOG]
# Prompts past vLLM's 128-token blocks, sharing a system prompt: what its prefix cache keeps.
RULES = FRENCH + " " + " ".join(f"Rule {i}: answer politely and briefly." for i in range(30))
LONG = [_conv(RULES, "What do you do in London?"), _conv(RULES, "What is your name?")]


@pytest.fixture(scope="module")
def directions(tmp_path_factory) -> Path:
    """Synthetic persona directions for FRENCH, PIRATE and RULES on SmolLM2's shape, on disk (vLLM's worker
    reads them), each with stored cap thresholds on its band (as an imported capping config gives)."""
    out = tmp_path_factory.mktemp("dirs")
    found = synthetic(30, 576, [FRENCH, PIRATE, RULES])
    for pid, p in found.personas.items():
        caps = torch.full((30,), float("nan"))
        caps[list(p.band)] = p.quantile(0.6)[list(p.band)]
        found.personas[pid] = dataclasses.replace(p, caps=caps)
    found.save(out)
    return out


@pytest.fixture(scope="module")
def engines(directions):
    """(transformers engine, vLLM engine), both float32, both given the directions."""
    hf = make_backend(BackendSpec(model="smollm2-135m", dtype="float32", directions=str(directions)))
    vl = make_backend(BackendSpec(model="vllm:smollm2-135m", dtype="float32", directions=str(directions)))
    return hf, vl


def _same_reply(a, b, what: str) -> None:
    """Replies (`Reply`s, or their JSON from a fresh process: vllm_replies.as_json) that agree as the module says."""
    a, b = (r if isinstance(r, dict) else as_json(r) for r in (a, b))
    assert a["token_ids"] == b["token_ids"], f"{what}: {a['text']!r} vs {b['text']!r}"
    assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
    if a["logprobs"] is not None:
        gaps = np.abs(np.array(a["logprobs"]) - np.array(b["logprobs"]))
        assert gaps.max(initial=0.0) < LOGPROB_TOL, (what, gaps.max())
    assert (a["pi"] is None) == (b["pi"] is None), what
    if a["pi"] is not None:
        np.testing.assert_allclose(np.array(b["pi"]), np.array(a["pi"]), atol=PI_TOL, rtol=0, err_msg=what)
    assert (a["gate"] is None) == (b["gate"] is None), what
    if a["gate"] is not None:
        assert a["gate"]["steered"] == b["gate"]["steered"], what
        for key, tol in (("pi_ratio", PI_TOL), ("projection_first", PROJ_TOL), ("projection", PROJ_TOL)):
            if key in a["gate"]:
                assert abs(a["gate"][key] - b["gate"][key]) < tol * max(1.0, abs(a["gate"][key])), (what, key)
    assert (a["activation"] is None) == (b["activation"] is None), what
    if a["activation"] is not None:
        for key in ("reply", "prompt", "last"):
            x, y = np.array(a["activation"][key]), np.array(b["activation"][key])
            np.testing.assert_allclose(y, x, atol=PROJ_TOL * max(1.0, float(np.abs(x).max())), rtol=0,
                                       err_msg=f"{what} {key}")


def _elsewhere(tmp_path: Path, spec: dict, kinds: list[str], convs: str = "CONVS") -> dict:
    """An engine of other options in a fresh process (vLLM keeps one engine per process): its replies
    to the conversations named `convs` under each steer of `kinds`, and its describe()."""
    out = tmp_path / "replies.json"
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_replies.py")), json.dumps(spec),
                           json.dumps([STEERS[k] for k in kinds]), convs, str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", list(STEERS))
def test_every_steer_in_vllm_matches_the_transformers_engine(engines, kind) -> None:
    hf, vl = engines
    request = ChatRequest(CONVS, GREEDY, interventions=Interventions.parse(STEERS[kind]), logprobs=3)
    for i, (a, b) in enumerate(zip(hf.generate(request), vl.generate(request), strict=True)):
        _same_reply(a, b, f"{kind} row {i}")
        assert [alt for alt, _ in a.logprobs[0].top] == [alt for alt, _ in b.logprobs[0].top]
        if a.end is not None:
            assert b.end is not None and abs(a.end.logprob - b.end.logprob) < LOGPROB_TOL


def test_when_drifting_in_vllm_steers_the_drifted_dialog_alone(engines) -> None:
    """The gate decides per row inside one vLLM request: the first turns keep pi_t / pi_1 = 1 and are
    only traced, DIALOG has drifted (its ratio below 0.99) and is steered, so its reply differs from
    plain; the decisions and replies equal the transformers engine's (test above)."""
    _, vl = engines
    gated = vl.generate(ChatRequest(CONVS, GREEDY, interventions=Interventions.parse(STEERS["when-drifting"])))
    plain = vl.generate(ChatRequest(CONVS, GREEDY, interventions=Interventions.parse(["trace"])))
    assert [r.gate["steered"] for r in gated] == [False, False, True]
    assert [r.gate["pi_ratio"] for r in gated[:2]] == [1.0, 1.0] and gated[2].gate["pi_ratio"] < 0.99
    assert [r.token_ids for r in gated[:2]] == [r.token_ids for r in plain[:2]]
    assert gated[2].token_ids != plain[2].token_ids


def _masked_logprobs(hf, conv, iv: Interventions, reply, schema: str) -> np.ndarray:
    """Each reply token's log-probability after the grammar's mask: the transformers engine's
    teacher-forced distributions (`prompt_logprobs`, under the steer), with the tokens xgrammar's own
    matcher disallows removed and the rest renormalised. The reference for vLLM's."""
    import xgrammar as xgr

    from driftlab.chat.constrain import compiled

    rendered = hf.render(conv, interventions=iv)
    n = len(reply.token_ids)
    extended = dataclasses.replace(rendered, ids=rendered.ids + reply.token_ids[:-1])
    (lp,) = hf.prompt_logprobs([extended], [n], interventions=iv)  # row t: the distribution of reply token t
    matcher = xgr.GrammarMatcher(compiled(hf.tokenizer, lp.shape[-1], hf.eos_ids, schema))
    mask = xgr.allocate_token_bitmask(1, lp.shape[-1])
    out = []
    for t, tok in enumerate(reply.token_ids):
        matcher.fill_next_token_bitmask(mask)
        row = lp[t : t + 1].clone()
        xgr.apply_token_bitmask_inplace(row, mask)
        out.append(float(torch.log_softmax(row[0], -1)[tok]))
        assert matcher.accept_token(tok)
    return np.array(out)


def test_a_json_schema_constrains_vllm_as_the_transformers_engine(engines) -> None:
    """`Sampling.json_schema` (the server's response_format) in vLLM: the transformers engine's grammar,
    handed to vLLM's structured outputs, gives the same greedy tokens, steered or not; a reply that
    stops is JSON with the schema's required properties. vLLM reads log-probs after the grammar's mask
    (over the tokens it allows), the transformers engine before it: vLLM's equal the transformers
    engine's distributions masked by xgrammar's own matcher and renormalised."""
    hf, vl = engines
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name", "age"]})
    sampling = GREEDY.model_copy(update={"json_schema": schema, "max_new_tokens": 32})
    convs = [CONVS[0], _conv(FRENCH, "Describe Paris as JSON with a name and an age.")]
    for steer in ([], ["split-softmax:k=0.6"]):
        request = ChatRequest(convs, sampling, interventions=Interventions.parse(steer), logprobs=0)
        for i, (a, b) in enumerate(zip(hf.generate(request), vl.generate(request), strict=True)):
            what = f"json {steer} row {i}"
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), what
            reference = _masked_logprobs(hf, convs[i], request.interventions, a, schema)
            np.testing.assert_allclose([t.logprob for t in b.logprobs], reference, atol=LOGPROB_TOL, rtol=0,
                                       err_msg=what)
            assert (reference > np.array([t.logprob for t in a.logprobs]) + 0.01).any()  # the mask does count
            if b.finish_reason == "stop":
                assert {"name", "age"} <= set(json.loads(b.text))
    assert vl.generate(ChatRequest(convs[1:], sampling))[0].finish_reason == "stop"


def test_tensor_parallel_vllm_steers_attention_and_traces_pi_per_head_as_one_process(engines, directions,
                                                                                   tmp_path) -> None:
    """`--tensor-parallel 3` (SmolLM2's 9 query heads and 3 KV heads: 3 and 1 per worker, in three
    worker processes): head selections are read against the whole model, each worker steers its own
    heads, and pi per head is joined over the workers. Split-softmax on some heads, PASTA on some heads,
    a pi floor (its per-head floors shared out) and a steer that composes a vector, split-softmax,
    InstABoost and a trace give the transformers engine's replies (one process, no shards)."""
    hf, _ = engines
    kinds = ["split-softmax-heads", "pasta", "pi-floor", "composed"]
    got = _elsewhere(tmp_path, {"model": "vllm:smollm2-135m", "dtype": "float32", "directions": str(directions),
                                "runtime": {"tensor_parallel": 3}}, kinds)
    for kind, replies in zip(kinds, got["replies"], strict=True):
        request = ChatRequest(CONVS, GREEDY, interventions=Interventions.parse(STEERS[kind]), logprobs=0)
        for i, (a, b) in enumerate(zip(hf.generate(request), replies, strict=True)):
            _same_reply(a, b, f"tensor-parallel {kind} row {i}")
            if b["pi"] is not None:
                assert np.array(b["pi"]).shape[-1] == 9  # every head's, from three workers


def test_mixed_steers_in_one_vllm_batch_equal_each_alone_and_a_plain_row_equals_plain(engines) -> None:
    """Rows of different steers share vLLM's batch (one generate_tokens call, a steer per row): each
    reply equals the same row run alone, and the unsteered row equals a plain run."""
    _, vl = engines
    prompt = vl.render(CONVS[0])
    rows = [Interventions.parse(STEERS[k]) for k in ("plain", "split-softmax", "instaboost", "pi-floor", "trace")]
    rows[3] = Interventions.parse(["bias:value=-1.5", "trace"])  # (a floor needs a first turn: generate() marks it)
    together = vl.generate_tokens([prompt] * len(rows), GREEDY, interventions=rows, logprobs=0)
    for i, iv in enumerate(rows):
        (alone,) = vl.generate_tokens([prompt], GREEDY, interventions=iv, logprobs=0)
        _same_reply(alone, together[i], f"row {i}")
    assert len({tuple(r.token_ids) for r in together}) >= 3  # the steers do differ


def test_prefix_cache_on_equals_off_for_steered_and_plain_rows_sharing_a_system_prompt(engines, directions,
                                                                                       tmp_path) -> None:
    """The same requests twice on an engine with prefix caching (the second time from cached blocks:
    vLLM counts them) and once on an engine without: the same replies, pi and projections."""
    _, vl = engines
    kinds = ["trace", "split-softmax", "plain", "cap"]
    first = [vl.generate(ChatRequest(LONG, GREEDY, interventions=Interventions.parse(STEERS[k]), logprobs=0))
             for k in kinds]
    cached_before = vl.cached_prompt_tokens
    again = [vl.generate(ChatRequest(LONG, GREEDY, interventions=Interventions.parse(STEERS[k]), logprobs=0))
             for k in kinds]
    assert vl.cached_prompt_tokens - cached_before >= 128 * len(LONG) * len(kinds)  # every row read cached blocks
    off = _elsewhere(tmp_path, {"model": "vllm:smollm2-135m", "dtype": "float32", "directions": str(directions),
                                "runtime": {"prefix_caching": False}}, kinds, "LONG")
    for s, kind in enumerate(kinds):
        for i in range(len(LONG)):
            _same_reply(off["replies"][s][i], first[s][i], f"{kind} row {i} first")
            _same_reply(off["replies"][s][i], again[s][i], f"{kind} row {i} cached")


def test_teacher_forced_reads_reuse_the_last_reads_blocks_and_read_a_cached_prompt_again_whole(engines) -> None:
    """`prompt_logprobs` (the KLs' reads): a dialog's next turn reads the blocks its last read left (vLLM
    counts them), and a prompt read twice (its kept positions then cached) gives the same distributions
    both times; each within 2e-4 of the transformers engine's."""
    hf, vl = engines
    turn = [*LONG[0], {"role": "assistant", "content": "Je visite les musées, puis je mange."}]
    longer = [*turn, {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Je me promène."}]
    first, second = (hf.render(c, add_generation_prompt=False) for c in (turn, longer))
    want = hf.prompt_logprobs([first, second], [9, 7], cache_store=[False, False])
    (a,) = vl.prompt_logprobs([first], [9])
    before = vl.cached_prompt_tokens
    (b,) = vl.prompt_logprobs([second], [7])
    assert vl.cached_prompt_tokens - before >= 128  # the first read's full blocks, reused
    (again,) = vl.prompt_logprobs([first], [9])  # every block of it cached now: read again under its own salt
    assert torch.equal(again, a)
    for got, ref in ((a, want[0]), (b, want[1])):
        assert got.shape == ref.shape and float((got - ref).abs().max()) < 2e-4


def test_scores_traces_projections_and_activations_in_vllm_match_the_transformers_engine(engines) -> None:
    """The other local contracts: log-likelihoods (MMLU, PASTA scoring), a prefill trace (decay),
    teacher-forced projections (project) and mean activations (directions)."""
    hf, vl = engines
    iv = Interventions.parse(["split-softmax:k=0.6"])
    for a, b in zip(hf.loglikelihood(CONVS[:2], [" Bonjour", " Arr"], iv), vl.loglikelihood(CONVS[:2], [" Bonjour", " Arr"], iv),
                    strict=True):
        assert abs(a.logprob - b.logprob) < LOGPROB_TOL and a.n_tokens == b.n_tokens and a.is_greedy == b.is_greedy
    a, b = hf.trace(DIALOG), vl.trace(DIALOG)
    np.testing.assert_allclose(b.prefill, a.prefill, atol=PI_TOL, rtol=0)
    prompts = [hf.render(DIALOG, add_generation_prompt=False)]
    ((_, pa),), ((_, pb),) = hf.project_prompts(prompts, [FRENCH]), vl.project_prompts(prompts, [FRENCH])
    np.testing.assert_allclose(pb.numpy(), pa.numpy(), atol=PROJ_TOL * max(1.0, float(pa.abs().max())), rtol=0)
    request = ChatRequest(CONVS[:2], GREEDY)
    (ra, ma), (rb, mb) = hf.generate_activations(request), vl.generate_activations(request)
    assert [r.token_ids for r in ra] == [r.token_ids for r in rb]
    np.testing.assert_allclose(mb.numpy(), ma.numpy(), atol=1e-3, rtol=1e-4)


@pytest.mark.compile
def test_vllm_compiled_equals_eager(engines, directions, tmp_path) -> None:
    """vLLM's compiled mode (torch.compile of the forward pass, driftlab's residual op inside it):
    the same replies as eager, for residual and attention steers and telemetry."""
    _, eager = engines
    kinds = ["plain", "composed", "cap", "pasta"]
    compiled = _elsewhere(tmp_path, {"model": "vllm:smollm2-135m", "dtype": "float32", "decode": "compiled",
                                     "directions": str(directions)}, kinds)
    assert compiled["describe"]["compiled"] and not eager.describe()["compiled"]
    for s, kind in enumerate(kinds):
        request = ChatRequest(CONVS, GREEDY, interventions=Interventions.parse(STEERS[kind]), logprobs=0)
        for i, reply in enumerate(eager.generate(request)):
            _same_reply(reply, compiled["replies"][s][i], f"{kind} row {i}")


def test_what_vllm_cannot_do_is_one_line_before_any_work(engines, tmp_path, monkeypatch) -> None:
    from driftlab.chat.vllm_engine import install
    from tiny_models import make_tiny_model

    _, vl = engines
    with pytest.raises(DriftlabError, match="cannot apply --steer cfg: cfg mixes"):
        vl.generate(ChatRequest(CONVS[:1], GREEDY, interventions=Interventions.parse(["cfg:alpha=1.5"])))
    with pytest.raises(ValueError, match="vllm:smollm2-135m cannot apply --steer cfg"):
        from driftlab.protocol.selfchat import SelfChatConfig

        SelfChatConfig(backend=BackendSpec(model="vllm:smollm2-135m"), steer=["cfg:alpha=1.5"])
    tiny = make_tiny_model("llama", tmp_path / "tiny")  # head size 16
    with pytest.raises(DriftlabError, match="heads of size 16, which vLLM's CPU attention kernel does not take"):
        make_backend(BackendSpec(model=f"vllm:{tiny}", dtype="float32"))
    monkeypatch.setattr(install, "TESTED", ("0.0.1",))
    with pytest.raises(DriftlabError, match=r"vLLM 0\.32\.0 is installed; driftlab's vLLM adapter is tested with 0\.0\.1"):
        install.check_version()


@pytest.mark.parametrize("verbose", [False, True])
def test_chat_on_vllm_prints_only_the_reply_on_stdout(engines, verbose: bool) -> None:
    """`reply=$(driftlab chat --model vllm:...)` captures the reply: vLLM's log goes to stderr, its INFO
    lines only with `driftlab -v` (before the fix, ~40 lines of engine configuration came first)."""
    _, vl = engines
    conv = [{"role": "user", "content": "Say hello."}]
    (want,) = vl.generate(ChatRequest([conv], Sampling(greedy=True, max_new_tokens=8)))
    args = [sys.executable, "-m", "driftlab", *(["-v"] if verbose else []), "chat", "--model", "vllm:smollm2-135m",
            "--dtype", "float32", "--greedy", "--max-new-tokens", "8", "Say hello."]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == want.text + "\n", done.stdout[:2000]
    assert (" INFO " in done.stderr) == verbose, done.stderr[-2000:]


def test_a_replay_on_vllm_equals_the_transformers_engines(engines, tmp_path) -> None:
    """`driftlab replay --model vllm:...`: the same agent turns, scores, pi and both KLs (`--kl`: the whole
    distributions, read in vLLM's worker) as the transformers engine (greedy, float32) on user turns
    from a file: the KLs within 1e-4 nats per token."""
    from driftlab.api.options import KEYWORDS, replay_config
    from driftlab.protocol.replay import Replay
    from driftlab.protocol.runner import run_protocol

    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t} for t in turns]}) + "\n"
                            for turns in (["Hi! Name a cat.", "And a dog?", "Thanks!"], ["Tell me about Paris."])))
    found = {}
    for engine in engines:
        config = replay_config(BackendSpec(model="smollm2-135m", dtype="float32"), KEYWORDS, {
            "conversations": logs, "agents": "reply-in-french,all-lowercase", "rounds": 3, "max_new_tokens": 12,
            "greedy": True, "steer": "trace", "kl": True})
        rd = run_protocol(Replay(config, engine), tmp_path / engine.describe()["backend"], progress=False)
        found[engine.describe()["backend"]] = {(r["pair"], r["round"]): r for r in rd.records()}
    hf, vl = found.values()
    assert hf.keys() == vl.keys() and len(hf) == 4
    for key, want in hf.items():
        assert vl[key]["text"] == want["text"] and vl[key]["score"] == want["score"], key
        np.testing.assert_allclose(vl[key]["pi"], want["pi"], atol=PI_TOL, rtol=0)
        assert vl[key]["kl"]["positions"] == want["kl"]["positions"], key
        for kl in ("reminded", "prompt"):
            assert abs(vl[key]["kl"][kl] - want["kl"][kl]) < 1e-4, (key, kl, vl[key]["kl"], want["kl"])
    assert any(r["kl"]["reminded"] > 1e-3 for r in hf.values()) and all(r["kl"]["prompt"] > 0 for r in hf.values())


def test_a_selfchat_on_vllm_resumes_after_kill_9_and_reports_three_ways(commands, tmp_path) -> None:
    """`driftlab run --model vllm:...` with directions, trace and `--kl`: killed after its first durable
    batch, the same command resumes it to the uninterrupted run's records (greedy), and its report
    shows the probe, pi, the projection and the KLs."""
    from driftlab.bench import get_persona

    directions = synthetic(30, 576, [get_persona(p).system_prompt for p in ("reply-in-french", "all-caps")]).save(
        tmp_path / "dirs").parent
    args = ["run", "--model", "vllm:smollm2-135m", "--dtype", "float32", "--pair", "reply-in-french:very-happy",
            "--pair", "all-caps:teen-slang", "--pairs", "0", "--rounds", "2", "--max-new-tokens", "8",
            "--probe-tokens", "8", "--greedy", "--steer", "trace", "--kl", "--directions", str(directions)]
    ref = commands.run([*args, "--out", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = commands.run([*args, "--out", str(tmp_path / "run")], kill_after=1)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    kept = (tmp_path / "run" / "records.jsonl").read_bytes()
    done = commands.run([*args, "--out", str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "records.jsonl").read_bytes().startswith(kept)
    # The resumed run's dialogs are the uninterrupted one's; its pi and projections agree to the engines'
    # tolerance (the resumed engine computes from an empty prefix cache, in batches of other rows).
    key = lambda r: (r["kind"], r["pair"], r["round"], r.get("speaker"), r.get("persona"))  # noqa: E731
    ref_records = {key(r): r for r in RunDir(tmp_path / "ref").records()}
    resumed = {key(r): r for r in RunDir(tmp_path / "run").records()}
    assert resumed.keys() == ref_records.keys() and len(resumed) == 10
    for k, r in resumed.items():
        want = ref_records[k]
        assert r["text"] == want["text"], k
        assert (r["pi"] is None) == (want["pi"] is None) and (r["activation"] is None) == (want["activation"] is None), k
        if r["pi"] is not None:
            np.testing.assert_allclose(r["pi"], want["pi"], atol=PI_TOL, rtol=0)
        if r["activation"] is not None:
            np.testing.assert_allclose(r["activation"]["reply"], want["activation"]["reply"], atol=1e-3, rtol=1e-4)
        if r.get("kl") is not None or want.get("kl") is not None:
            assert abs(r["kl"]["reminded"] - want["kl"]["reminded"]) < 1e-4 and \
                abs(r["kl"]["prompt"] - want["kl"]["prompt"]) < 1e-4, k
    agent = [r for r in RunDir(tmp_path / "ref").records() if r["kind"] == "turn" and r["speaker"] == "agent"]
    assert agent and all(r["pi"] and r["activation"] and r["kl"] for r in agent)
    assert RunDir(tmp_path / "ref").read_manifest()["models"]["agent"]["backend"] == "vllm"
    page = (tmp_path / "ref" / "report.html").read_text()
    assert "Drift measured side by side" in page


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    from conftest import CommandServer

    server = CommandServer(tmp_path_factory.mktemp("commands"), ["driftlab.cli"])
    yield server
    server.close()


def test_a_rendered_prompt_without_a_system_span_runs_plain_in_vllm(engines) -> None:
    """A raw token prompt (no system span) under trace: pi is zero, the reply the plain one's."""
    hf, vl = engines
    ids = vl.render(CONVS[0]).ids
    raw = Rendered(ids=ids, text="", system_span=None)
    (a,), (b,) = (be.generate_tokens([raw], GREEDY, interventions=Interventions.parse(["trace"])) for be in (hf, vl))
    _same_reply(a, b, "raw")
    assert float(np.abs(b.trace.decode).max()) == 0.0


def test_driftlab_serve_on_vllm_batches_requests_of_different_steers_with_telemetry(engines) -> None:
    """`driftlab serve --model vllm:...`: concurrent requests, each with its own steer, decode in
    vLLM's running batch (continuous batching), each as the engine alone replies to it, with pi
    telemetry where asked; a stream reassembles to the whole reply; a response_format's JSON schema holds."""
    import asyncio

    import httpx

    from driftlab.serve import ServeSettings, create_app
    from driftlab.serve.background import background

    _, vl = engines
    steers = [None, "split-softmax:k=0.6", "instaboost:m=5", "vector:alpha=2", "trace"] * 2
    body = lambda steer, i: {"model": vl.name, "messages": CONVS[i % 2], "max_tokens": 12, "temperature": 0,  # noqa: E731
                             **({"driftlab": {"steer": steer, "telemetry": True}} if steer else {})}
    app = create_app(vl, ServeSettings(max_batch_size=16, max_wait_ms=200, max_tokens_limit=64))
    with background(app) as url:
        before, joined = app.state.batcher.n_batches, app.state.batcher.n_admitted

        async def ask_all():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*[client.post(f"{url}/v1/chat/completions", json=body(s, i))
                                              for i, s in enumerate(steers)])

        answers = asyncio.run(ask_all())
        assert [a.status_code for a in answers] == [200] * len(steers), answers[0].text
        for i, (steer, answer) in enumerate(zip(steers, answers, strict=True)):
            iv = Interventions.parse([steer] if steer else [])
            (alone,) = vl.generate(ChatRequest([CONVS[i % 2]], Sampling(greedy=True, max_new_tokens=12), interventions=iv))
            got = answer.json()
            assert got["choices"][0]["message"]["content"] == alone.text, steer
            if steer:
                telemetry = got["driftlab"]["telemetry"]
                assert telemetry["pi"]["first"] > 0 and telemetry["projection"] is not None, steer
        sizes = app.state.batcher.sizes_since(before)
        admitted = app.state.batcher.n_admitted - joined  # rows that joined a running batch
        assert sum(sizes) + admitted == len(steers) and len(sizes) < len(steers), (sizes, admitted)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body("trace", 0), "stream": True},
                          timeout=300) as streamed:
            pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in streamed.iter_lines() if line.startswith("data: {") and '"choices"' in line]
        assert len([p for p in pieces if p]) > 3
        assert "".join(pieces) == answers[4].json()["choices"][0]["message"]["content"]
        echo = httpx.post(f"{url}/v1/completions", json={"model": vl.name, "prompt": "Hi", "max_tokens": 1, "echo": True,
                                                         "logprobs": 1}, timeout=300)  # scoring a prompt: refused
        assert echo.status_code == 422 and "does not" in echo.json()["error"]["message"], echo.text
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        asked = {"model": vl.name, "messages": _conv(FRENCH, "Describe Paris as JSON with a name and an age."),
                 "max_tokens": 32, "temperature": 0,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}}
        constrained = httpx.post(f"{url}/v1/chat/completions", json=asked, timeout=300)
        assert constrained.status_code == 200, constrained.text
        assert {"name", "age"} <= set(json.loads(constrained.json()["choices"][0]["message"]["content"]))
