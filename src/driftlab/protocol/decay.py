"""Attention decay (seed 000 section 4.2, Figure 4; Appendix B, Figure 8).

pi(t) = the attention mass that the query generating token t+1 puts on the system-prompt
keys, per layer and head. A dialog (fresh self-chat, or one from a saved run) is replayed
through the tracing engine teacher-forced: one forward pass over the agent's whole
conversation [s_B, a_1, b_1, ..., a_R, b_R] gives pi at every position, which by
causality equals pi during the original decoding. We keep the positions that generate the
agent's tokens (pi is "absent for the user LM", as in the paper).

Output (compact): `decay.npz` with `pi` float16 [N, L, H] and per-row index arrays
`dialog`, `round`, `step` (token index within the turn), `position` (in the dialog); and
`decay.json` with the model, span mode, dialogs and system spans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from driftlab.chat.base import Conversation, Sampling
from driftlab.errors import DriftlabError
from driftlab.steering.interventions import Interventions, Trace


@dataclass
class DecayTrace:
    """pi values of the agent's tokens, with where each came from."""

    model: str
    pi: np.ndarray  # float32 [N, L, H]
    dialog: np.ndarray  # int [N]
    round: np.ndarray  # int [N], 1-based
    step: np.ndarray  # int [N], token index within its turn
    position: np.ndarray  # int [N], token position in the rendered dialog
    meta: dict[str, Any]

    @property
    def n_layers(self) -> int:
        return self.pi.shape[1]

    @property
    def n_heads(self) -> int:
        return self.pi.shape[2]

    def save(self, out: str | Path, name: str = "decay") -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            out / f"{name}.npz", pi=self.pi.astype(np.float16), dialog=self.dialog.astype(np.int32),
            round=self.round.astype(np.int16), step=self.step.astype(np.int32),
            position=self.position.astype(np.int32),
        )
        (out / f"{name}.json").write_text(json.dumps({"model": self.model, **self.meta}, indent=2))
        return out / f"{name}.npz"

    @classmethod
    def load(cls, path: str | Path) -> DecayTrace:
        path = Path(path)
        data = np.load(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        return cls(meta.pop("model"), data["pi"].astype(np.float32), data["dialog"], data["round"].astype(int),
                   data["step"], data["position"], meta)

    def round_means(self) -> np.ndarray:
        """Mean pi per (round, layer, head), averaging tokens within a dialog first: [R, L, H]."""
        rounds = sorted(set(self.round.tolist()))
        out = np.zeros((len(rounds), self.n_layers, self.n_heads))
        for i, r in enumerate(rounds):
            per_dialog = [self.pi[(self.round == r) & (self.dialog == d)].mean(0)
                          for d in sorted(set(self.dialog[self.round == r].tolist()))]
            out[i] = np.mean(per_dialog, axis=0)
        return out

    def steepest_head(self) -> tuple[int, int]:
        """The (layer, head) whose mean pi drops most from the first to the last round."""
        m = self.round_means()
        drop = m[0] - m[-1]
        layer, head = np.unravel_index(np.argmax(drop), drop.shape)
        return int(layer), int(head)


def agent_conversation(system: str, a: list[str], b: list[str]) -> Conversation:
    conv: Conversation = [{"role": "system", "content": system}]
    for a_i, b_i in zip(a, b, strict=True):
        conv += [{"role": "user", "content": a_i}, {"role": "assistant", "content": b_i}]
    return conv


def dialogs_from_run(run_dir: str | Path, max_dialogs: int | None = None) -> list[dict[str, Any]]:
    """The agent-side dialogs of a saved run (condition 'persona'), each up to its last complete round."""
    from driftlab.protocol.dialog import RECORDS, Dialog, pairs_from_manifest
    from driftlab.records.rundir import RunDir

    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    out = []
    for d in Dialog.from_records(pairs_from_manifest(manifest), ["persona"], rd.records(RECORDS)):
        n = d.rounds_complete()
        if n:
            out.append({"pair": d.pair.index, "system": d.pair.agent.system_prompt, "agent": d.pair.agent.id,
                        "a": [d.a[i] for i in range(1, n + 1)], "b": [d.b[i] for i in range(1, n + 1)]})
    if not out:
        raise DriftlabError(f"{run_dir} has no agent turns to replay.", hint="Run `driftlab run` first.")
    return out[:max_dialogs] if max_dialogs else out


def fresh_dialogs(backend, pairs: int, rounds: int, max_new_tokens: int, seed: int, out: Path) -> list[dict]:
    """Run a probe-free self-chat to get dialogs to replay (kept in out/selfchat)."""
    from driftlab.protocol.selfchat import SelfChat, SelfChatConfig

    cfg = SelfChatConfig(model=backend.name, pairs=pairs, rounds=rounds, probe_every=rounds + 1,
                         sampling=Sampling(max_new_tokens=max_new_tokens), seed=seed,
                         span=backend.renderer.span_mode)
    rundir = SelfChat(cfg, str(out / "selfchat"), backend).run()
    return dialogs_from_run(rundir.path)


def trace_dialogs(backend, dialogs: list[dict[str, Any]], batch_size: int = 4) -> DecayTrace:
    """Replay dialogs teacher-forced with pi tracing; keep the positions generating agent tokens."""
    trace = Interventions(items=(Trace(prefill=True),))
    rows: dict[str, list] = {"pi": [], "dialog": [], "round": [], "step": [], "position": []}
    systems = []
    for start in range(0, len(dialogs), batch_size):
        chunk = dialogs[start : start + batch_size]
        prompts, spans, turn_spans = [], [], []
        for d in chunk:
            conv = agent_conversation(d["system"], d["a"], d["b"])
            rendered = backend.render(conv, add_generation_prompt=False)
            prompts.append(rendered.ids)
            spans.append({"system": [rendered.system_span]} if rendered.system_span else {})
            turn_spans.append([s for s in backend.renderer.turn_spans(conv, backend.eos_ids) if s is not None])
            systems.append(rendered.system_span)
        replies = backend.generate_tokens(prompts, Sampling(greedy=True, max_new_tokens=1), interventions=trace,
                                          spans=spans, cache_store=[False] * len(chunk))
        for j, (reply, tspans) in enumerate(zip(replies, turn_spans, strict=True)):
            pre = reply.trace["prefill"].numpy()  # [T, L, H]; pi at query p predicts token p+1
            for rnd, (s, e) in enumerate(tspans, start=1):
                positions = np.arange(s - 1, e - 1)
                rows["pi"].append(pre[positions])
                rows["dialog"].append(np.full(len(positions), start + j))
                rows["round"].append(np.full(len(positions), rnd))
                rows["step"].append(np.arange(len(positions)))
                rows["position"].append(positions + 1)
    cat = {k: np.concatenate(v) for k, v in rows.items()}
    meta = {
        "span_mode": backend.renderer.span_mode,
        "system_spans": systems,
        "dialogs": [{k: d[k] for k in ("pair", "agent", "system") if k in d} for d in dialogs],
        "n_layers": int(cat["pi"].shape[1]),
        "n_heads": int(cat["pi"].shape[2]),
        "definition": "pi at the query that generates each agent token (teacher-forced replay)",
    }
    return DecayTrace(backend.name, cat["pi"], cat["dialog"], cat["round"], cat["step"], cat["position"], meta)
