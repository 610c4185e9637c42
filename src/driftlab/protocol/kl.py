"""`driftlab kl`: a recorded self-chat's drift in its next-token distributions, teacher-forced.

Per agent turn (and agent probe reply) of every dialog, the reminded KL and the prompt's influence
(`protocol.divergence`, the one definition a live `--kl` run shares), one record each. A batch of
dialogs is read turn by turn, the same turn of every dialog in one pass: each turn's contexts extend
its dialog's last ones in the prefix cache, so only their new tokens are computed.
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
    batch_size: int = Field(8, ge=1, le=1024, description="dialogs read together, turn by turn")

    RESUME_IGNORES: ClassVar[tuple[str, ...]] = (*ProtocolConfig.RESUME_IGNORES, "batch_size")


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

    def units(self, state: RunState) -> Iterable[tuple[list[dict[str, Any]], Interventions]]:
        steer = Interventions.parse(state.manifest["steer"])
        todo = [d for d in state.manifest["dialogs"] if ("kl", d["pair"], 1, "turn") not in state.done]
        for first in range(0, len(todo), self.config.batch_size):
            yield todo[first : first + self.config.batch_size], steer

    def run_unit(self, unit: tuple[list[dict[str, Any]], Interventions]) -> list[KLRecord]:
        """Every reply of the dialogs, the k-th of each dialog in one pass (its turns in order, then its probes)."""
        dialogs, steer = unit
        replies = [list(_replies(d)) for d in dialogs]
        records: list[KLRecord] = []
        for k in range(max(map(len, replies))):
            step = [(d, r[k]) for d, r in zip(dialogs, replies, strict=True) if k < len(r)]
            found = divergence.divergences(self.backend, [(conv, end) for _, (_, _, conv, end) in step], steer,
                                           chunk=len(step))
            records += [KLRecord(pair=d["pair"], round=rnd, what=what, **f.fields())
                        for (d, (what, rnd, _, _)), f in zip(step, found, strict=True)]
        return records


def _replies(d: dict[str, Any]) -> Iterable[tuple[str, int, Conversation, str]]:
    """(what, round, the conversation up to the reply, how it ended) of each agent turn in order, then each probe."""
    dialog = agent_conversation(d["system"], d["a"], d["b"])
    for i, end in enumerate(d["turn_ends"], 1):
        yield "turn", i, dialog[: 1 + 2 * i], end
    for probe in d["probes"]:
        k = probe["view"] - 1  # exchanges before the probe
        asked = [{"role": "user", "content": d["probe"]}, {"role": "assistant", "content": probe["reply"]}]
        yield "probe", probe["round"], dialog[: 1 + 2 * k] + asked, probe["end"]
