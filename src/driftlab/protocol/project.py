"""Project a recorded self-chat onto persona directions, teacher-forced (`driftlab project`).

Why: a run's transcripts are data already; whether its agent drifted in activation space needs
no new generation. Each dialog [s_B, a_1, b_1, ..., a_R, b_R] is read by the model once, with
its persona's direction on every layer (`--directions`), and each probe [.., b_i, p, b'_i] once
more, its dialog prefix taken from the prefix cache (only the probe and its reply are computed).
Per agent turn and probe reply this records what a live run with `--directions` records
(`Reply.activation`): the mean projection over the positions that generated the reply (the
last prompt token, then every reply token but the last), the last prompt token's, per layer,
normalised (0: like without the system prompt, 1: like with it). By causality these equal the
projections during the original decoding, up to float rounding and the re-encoding of the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter

from driftlab.chat.base import Conversation, token_backend
from driftlab.errors import DriftlabError
from driftlab.protocol.decay import agent_conversation, turn_spans
from driftlab.protocol.dialog import RECORDS as DIALOG_RECORDS
from driftlab.protocol.dialog import Dialog, pairs_from_manifest
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, config_of
from driftlab.records.rundir import RunDir


class ProjectConfig(ProtocolConfig):
    """Which run to project (the backend must name `directions`)."""

    from_run: str = Field(description="a self-chat run directory")
    dialogs: int | None = Field(None, ge=1, description="at most this many dialogs (default: all)")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ProtocolConfig.RESUME_IGNORES


class ProjectionRecord(BaseModel):
    """One agent turn's or agent probe reply's projection, per layer, normalised."""

    kind: Literal["projection"] = "projection"
    pair: int = Field(ge=0)
    round: int = Field(ge=1)
    what: Literal["turn", "probe"]
    direction: str
    band: list[int]
    reply: list[float]
    prompt: list[float]
    positions: int = Field(ge=1)

    @property
    def key(self) -> tuple:
        return ("projection", self.pair, self.round, self.what)


@register
class Project(Protocol[ProjectConfig]):
    name = "project"
    records = TypeAdapter(ProjectionRecord)
    unit = "projections"

    def check(self) -> None:
        if not self.config.backend.directions:
            raise DriftlabError("Projecting a run needs persona directions.",
                                hint="Pass --directions DIR (from driftlab directions).")
        self._dialogs()

    def require(self) -> None:
        token_backend(self.backend, "driftlab project")

    def _dialogs(self) -> list[dict[str, Any]]:
        return recorded_dialogs(self.config.from_run, self.config.dialogs)

    def plan(self) -> dict[str, Any]:
        return {"dialogs": self._dialogs()}

    def describe(self) -> dict[str, Any]:
        return {"models": {"agent": self.backend.describe()}, "from_run": str(Path(self.config.from_run))}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"projection": sum(len(d["a"]) + len(d["probes"]) for d in manifest["dialogs"])}

    def units(self, state: RunState) -> Iterable[dict[str, Any]]:
        for d in state.manifest["dialogs"]:
            if ("projection", d["pair"], 1, "turn") not in state.done:
                yield d

    def run_unit(self, d: dict[str, Any]) -> list[ProjectionRecord]:
        """The dialog in one pass, then its probes in one batch on the dialog's cached prefix."""
        dialog = agent_conversation(d["system"], d["a"], d["b"])
        records = self._turns(d, dialog, [("turn", i + 1, end) for i, end in enumerate(d["turn_ends"])])
        for probe in d["probes"]:
            k = probe["view"] - 1  # exchanges before the probe
            conv = dialog[: 1 + 2 * k] + [{"role": "user", "content": d["probe"]},
                                          {"role": "assistant", "content": probe["reply"]}]
            records += self._turns(d, conv, [("probe", probe["round"], probe["end"])], last_only=True)
        return records

    def _turns(self, d: dict[str, Any], conv: Conversation, which: list[tuple[str, int, str]],
               last_only: bool = False) -> list[ProjectionRecord]:
        """Records of the assistant turns of `conv` (all, or its last), projected in one pass."""
        backend = self.backend
        rendered = backend.render(conv, add_generation_prompt=False)
        render = lambda c, gen: backend.render(c, add_generation_prompt=gen).ids  # noqa: E731
        spans = [s for s in turn_spans(render, conv, backend.stop_ids) if s is not None]
        spans = spans[-1:] if last_only else spans
        (first, proj), = backend.project_prompts([rendered], [d["system"]], compute_from=[spans[0][0] - 1],
                                                 cache_store=[True])
        direction = backend.directions.for_system(d["system"])
        out = []
        for (what, rnd, end), (start, stop) in zip(which, spans, strict=True):
            stop = stop if end == "stop" else stop - 1  # a cut reply never generated the end-of-turn token
            rows = proj[start - 1 - first : stop - 1 - first]
            out.append(ProjectionRecord(pair=d["pair"], round=rnd, what=what, direction=direction.id,
                                        band=list(direction.band), reply=_round(rows.mean(0)), prompt=_round(rows[0]),
                                        positions=len(rows)))
        return out


def _round(values) -> list[float]:
    return [round(float(x), 5) for x in values]


def recorded_dialogs(from_run: str | Path, limit: int | None = None, what: str = "project") -> list[dict[str, Any]]:
    """Each recorded self-chat or replay dialog (condition 'persona') with its agent turns, how each ended, and its
    agent probes, up to its last complete round: what the teacher-forced protocols read again."""
    rd = RunDir(from_run)
    if not (rd.path / "manifest.json").is_file():
        raise DriftlabError(f"{rd.path} is not a run directory.", hint="Give the --out of a driftlab run.")
    manifest = rd.read_manifest()
    if manifest.get("protocol", "selfchat") not in ("selfchat", "replay"):  # a replay's user turns are in its plan
        raise DriftlabError(f"{rd.path} is a {manifest.get('protocol')} run, not a self-chat or a replay.")
    config = config_of(manifest)
    records = rd.records(DIALOG_RECORDS)
    dialogs = Dialog.from_records(pairs_from_manifest(manifest), ["persona"], records)
    ends = {(r.pair, r.round, r.kind): r.finish_reason for r in records
            if r.condition == "persona" and (r.kind == "turn" and r.speaker == "agent" or
                                              r.kind == "probe" and r.target == "agent" and r.repeat == 0)}
    probes = {(r.pair, r.round): r.text for r in records if r.kind == "probe" and r.condition == "persona"
              and r.target == "agent" and r.repeat == 0}
    after = int(config.get("probe_after", "user") == "agent")
    out = []
    for d in dialogs[:limit]:
        n = d.rounds_complete()
        if not n:
            continue
        out.append({
            "pair": d.pair.index, "system": d.pair.agent.system_prompt, "probe": d.pair.agent.probe,
            "a": [d.a[i] for i in range(1, n + 1)], "b": [d.b[i] for i in range(1, n + 1)],
            "turn_ends": [ends[(d.pair.index, i, "turn")] for i in range(1, n + 1)],
            "probes": [{"round": i, "reply": probes[(d.pair.index, i)], "end": ends[(d.pair.index, i, "probe")],
                        "view": i + after} for i in range(1, n + 1) if (d.pair.index, i) in probes
                       and i + after <= n + 1],
        })
    if not out:
        raise DriftlabError(f"{rd.path} has no complete agent turns to {what}.")
    return out
