"""Attention decay (persona-drift paper section 4.2, Figure 4; Appendix B, Figure 8).

pi(t) = the attention mass that the query generating token t+1 puts on the system-prompt
keys, per layer and head. A dialog (fresh self-chat, or one from a saved run) is replayed
through the tracing engine teacher-forced: one forward pass over the agent's whole
conversation [s_B, a_1, b_1, ..., a_R, b_R] gives pi at every position, which by
causality equals pi during the original decoding. We keep the positions that generate the
agent's tokens (pi is "absent for the user LM", as in the paper).

`Decay` runs this as a protocol: its run directory records the dialogs to replay (or the
plan of the fresh self-chat that makes them, in RUN/selfchat), and each traced dialog as a
record with its arrays in RUN/traces/<model>/<dialog>.npz, so a killed replay resumes.
Output (compact): `decay.npz` with `pi` float16 [N, L, H] and per-row index arrays
`dialog`, `round`, `step` (token index within the turn), `position` (in the dialog); and
`decay.json` with the model, span mode, dialogs, system spans and sliding-window layers;
`decay_<model>.npz/json` for each `compare` model (the same dialogs, the persona-drift paper's Fig. 8).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from driftlab.chat.base import MAX_SEED, Conversation, Sampling, TokenBackend, token_backend
from driftlab.chat.spec import ModelName
from driftlab.errors import DriftlabError
from driftlab.protocol.dialog import RECORDS as DIALOG_RECORDS
from driftlab.protocol.dialog import Dialog, pairs_from_manifest
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, config_of, run_protocol
from driftlab.protocol.selfchat import SelfChat, SelfChatConfig, digest
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions, Trace

DEFINITION = "pi at the query that generates each agent token (teacher-forced replay)"


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

    def sliding_note(self) -> str | None:
        """Sliding-window layers stop seeing the system prompt once it leaves the window: say so."""
        n = sum(t == "sliding_attention" for t in self.meta.get("layer_types", []))
        if not n:
            return None
        return (f"{self.model}: {n} of {self.n_layers} layers attend within a {self.meta.get('sliding_window')}-token "
                "window; their pi is 0 once the system prompt is further back, which lowers its mean mechanically.")


def agent_conversation(system: str, a: list[str], b: list[str]) -> Conversation:
    conv: Conversation = [{"role": "system", "content": system}]
    for a_i, b_i in zip(a, b, strict=True):
        conv += [{"role": "user", "content": a_i}, {"role": "assistant", "content": b_i}]
    return conv


def dialogs_from_run(run_dir: str | Path, max_dialogs: int | None = None) -> list[dict[str, Any]]:
    """The agent-side dialogs of a saved run (condition 'persona'), each up to its last complete round."""
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    records = rd.records(DIALOG_RECORDS)
    ends = {(r.pair, r.round): r.finish_reason for r in records
            if r.kind == "turn" and r.condition == "persona" and r.speaker == "agent"}
    out = []
    for d in Dialog.from_records(pairs_from_manifest(manifest), ["persona"], records):
        n = d.rounds_complete()
        if n:
            out.append({"pair": d.pair.index, "system": d.pair.agent.system_prompt, "agent": d.pair.agent.id,
                        "a": [d.a[i] for i in range(1, n + 1)], "b": [d.b[i] for i in range(1, n + 1)],
                        "turn_ends": [ends[d.pair.index, i] for i in range(1, n + 1)]})
    if not out:
        raise DriftlabError(f"{run_dir} has no agent turns to replay.", hint="Run `driftlab run` first.")
    return out[:max_dialogs] if max_dialogs else out


def unsteered(run_dir: str | Path) -> None:
    """One line where a run's replies were generated under a steer: the replay traces the plain dialog,
    so its pi would be of contexts the model never saw (SPR's reminders missing, a steer's shift absent)."""
    steer = Interventions.parse(config_of(RunDir(run_dir).read_manifest()).get("steer") or [])
    found = sorted(steer.kinds - {"trace"})
    if found:
        raise DriftlabError(f"{run_dir} was generated with --steer {found[0]}, and the attention-decay replay "
                            "reads the dialog without steers, so its pi would not be the one the model had.",
                            hint="Trace a run without --steer (or with --steer trace only), or trace pi live: "
                                 "`driftlab run --steer trace` with the same steer.")


def turn_spans(render: Callable[[Conversation, bool], list[int]], conversation: Conversation,
               stop_ids: frozenset[int] | set[int]) -> list[tuple[int, int] | None]:
    """Token ranges of each assistant turn's generated tokens in the full rendering.

    `render(conversation, add_generation_prompt)` gives a rendering's token ids. For
    assistant message k the range starts where generation would start (the rendering of
    messages[:k] with the generation prompt) and ends after its first stop token; None for
    other messages. Relies on the template rendering a conversation as the concatenation
    of its turns, which is checked.
    """
    full = render(conversation, False)
    spans: list[tuple[int, int] | None] = []
    for k, msg in enumerate(conversation):
        if msg["role"] != "assistant":
            spans.append(None)
            continue
        start = len(render(conversation[:k], True))
        head = render(conversation[: k + 1], False)
        stop = len(head)
        if head != full[: len(head)]:
            raise DriftlabError(
                "This chat template does not render a dialog as the concatenation of its turns, "
                "so token positions of turns cannot be located.",
                hint="Use a model whose template is concatenative (ChatML, Llama, Gemma, plain).",
            )
        end = next((i + 1 for i in range(start, stop) if full[i] in stop_ids), stop)
        spans.append((start, end))
    return spans


def trace_batch(backend: TokenBackend, dialogs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replay dialogs teacher-forced with pi tracing, one forward pass each (batched).

    Per dialog: `pi` float32 [n, L, H] at the positions generating its agent tokens, with
    `round`, `step` and `position` [n], and its `system_span`. A turn whose `turn_ends` (a recorded
    run's finish reasons) says it was cut never generated its end-of-turn token: that position is left
    out, as decoding never computed it (dialogs planned before `turn_ends` was recorded keep it).
    """
    trace = Interventions.of(Trace(prefill=True))
    render = lambda conv, gen: backend.render(conv, add_generation_prompt=gen).ids  # noqa: E731
    rendered, turns = [], []
    for d in dialogs:
        conv = agent_conversation(d["system"], d["a"], d["b"])
        rendered.append(backend.render(conv, add_generation_prompt=False))
        turns.append([s for s in turn_spans(render, conv, backend.stop_ids) if s is not None])
    replies = backend.generate_tokens(rendered, Sampling(greedy=True, max_new_tokens=1), interventions=trace,
                                      cache_store=[False] * len(dialogs))
    out = []
    for d, reply, tspans, r in zip(dialogs, replies, turns, rendered, strict=True):
        pre = reply.trace.prefill  # [T, L, H]; pi at query p predicts token p+1
        parts: dict[str, list] = {"pi": [], "round": [], "step": [], "position": []}
        cut = [end != "stop" for end in d.get("turn_ends", [])] or [False] * len(tspans)
        for rnd, ((s, e), was_cut) in enumerate(zip(tspans, cut, strict=True), start=1):
            positions = np.arange(s - 1, e - 1 - was_cut)
            parts["pi"].append(pre[positions])
            parts["round"].append(np.full(len(positions), rnd))
            parts["step"].append(np.arange(len(positions)))
            parts["position"].append(positions + 1)
        out.append({**{k: np.concatenate(v) for k, v in parts.items()}, "system_span": r.system_span})
    return out


