"""Drift in what the model would say: two KL divergences per agent turn, teacher-forced on a recorded
self-chat (`driftlab kl`).

Why: the probe score, pi and the projection each read something other than the next-token
distribution, which is what a reply is drawn from. Per agent turn (and agent probe reply) this reads
the recorded reply's tokens again under three contexts and compares the model's next-token
distributions at the positions that generated them (the last prompt token, then every reply token
but the last; the end-of-turn token too where the reply ended with it), averaged over them:

* reminded KL, D_t = KL(q_t || p_t) (Dongre et al. 2025, "Drift No More?"): q_t is the model in the
  dialog as it was (the model under test), p_t the same dialog with the system prompt restated just
  before the user turn the reply answers (the goal-consistent reference). Where the system prompt
  already stands right before that turn (the first turn; a turn SPR reminded), the two contexts are
  the same and D_t is exactly 0.
* prompt influence, KL(p_with || p_without): the dialog as it was against the same dialog with its
  system prompt emptied (`chat.base.without_system`, CFG's unconditional context): how much the
  prompt still changes what the model says; 0 is the no-persona baseline of Persistent Personas.

The run's conversation steers (SPR) shape every context as they shaped what the model saw; its
other steers act in every context. Contexts extend the dialog's earlier ones, so the prefix cache
computes only their new tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, Field, TypeAdapter

from driftlab.chat.base import Conversation, token_backend, without_system
from driftlab.errors import DriftlabError
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
        backend = token_backend(self.backend, "driftlab kl")
        if not backend.capabilities.prompt_scores:
            raise DriftlabError(f"{backend.name} gives no whole next-token distributions at a prompt's positions, and "
                                "driftlab kl compares them.", hint="Run driftlab kl on the transformers engine.")

    def _dialogs(self) -> list[dict[str, Any]]:
        return recorded_dialogs(self.config.from_run, self.config.dialogs, what="read again")

    def plan(self) -> dict[str, Any]:
        steer = config_of(RunDir(self.config.from_run).read_manifest()).get("steer") or []
        return {"dialogs": self._dialogs(), "steer": Interventions.parse(steer).without("trace").specs()}

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
        as_is = steer.model_view(conv)
        reminded = remind(as_is)
        contexts = [as_is, without_system(as_is)] + ([reminded] if reminded is not None else [])
        distributions = reply_logprobs(self.backend, contexts, steer, end)
        (a, n), (b, _) = distributions[0], distributions[1]
        prompt = kl_mean(a, b)
        reminded_kl = kl_mean(a, distributions[2][0]) if reminded is not None else 0.0
        return KLRecord(pair=d["pair"], round=rnd, what=what, reminded=round(reminded_kl, 6), prompt=round(prompt, 6),
                        positions=n)


def remind(conversation: Conversation) -> Conversation | None:
    """The conversation with its system prompt restated (a system message) just before its last user
    turn; None where it already stands there (then the reminded context is the conversation itself)."""
    last_user = max(i for i, m in enumerate(conversation) if m["role"] == "user")
    system = conversation[0]
    if system["role"] != "system" or conversation[last_user - 1] == system:
        return None
    return [*conversation[:last_user], dict(system), *conversation[last_user:]]


def reply_logprobs(backend, contexts: list[Conversation], steer: Interventions,
                   end: str) -> list[tuple[torch.Tensor, int]]:
    """Per context (each ending with the same assistant reply): the next-token log-probabilities [n, V] at
    the n positions that generated the reply (its end-of-turn token only where the reply ended with it)."""
    prompts, keeps, windows = [], [], []
    for conv in contexts:
        rendered = backend.render(conv, add_generation_prompt=False, interventions=steer)
        start = len(backend.render(conv[:-1], add_generation_prompt=True, interventions=steer).ids)
        ids = rendered.ids
        stop = next((i + 1 for i in range(start, len(ids)) if ids[i] in backend.stop_ids), len(ids))
        stop = stop if end == "stop" else stop - 1  # a cut reply never generated its end-of-turn token
        prompts.append(rendered)
        keeps.append(len(ids) - (start - 1))
        windows.append(stop - start)  # positions start - 1 .. stop - 2 predict the reply's tokens
    lps = backend.prompt_logprobs(prompts, keeps, interventions=steer.without("spr"),
                                  cache_store=[i != 2 for i in range(len(prompts))])
    return [(lp[:n], n) for lp, n in zip(lps, windows, strict=True)]


def kl_mean(p: torch.Tensor, q: torch.Tensor) -> float:
    """The mean over positions of KL(P || Q), from log-probabilities [n, V], in float64."""
    p64, q64 = p.double(), q.double()
    return float((p64.exp() * (p64 - q64)).sum(-1).clamp_min(0.0).mean())
