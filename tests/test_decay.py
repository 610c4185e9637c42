"""Attention decay: the teacher-forced replay gives the pi seen while decoding; the CLI writes its files.

SmolLM2 checks the replay against decoding, per token and per turn of a self-chat (its replies must
re-encode to the tokens generated, which a random model's seldom do); the CLI's files are bookkeeping,
written from a tiny random Llama (tests/tiny_models.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from devices import backend_device, tol
from driftlab.chat import Sampling, chat
from driftlab.errors import DriftlabError
from driftlab.protocol.decay import DecayTrace, agent_conversation, trace_dialogs, traces, turn_spans

pytestmark = pytest.mark.model


def test_replay_reproduces_the_pi_of_decoding(smol32):
    """pi traced token by token during generation == pi from one teacher-forced pass."""
    system, question = "Always reply in French.", "What do you do in London as a tourist?"
    conv = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    reply = chat(smol32, [conv], Sampling(greedy=True, max_new_tokens=20), steer=["trace"])[0]
    live = reply.trace.decode  # [n_tokens (+1 for EOS if stopped), L, H]
    trace = trace_dialogs(smol32, [{"pair": 0, "system": system, "a": [question], "b": [reply.text]}])
    n = min(len(live), len(trace.pi))
    assert n >= 10
    np.testing.assert_allclose(trace.pi[:n], live[:n], atol=tol(2e-4))
    assert (trace.round == 1).all() and (np.diff(trace.position) == 1).all()


def test_turn_spans_cover_the_agent_tokens(smol32):
    conv = agent_conversation("Be brief.", ["Hi!", "How are you?"], ["Hello.", "Fine, thanks."])
    spans = turn_spans(lambda c, gen: smol32.render(c, add_generation_prompt=gen).ids, conv, smol32.stop_ids)
    ids = smol32.render(conv, add_generation_prompt=False).ids
    texts = [smol32.decode(ids[s:e]) for s, e in filter(None, spans)]
    assert texts == ["Hello.", "Fine, thanks."]
    assert [s is None for s in spans] == [True, True, False, True, False]


def test_decay_cli_writes_traces_and_figures(tmp_path, tiny_llama):
    from typer.testing import CliRunner

    from driftlab.cli import app

    result = CliRunner().invoke(app, ["decay", "--model", str(tiny_llama), "--rounds", "2", "--pairs", "1",
                                      "--max-new-tokens", "8", "--dtype", "float32", "--device", backend_device(),
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    trace = DecayTrace.load(tmp_path / "decay.npz")
    assert trace.pi.shape[1:] == (3, 4) and set(trace.round.tolist()) == {1, 2}
    assert ((trace.pi >= 0) & (trace.pi <= 1)).all()
    for name in ("decay_fig4.png", "decay_rounds.png", "decay_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 20_000

    # A committed run keeps decay.npz but not the per-dialog arrays it resumes from: the report
    # reads the saved trace; with neither there is a clear error, not a traceback.
    shutil.rmtree(tmp_path / "traces")
    (tmp_path / "decay_fig4.png").unlink()
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "decay_fig4.png").stat().st_size > 20_000
    (saved,) = traces(tmp_path).values()
    np.testing.assert_array_equal(saved.pi, trace.pi)
    (tmp_path / "decay.npz").unlink()
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    # a DriftlabError: the entry point prints it as one "Error:" line with its hint
    assert isinstance(result.exception, DriftlabError) and "trace file(s)" in str(result.exception)


def test_a_decay_run_of_a_recorded_self_chat_gives_each_turn_the_pi_traced_live(smol32, tmp_path):
    """`measures_frame` joins a `driftlab decay --from-run` run to the self-chat it replayed: each agent
    turn's pi (mean over its tokens, layers and heads) is the one `--steer trace` recorded while decoding.
    A run generated under another steer is refused before any work: its replay would drop the steer."""
    import driftlab as dl
    from driftlab.api import spec_of
    from driftlab.protocol.decay import Decay, DecayConfig
    from driftlab.report.activation import measures_frame

    pairs = ["reply-in-french:very-happy", "all-caps:teen-slang"]
    live = tmp_path / "live"
    dl.selfchat(smol32, pair=pairs, rounds=2, max_new_tokens=8, probe_tokens=8, greedy=True, steer=["trace"],
                out=live, progress=False)
    replay = tmp_path / "decay"
    dl.run(Decay(DecayConfig(backend=spec_of(smol32), from_run=str(live), pairs=2), smol32), out=replay,
           progress=False)
    traced, replayed = (measures_frame(run).query("what == 'turn'").set_index(["pair", "round"]).pi
                        for run in (live, replay))
    assert len(traced) == 4 and traced.notna().all()
    np.testing.assert_allclose(replayed.loc[traced.index], traced, atol=tol(2e-4))

    spr = tmp_path / "spr"
    dl.selfchat(smol32, pair=pairs[:1], rounds=1, max_new_tokens=4, probe_tokens=4, greedy=True, steer=["spr:p=1"],
                out=spr, progress=False)
    with pytest.raises(DriftlabError, match="--steer spr"):
        dl.run(Decay(DecayConfig(backend=spec_of(smol32), from_run=str(spr), pairs=1), smol32),
               out=tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