def assemble(model: str, dialogs: Sequence[dict[str, Any]], parts: Sequence[dict[str, Any]],
             meta: dict[str, Any]) -> DecayTrace:
    """One DecayTrace of dialogs and their traced parts (in dialog order)."""
    pi = np.concatenate([p["pi"] for p in parts])
    meta = {
        **meta,
        "system_spans": [p["system_span"] for p in parts],
        "dialogs": [{k: d[k] for k in ("pair", "agent", "system") if k in d} for d in dialogs],
        "n_layers": int(pi.shape[1]),
        "n_heads": int(pi.shape[2]),
        "definition": DEFINITION,
    }
    return DecayTrace(model, pi, np.concatenate([np.full(len(p["pi"]), i) for i, p in enumerate(parts)]),
                      np.concatenate([p["round"] for p in parts]), np.concatenate([p["step"] for p in parts]),
                      np.concatenate([p["position"] for p in parts]), meta)


def trace_dialogs(backend: TokenBackend, dialogs: list[dict[str, Any]], batch_size: int = 4) -> DecayTrace:
    """Replay dialogs teacher-forced with pi tracing; keep the positions generating agent tokens."""
    parts = [part for start in range(0, len(dialogs), batch_size)
             for part in trace_batch(backend, dialogs[start : start + batch_size])]
    return assemble(backend.name, dialogs, parts, _shape_meta(backend))


