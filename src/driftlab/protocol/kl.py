"""`driftlab kl`: a recorded self-chat's drift in its next-token distributions, teacher-forced.

Per agent turn (and agent probe reply) of every dialog, the reminded KL and the prompt's influence
(`protocol.divergence`, the one definition a live `--kl` run shares), one record each. A dialog's
turns are read in order, each on its own, so each turn's contexts extend the last turn's in the
prefix cache and only their new tokens are computed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter

from driftlab.chat.base import Conversation
from driftlab.protocol import divergence
from driftlab.protocol.decay import agent_conversation
from driftlab.protocol.project import recorded_dialogs
from driftlab.protocol.registry import register
from driftlab.protocol.runner import Protocol, ProtocolConfig, RunState, config_of
from driftlab.records.rundir import RunDir
from driftlab.steering.interventions import Interventions


class KLConfig(ProtocolConfig):
    """Which run to read again."""

    from_run: str = Field(description="a self-chat run directory")
    dialogs: int | None = Field(None, ge=1, description="at most this many dialogs (default: all)")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = ProtocolConfig.RESUME_IGNORES


class KLRecord(BaseModel):
    """One agent turn's (or agent probe reply's) KL divergences, each the mean over its positions (nats)."""

    kind: Literal["kl"] = "kl"
    pair: int = Field(ge=0)
    round: int = Field(ge=1)
    what: Literal["turn", "probe"]
    reminded: float = Field(ge=0.0)  # KL(as it was || system prompt restated before the turn)
    prompt: float = Field(ge=0.0)  # KL(as it was || system prompt emptied)
    positions: int = Field(ge=1)

    @property
    def key(self) -> tuple:
        return ("kl", self.pair, self.round, self.what)


@register
class KL(Protocol[KLConfig]):
    name = "kl"
    records = TypeAdapter(KLRecord)
    unit = "turns"

    def check(self) -> None:
        self._dialogs()

    def require(self) -> None:
        divergence.require(self.backend, "driftlab kl")

    def _dialogs(self) -> list[dict[str, Any]]:
        return recorded_dialogs(self.config.from_run, self.config.dialogs, what="read again")

    def plan(self) -> dict[str, Any]:
        steer = config_of(RunDir(self.config.from_run).read_manifest()).get("steer") or []
        return {"dialogs": self._dialogs(), "steer": divergence.measured_steer(Interventions.parse(steer)).specs()}

    def describe(self) -> dict[str, Any]:
        return {"models": {"agent": self.backend.describe()}, "from_run": str(Path(self.config.from_run))}

    @classmethod
    def expected(cls, manifest: dict[str, Any]) -> dict[str, int]:
        return {"kl": sum(len(d["a"]) + len(d["probes"]) for d in manifest["dialogs"])}

    def units(self, state: RunState) -> Iterable[tuple[dict[str, Any], Interventions]]:
        steer = Interventions.parse(state.manifest["steer"])
        for d in state.manifest["dialogs"]:
            if ("kl", d["pair"], 1, "turn") not in state.done:
                yield d, steer

    def run_unit(self, unit: tuple[dict[str, Any], Interventions]) -> list[KLRecord]:
        """Every agent turn of the dialog, in order (each context extends the last turn's), then its probes."""
        d, steer = unit
        dialog = agent_conversation(d["system"], d["a"], d["b"])
        records = [self._turn(d, dialog[: 1 + 2 * i], steer, "turn", i, end)
                   for i, end in enumerate(d["turn_ends"], 1)]
        for probe in d["probes"]:
            k = probe["view"] - 1  # exchanges before the probe
            conv = dialog[: 1 + 2 * k] + [{"role": "user", "content": d["probe"]},
                                          {"role": "assistant", "content": probe["reply"]}]
            records.append(self._turn(d, conv, steer, "probe", probe["round"], probe["end"]))
        return records

    def _turn(self, d: dict[str, Any], conv: Conversation, steer: Interventions, what: str, rnd: int,
              end: str) -> KLRecord:
        """The KL divergences at the last assistant turn of `conv`."""
        found = divergence.divergences(self.backend, [(conv, end)], steer, chunk=1)[0]
        return KLRecord(pair=d["pair"], round=rnd, what=what, **found.fields())
