"""The self-chat's data: persona pairs, typed records, and dialogs rebuilt from records.

Every consumer of a self-chat run (resume, attention-decay replay, the HTML report) gets
its dialogs from `Dialog.from_records`, so there is one reading of what a run contains.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from driftlab.bench import Persona, get_persona
from driftlab.chat.base import Conversation

Condition = Literal["persona", "empty-user"]

# How the reference implementation (likenneth/persona_drift) shows the user LM the first
# exchange, so the user LM's own dialog starts with a user turn as chat templates expect.
FOLD_TEMPLATE = 'In the last round, you asked me: "{a}" and I answered: "{b}"'


class _Record(BaseModel):
    # extra="allow": a newer driftlab may add fields; readers keep them.
    model_config = ConfigDict(extra="allow", frozen=True)

    pair: int = Field(ge=0)
    condition: Condition
    round: int = Field(ge=1)
    text: str
    n_tokens: int = Field(ge=0)
    finish_reason: Literal["stop", "length"]
    seed: int | None = None
    # The agent's reply, measured two more ways where the run asked (agent side only): pi, the
    # attention mass on the system prompt per layer (mean over heads and the reply's tokens; with
    # `--steer trace`), and the reply's projection onto its persona's direction per layer (with
    # `--directions`; `Reply.activation`: reply, prompt and last, normalised 0 without to 1 with).
    pi: list[float] | None = None
    activation: dict[str, Any] | None = None
    # Under `--steer when-drifting:r=R`: its decision for this reply, {"r", "pi_ratio", "steered"}
    # (`by=projection`: "by", "projection_first", "projection", "projection_ratio" for "pi_ratio").
    gate: dict[str, Any] | None = None
    # With `--kl` (agent side only): the reply's drift in next-token distributions (`protocol.divergence`),
    # {"reminded", "prompt", "positions"}: KL to the system prompt restated before the turn, KL to the
    # dialog without its system prompt, in nats per reply token, and how many positions they average.
    kl: dict[str, float | int] | None = None


class TurnRecord(_Record):
    """A dialog turn: the user LM's a_i (i >= 2; a_1 is the starter) or the agent's b_i. A replay's
    agent turns carry their persona's score beside (fields `score`, or `error`: why none)."""

    kind: Literal["turn"] = "turn"
    speaker: Literal["user", "agent"]

    @property
    def key(self) -> tuple:
        return ("turn", self.pair, self.condition, self.round, self.speaker)


class ProbeRecord(_Record):
    """A probe reply b'_i and its score by the probed persona's measure (never part of the dialog)."""

    kind: Literal["probe"] = "probe"
    target: Literal["agent", "user"]
    persona: str
    repeat: int = Field(ge=0)
    score: float | None = Field(None, ge=0.0, le=1.0)
    # Why the measure gave no score (it raised, or returned NaN or a value outside [0, 1]): the
    # reply is kept, the run goes on, and reports count these apart from replies cut too short.
    error: str | None = None
    # The run's judge (`--judge`) rating the same reply beside the measure, or why it gave none.
    judge: float | None = Field(None, ge=0.0, le=1.0)
    judge_error: str | None = None

    @property
    def key(self) -> tuple:
        return ("probe", self.pair, self.condition, self.round, self.target, self.repeat)


SelfChatRecord = Annotated[TurnRecord | ProbeRecord, Field(discriminator="kind")]
RECORDS: TypeAdapter = TypeAdapter(SelfChatRecord)


@dataclass
class Pair:
    """A dialog's parties: the agent's persona and the user, a persona (self-chat: a user LM) or, in a
    replay, the user turns from data (`turns`, every round's; `user` None)."""

    index: int
    agent: Persona
    user: Persona | None
    starter: str
    turns: list[str] | None = None
    source: str | None = None  # where a replay's turns come from (a conversation's id)

    def plan_entry(self) -> dict[str, Any]:
        if self.user is None:
            return {"pair": self.index, "agent": self.agent.id, "user": None, "starter": self.starter,
                    "turns": self.turns, "source": self.source, "agent_category": self.agent.category}
        return {"pair": self.index, "agent": self.agent.id, "user": self.user.id, "starter": self.starter,
                "agent_category": self.agent.category, "user_category": self.user.category}


def pairs_from_manifest(manifest: dict[str, Any]) -> list[Pair]:
    """The pairs a run was planned with, personas as recorded (not as the data is today)."""
    recorded = {pid: Persona.model_validate(p) for pid, p in (manifest.get("personas") or {}).items()}
    persona = lambda pid: None if pid is None else recorded.get(pid) or get_persona(pid)  # noqa: E731
    return [Pair(p["pair"], persona(p["agent"]), persona(p["user"]), p["starter"], p.get("turns"), p.get("source"))
            for p in manifest.get("pairs", [])]


@dataclass
class Dialog:
    """One conversation of the self-chat: a pair under a condition, its turns keyed by round.

    `a[i]` is the user LM's turn of round i (a[1] is the starter), `b[i]` the agent's reply.
    Keyed, not listed, so a missing record in the middle stays a hole to fill, never a shift.
    """

    pair: Pair
    condition: str
    a: dict[int, str] = field(default_factory=dict)
    b: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.a.setdefault(1, self.pair.starter)
        for i, turn in enumerate(self.pair.turns or [], 1):  # a replay's user turns are data, not records
            self.a.setdefault(i, turn)

    @property
    def length(self) -> int | None:
        """A replayed dialog's rounds (its user turns); None for a self-chat (the run's rounds)."""
        return len(self.pair.turns) if self.pair.turns is not None else None

    @classmethod
    def from_records(cls, pairs: Iterable[Pair], conditions: Iterable[str], records: Iterable[Any]) -> list[Dialog]:
        """One dialog per (condition, pair), in that order, filled with the turn records."""
        dialogs = {(c, p.index): cls(p, c) for c in conditions for p in pairs}
        for r in records:
            if r.kind == "turn" and (d := dialogs.get((r.condition, r.pair))) is not None:
                (d.a if r.speaker == "user" else d.b)[r.round] = r.text
        return list(dialogs.values())

    def rounds_complete(self) -> int:
        """n such that rounds 1..n all have both turns (the dialog prefix that can be replayed)."""
        n = 0
        while n + 1 in self.a and n + 1 in self.b:
            n += 1
        return n

    def agent_view(self, round_: int, last_user: str) -> Conversation:
        """What the agent sees at round i: [s_B, a_1, b_1, ..., a_{i-1}, b_{i-1}, last_user]."""
        conv: Conversation = [{"role": "system", "content": self.pair.agent.system_prompt}]
        for j in range(1, round_):
            conv += [{"role": "user", "content": self.a[j]}, {"role": "assistant", "content": self.b[j]}]
        conv.append({"role": "user", "content": last_user})
        return conv

    def user_view(self, round_: int, fold: bool) -> Conversation:
        """What the user LM sees before writing a_i (i >= 2): the dialog with roles swapped.

        The empty-user ablation gives the user LM an empty system prompt, as the paper does,
        not none: without a system message some templates (Qwen's) insert their own default.
        """
        system = self.pair.user.system_prompt if self.condition == "persona" else ""
        conv: Conversation = [{"role": "system", "content": system}]
        if fold:
            conv.append({"role": "user", "content": FOLD_TEMPLATE.format(a=self.a[1], b=self.b[1])})
        else:
            conv += [{"role": "assistant", "content": self.a[1]}, {"role": "user", "content": self.b[1]}]
        for j in range(2, round_):
            conv += [{"role": "assistant", "content": self.a[j]}, {"role": "user", "content": self.b[j]}]
        return conv