def _shape_meta(backend: TokenBackend) -> dict[str, Any]:
    shape = backend.shape
    return {"span_mode": backend.describe().get("span_mode"), "layer_types": list(shape.layer_types),
            "sliding_window": shape.sliding_window}


# -- the protocol -----------------------------------------------------------------------------------
class DecayConfig(ProtocolConfig):
    """An attention-decay replay (recorded in the run's manifest)."""

    compare: list[ModelName] = Field(default_factory=list, description="also trace the same dialogs on these models")
    from_run: str | None = Field(None, description="replay the dialogs of this self-chat run (else a fresh one)")
    pairs: int = Field(4, ge=1, description="dialogs to trace (the first N of --from-run)")
    rounds: int = Field(6, ge=1, le=1000, description="rounds of the fresh self-chat")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="tokens per turn of the fresh self-chat")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the fresh self-chat")
    batch_size: int = Field(4, ge=1, le=1024, description="dialogs replayed per forward pass")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")

    def fresh(self) -> SelfChatConfig:
        """The probe-free self-chat whose dialogs are replayed when no --from-run is given."""
        return SelfChatConfig(backend=self.backend, pairs=self.pairs, rounds=self.rounds, probe_every=self.rounds + 1,
                              sampling=Sampling(max_new_tokens=self.max_new_tokens), seed=self.seed,
                              probe_tokens="turn")  # never probed: keeps the manifests of older runs resumable

    def models(self) -> list[str]:
        return [self.backend.model, *self.compare]


class TraceRecord(BaseModel):
    """One dialog replayed on one model; its arrays are in `file` (relative to the run directory)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    kind: Literal["trace"] = "trace"
    model: str
    dialog: int = Field(ge=0)
    file: str
    tokens: int = Field(ge=0)
    system_span: tuple[int, int] | None = None
    # what the model's trace needs said about it (see `DecayTrace.sliding_note`)
    span_mode: str | None = None
    layer_types: list[str] = Field(default_factory=list)
    sliding_window: int | None = None

    @property
    def key(self) -> tuple:
        return ("trace", self.model, self.dialog)


RECORDS: TypeAdapter = TypeAdapter(TraceRecord)


@register
class Decay(Protocol[DecayConfig]):
    """Trace pi over dialogs on a model (and the same dialogs on `compare` models, one after
    another, each loaded when its turn comes); a unit is one batch of dialogs on one model."""

    name = "decay"
    records = RECORDS
    unit = "dialogs"

    def check(self) -> None:
        if self.config.from_run is not None:
            unsteered(self.config.from_run)
            dialogs_from_run(self.config.from_run, self.config.pairs)
        else:
            SelfChat(self.config.fresh()).check()

    def require(self) -> None:
        token_backend(self.backend, "attention-decay tracing")

    def plan(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.from_run is not None:
            return {"dialogs": dialogs_from_run(cfg.from_run, cfg.pairs)}
        return {"selfchat": SelfChat(cfg.fresh()).draw_plan()}

    def inputs(self) -> dict[str, str]:
        return {"source": digest(dialogs_from_run(self.config.from_run, self.config.pairs))} \
            if self.config.from_run is not None else {}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        plan = manifest.get("dialogs") or (manifest.get("selfchat") or {}).get("pairs", [])
        return {"trace": len(plan) * (1 + len(config_of(manifest).get("compare", [])))}

    def units(self, state: RunState) -> Iterator[tuple[str, list[int]]]:
        dialogs = state.manifest.get("dialogs")
        if dialogs is None:  # the fresh self-chat, continued from the recorded plan
            fresh = run_protocol(SelfChat(self.config.fresh(), self.backend), self.run_dir / "selfchat",
                                 plan=state.manifest["selfchat"], progress=self.progress)
            dialogs = dialogs_from_run(fresh.path)
        self.dialogs = dialogs
        size = self.config.batch_size
        for model in self.config.models():
            todo = [i for i in range(len(dialogs)) if ("trace", model, i) not in state.done]
            for start in range(0, len(todo), size):
                yield model, todo[start : start + size]

    def run_unit(self, unit: tuple[str, list[int]]) -> list[TraceRecord]:
        model, batch = unit
        backend = self._backend_for(model)
        records = []
        for i, part in zip(batch, trace_batch(backend, [self.dialogs[i] for i in batch]), strict=True):
            file = f"traces/{self.config.models().index(model)}/{i}.npz"
            (self.run_dir / file).parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(self.run_dir / file, pi=part["pi"], round=part["round"], step=part["step"],
                                position=part["position"])
            records.append(TraceRecord(model=model, dialog=i, file=file, tokens=len(part["pi"]),
                                       system_span=part["system_span"], **_shape_meta(backend)))
        return records

    def _backend_for(self, model: str) -> TokenBackend:
        """The model's backend; a compare model replaces the one before it (one model in memory)."""
        if model == self.backend.name:
            return token_backend(self.backend, "attention-decay tracing")
        from driftlab.chat.factory import make_backend

        self.backend = make_backend(self.config.backend.model_copy(update={"model": model}))
        return token_backend(self.backend, "attention-decay tracing")

    def finish(self, state: RunState) -> None:
        for model, trace in traces(self.run_dir).items():
            trace.save(self.run_dir, name=saved_name(model, self.config.backend.model))


def saved_name(model: str, main: str) -> str:
    """The stem of a model's saved trace in the run directory (`finish` writes it)."""
    return "decay" if model == main else f"decay_{Path(model).name}"


def traces(run_dir: str | Path) -> dict[str, DecayTrace]:
    """model -> its float32 DecayTrace, from a decay run's records (main model first).

    The per-dialog arrays under `traces/` are what a run resumes from; a copied or committed
    run directory may keep only the assembled `decay*.npz` (float16), which is read instead.
    """
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    dialogs = manifest.get("dialogs") or dialogs_from_run(rd.path / "selfchat")
    by_model: dict[str, dict[int, TraceRecord]] = {}
    for r in rd.records(RECORDS):
        by_model.setdefault(r.model, {})[r.dialog] = r
    out = {}
    main = config_of(manifest)["backend"]["model"]
    for model in [main, *config_of(manifest).get("compare", [])]:
        recs = [by_model.get(model, {}).get(i) for i in range(len(dialogs))]
        if any(r is None for r in recs):
            continue  # not traced yet
        missing = [r.file for r in recs if not (rd.path / r.file).exists()]
        if missing:
            saved = rd.path / f"{saved_name(model, main)}.npz"
            if not saved.exists():
                raise DriftlabError(
                    f"{rd.path}: {len(missing)} trace file(s) of {model} are missing (e.g. {missing[0]}) and "
                    f"there is no {saved.name} to read instead.",
                    hint="Restore the run's traces/ folder, or trace again into a new --out directory.")
            out[model] = DecayTrace.load(saved)
            continue
        parts = []
        for r in recs:
            with np.load(rd.path / r.file) as data:
                parts.append({k: data[k] for k in ("pi", "round", "step", "position")} | {"system_span": r.system_span})
        first = recs[0]
        out[model] = assemble(model, dialogs, parts, {"span_mode": first.span_mode, "layer_types": first.layer_types,
                                                      "sliding_window": first.sliding_window})
    return out
